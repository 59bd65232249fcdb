"""`zephon relay`: a relay node of the refit tree, as a daemon or a one-shot (cron) job.

    zephon relay --from URI [--from-endpoint URL] --to URI [--to-endpoint URL] [--to URI ...]
                 [--config relay.toml] [--once] [--poll-interval S] [--workers N] [--metrics-port P]

Every `--from-*`/`--to-*` option applies to the `--from`, or to the `--to` before it. Each
endpoint's credentials come from the AWS chain (environment, `--to-profile`...) unless the
config file names them, literally or by environment variable (keep such a file private):

    poll_interval = 0.5
    workers = 8
    metrics_port = 9464
    [from]
    uri = "s3://trainer/policy/"
    endpoint_url = "http://10.0.0.1:8333"
    access_key_id_env = "TRAINER_KEY_ID"
    secret_access_key_env = "TRAINER_SECRET"
    [[to]]
    uri = "s3://region-a/policy/"
    endpoint_url = "http://10.1.0.1:8333"
    profile = "region-a"

Logs are JSON lines on stderr (`--log-format text` for people). With `--metrics-port`, GET
http://127.0.0.1:P/metrics serves Prometheus text and /healthz says whether the last sync was
clean and the parent answers polls (`--metrics-host 0.0.0.0`, or `metrics_host`, serves them to
other hosts too). SIGTERM or SIGINT stops the daemon between syncs (a sync still running after
`--grace` seconds is cancelled: every write it left is invisible or complete).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from zephon_stream.connectors import folder_uri, missing_locally
from zephon_stream.errors import ConfigError, ZephonError, closest_key, unwrap_groups
from zephon_stream.relay import Prefix, Relay, prometheus_text
from zephon_stream.relay.node import is_mistake

__all__ = ["PrefixConfig", "RelayConfig", "add_subparser", "serve_metrics"]

log = logging.getLogger("zephon_stream.relay.node")


class PrefixConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One prefix of the tree and its store's options; `*_env` names an environment variable."""

    uri: str
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    access_key_id_env: str | None = None
    secret_access_key_env: str | None = None
    session_token_env: str | None = None
    options: dict[str, int | float] = {}  # S3Settings fields, e.g. max_in_flight = 32

    def prefix(self) -> Prefix:
        opts: dict[str, Any] = {k: getattr(self, k) for k in ("endpoint_url", "region", "addressing_style",
                                                              "profile") if getattr(self, k) is not None}
        for name in ("access_key_id", "secret_access_key", "session_token"):
            value, env = getattr(self, name), getattr(self, f"{name}_env")
            if env is not None:
                if env not in os.environ:
                    raise ConfigError(f"{self.uri}: {name}_env names ${env}, which is not set")
                value = os.environ[env]
            if value is not None:
                opts[name] = value
        if not self.uri.startswith("s3://"):  # file:// and memory:// take no options: a mistake, not a no-op
            given = sorted(k for k in ("endpoint_url", "region", "addressing_style", "profile", "access_key_id",
                                       "secret_access_key", "session_token") if k in opts)
            if given or self.options:
                raise ConfigError(f"{self.uri}: {', '.join(given + sorted(self.options))} "
                                  f"{'is' if len(given) + len(self.options) == 1 else 'are'} for s3:// prefixes only")
            opts = {}
        return Prefix(self.uri, **opts, **self.options)


class RelayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, rename={"parent": "from"}):
    """The whole relay: its parent (`[from]`), its children (`[[to]]`) and its settings."""

    parent: PrefixConfig | None = None
    to: list[PrefixConfig] = []
    poll_interval: float = 1.0
    workers: int = 8
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    keep_versions: int | None = None
    verify_existing: bool = True
    stream_ahead: bool = False
    grace: float = 10.0


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `relay` command to an argparse subparsers object; it sets `func`."""
    p = subparsers.add_parser("relay", help="copy refit versions from a parent prefix to child prefixes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="a TOML file (see above); flags add to it and override it")
    p.add_argument("--from", dest="parent", action=_From, metavar="URI",
                   help="the parent prefix (a URI, or a local folder's path)")
    p.add_argument("--to", dest="children", action=_To, metavar="URI",
                   help="a child prefix (a URI, or a local folder's path; repeatable)")
    for side, action in (("from", _FromOption), ("to", _ToOption)):
        for option, meta in (("endpoint", "URL"), ("region", "NAME"), ("profile", "NAME")):
            p.add_argument(f"--{side}-{option}", dest=f"{side}_{option}", action=action, metavar=meta,
                           help=f"S3 {option} of the preceding --{side}")
    p.add_argument("--once", action="store_true", help="copy everything pending, then exit (cron, tests)")
    p.add_argument("--poll-interval", type=float, metavar="S", help="seconds between polls (default 1)")
    p.add_argument("--metrics-port", type=int, metavar="P", help="serve /metrics and /healthz on port P")
    p.add_argument("--metrics-host", metavar="ADDR",
                   help="the address they listen on (default 127.0.0.1: this machine only; 0.0.0.0 or an "
                        "interface's address for a scraper on another host)")
    p.add_argument("--workers", type=int, metavar="N", help="objects copied concurrently (default 8)")
    p.add_argument("--lanes", dest="workers", type=int, action=_Lanes, help=argparse.SUPPRESS)
    p.add_argument("--keep-versions", type=int, metavar="N",
                   help="retention at the children (default: mirror the parent's)")
    p.add_argument("--stream-ahead", action="store_true", default=None,
                   help="poll with a LIST of the next version and copy its objects while it is being "
                        "published (lower latency; a LIST per poll costs more than a HEAD)")
    p.add_argument("--grace", type=float, metavar="S", help="on SIGTERM, seconds a running sync may finish")
    p.add_argument("--log-format", choices=["json", "text"], default="json",
                   help="json: one JSON object per line (default); text: one line for people, fields as key=value")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   metavar="LEVEL", help="DEBUG, INFO (default), WARNING or ERROR")
    p.set_defaults(func=main, parent=None, children=None)
    return p


_FIELDS = {"endpoint": "endpoint_url", "region": "region", "profile": "profile"}


class _Lanes(argparse.Action):
    """`--lanes N`, the deprecated name of `--workers N` (lanes are the loader's, not concurrency)."""

    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: Any = None) -> None:
        print("zephon: warning: --lanes is deprecated, use --workers", file=sys.stderr)
        ns.workers = value


class _From(argparse.Action):
    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: Any = None) -> None:
        ns.parent = {"uri": folder_uri(value)}


class _To(argparse.Action):
    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: Any = None) -> None:
        ns.children = [*(ns.children or []), {"uri": folder_uri(value)}]


def _set(parser: Any, table: dict[str, Any], option: str, dest: str, value: Any) -> None:
    field = _FIELDS[dest.partition("_")[2]]
    if field in table:
        parser.error(f"{option} given twice for {table['uri']}")
    table[field] = value


class _FromOption(argparse.Action):
    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: Any = None) -> None:
        if ns.parent is None:
            parser.error(f"{option} must follow --from")
        _set(parser, ns.parent, option, self.dest, value)


class _ToOption(argparse.Action):
    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: Any = None) -> None:
        if not ns.children:
            parser.error(f"{option} must follow a --to")
        _set(parser, ns.children[-1], option, self.dest, value)


def load_config(args: argparse.Namespace) -> RelayConfig:
    """The config file (if any) with the command line's prefixes and settings on top."""
    raw: dict[str, Any] = {}
    if args.config is not None:
        try:
            raw = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{args.config}: cannot read the relay config ({exc})") from exc
    _rename_lanes(raw, args.config)
    if args.parent is not None:
        raw["from"] = args.parent
    if args.children:
        raw["to"] = [*raw.get("to", []), *args.children]
    for name in ("poll_interval", "metrics_port", "metrics_host", "workers", "keep_versions", "grace",
                 "stream_ahead"):
        if getattr(args, name) is not None:
            raw[name] = getattr(args, name)
    try:
        cfg = msgspec.convert(raw, RelayConfig)
    except msgspec.ValidationError as exc:
        hint = closest_key(str(exc), {"": RelayConfig, "from": PrefixConfig, "to": PrefixConfig})
        raise ConfigError(f"{args.config or 'command line'}: invalid relay config: {exc}{hint}") from exc
    if cfg.parent is None or not cfg.to:
        raise ConfigError("a relay needs a parent (--from URI) and at least one child (--to URI)")
    if not cfg.grace >= 0:  # -1 was taken: a SIGTERM then cut a running sync at once
        raise ConfigError(f"grace={cfg.grace}: give the seconds a running sync may take to finish on SIGTERM, >= 0")
    if args.once and args.metrics_port is not None:  # a config file's port is the daemon's: no error for it
        raise ConfigError("--metrics-port serves a daemon's /metrics and /healthz; --once syncs once and serves "
                          "nothing: leave out one of them")
    return cfg


def _rename_lanes(raw: dict[str, Any], path: Path | None) -> None:
    """The config key `lanes` is the deprecated name of `workers`: take it, with a warning."""
    if "lanes" not in raw:
        return
    if "workers" in raw:
        raise ConfigError(f"{path}: give `workers` alone (`lanes` is its deprecated name)")
    log.warning("%s: the relay setting `lanes` is deprecated, use `workers`", path,
                extra={"event": "deprecated", "setting": "lanes"})
    raw["workers"] = raw.pop("lanes")


def main(args: argparse.Namespace) -> int:
    _setup_logging(args.log_format, args.log_level)
    try:
        cfg = load_config(args)
        parent = cfg.parent.prefix()
        relay = Relay(parent, [c.prefix() for c in cfg.to], workers=cfg.workers, poll_interval=cfg.poll_interval,
                      keep_versions=cfg.keep_versions, verify_existing=cfg.verify_existing,
                      stream_ahead=cfg.stream_ahead)
    except ZephonError as exc:  # a usage error: a plain line, like every other command's, not a log record
        print(f"zephon relay: error: {exc}", file=sys.stderr)
        return 2
    _warn_missing_parent(cfg.parent.uri)
    try:
        with unwrap_groups():  # a failure in the daemon's task group is one error, not a group
            return anyio.run(_once if args.once else _daemon, relay, cfg)
    except ZephonError as exc:
        if str(exc) == relay.statistics().last_error:  # the first sync's error, logged as it came (a trial
            log.error("exiting on the error above", extra={"event": "fatal"})  # saw the line twice)
        else:
            log.error("%s", exc, extra={"event": "fatal"})
        return 2


def _warn_missing_parent(uri: str) -> None:
    """A local parent folder that does not exist: a relay may start before the first publish, but a
    mistyped --from looked the same (nothing relayed, and a daemon polling it for ever)."""
    if missing_locally(uri):
        log.warning("the parent %s does not exist (yet): nothing is relayed until a publisher makes it; check --from "
                    "if it should", uri, extra={"event": "parent_missing"})


async def _once(relay: Relay, cfg: RelayConfig) -> int:
    async with relay:
        report = await relay.sync()
    for name, versions in report.committed.items():
        print(f"{name}: relayed {len(versions)} version(s) {versions}; parent at {report.parent_latest}")
    for exc in report.errors:
        print(f"zephon relay: error: {exc}", file=sys.stderr)
    if any(is_mistake(exc) for exc in report.errors):
        return 2  # a mistake in the command or its config (a missing bucket too), as every command says one
    return 0 if report.ok else 1


async def _daemon(relay: Relay, cfg: RelayConfig) -> int:
    stop = anyio.Event()
    async with relay, anyio.create_task_group() as tg:
        tg.start_soon(_on_signal, stop, tg.cancel_scope, cfg.grace)
        if cfg.metrics_port is not None:
            await tg.start(serve_metrics, relay, cfg.metrics_port, cfg.metrics_host)
        log.info("relay started", extra={"event": "started", "parent": relay.parent.name,
                                         "children": [c.name for c in relay.child_prefixes]})
        await relay.run(stop)
        tg.cancel_scope.cancel()
    log.info("relay stopped", extra={"event": "stopped"})
    return 0


async def _on_signal(stop: anyio.Event, scope: anyio.CancelScope, grace: float) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("stopping", extra={"event": "stopping", "signal": signal.Signals(signum).name})
            stop.set()
            break
    await anyio.sleep(grace)  # the sync in progress had its chance: what it wrote is safe to cut
    log.warning("the sync under way did not end within the grace: cancelled (each version it was writing is "
                "left invisible, never half-visible; the next run copies it)",
                extra={"event": "sync_cancelled", "grace_s": grace})
    scope.cancel()


async def serve_metrics(relay: Relay, port: int, host: str = "127.0.0.1", *,
                        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve GET /metrics (Prometheus text) and /healthz on `host`:`port` (0: any free port,
    reported through `task_status`), until cancelled."""
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        raise ConfigError(f"metrics on {host}:{port}: cannot listen there ({exc.strerror or exc}): give another "
                          "--metrics-port, or a --metrics-host that is an address of this machine") from exc
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)
    log.info("metrics listening", extra={"event": "metrics_listening", "host": host, "port": bound})
    task_status.started(bound)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(10):
                    await stream.send(_respond(relay, await _request_line(stream)))
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    OSError):
                pass  # a client that left or stalled costs nothing more

    async with listener:
        await listener.serve(handle)


async def _request_line(stream: anyio.abc.SocketStream) -> str:
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 8192:
        head += await stream.receive(4096)
    return head.split(b"\r\n", 1)[0].decode("latin-1")


def _respond(relay: Relay, line: str) -> bytes:
    parts = line.split()
    path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
    stats = relay.statistics()
    if parts[:1] not in (["GET"], ["HEAD"]):  # HEAD: what some load balancers' health checks send
        status, body, ctype = "405 Method Not Allowed", "use GET\n", "text/plain"
    elif path == "/metrics":
        status, body, ctype = "200 OK", prometheus_text(stats), "text/plain; version=0.0.4"
    elif path == "/healthz":
        ok = stats.healthy
        status = "200 OK" if ok else "503 Service Unavailable"
        body, ctype = ("ok\n" if ok else f"unhealthy: {stats.last_error}\n"), "text/plain"
    else:
        status, body, ctype = "404 Not Found", "try /metrics or /healthz\n", "text/plain"
    data = body.encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}; charset=utf-8\r\nContent-Length: {len(data)}\r\n"
    if status.startswith("405"):
        head += "Allow: GET, HEAD\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + (b"" if parts[:1] == ["HEAD"] else data)


_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...`: the fields the JSON lines carry, for people."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD)
        line = super().formatMessage(record)
        return f"{line} {fields}" if fields else line


def _setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("zephon_stream")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
