"""`zephon refit publish|pull|status`: the refit relay from the command line.

    zephon refit publish --prefix URI --weights FILE.safetensors [--keyframe-every K] [--workers N]
    zephon refit pull    --prefix URI --weights FILE.safetensors [--workers N]   (updates FILE in place,
                                                                           or creates it whole)
    zephon refit pull    --prefix URI --weights DIR/model.safetensors.index.json [--max-shard-size 5GB]
                         (a sharded checkpoint: updated in place, or laid out whole as save_pretrained does)
    zephon refit status  --prefix URI

Building the parser imports no torch (`zephon relay --help` stays fast); `publish` and `pull`
load it when they run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio

from zephon_stream.cli.shard import parse_size
from zephon_stream.connectors import folder_uri, missing_locally, open_store
from zephon_stream.errors import ConfigError, DataError, RefitError, ZephonError, unwrap_groups
from zephon_stream.refit.versions import find_latest, list_versions, read_manifest

if TYPE_CHECKING:
    from zephon_stream.refit.safetensors import Mapped

__all__ = ["add_subparser"]


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `refit` command to an argparse subparsers object; each command sets `func`."""
    p = subparsers.add_parser("refit", help="publish, pull and inspect delta-compressed weight versions")
    sub = p.add_subparsers(dest="refit_command", required=True)
    pub = sub.add_parser("publish", help="publish a safetensors file as the next version")
    pub.add_argument("--prefix", required=True, type=_prefix,
                     help="file:///dir/ (or a local folder's path) or s3://bucket/prefix/ (memory://name/ lives "
                          "in this process only)")
    pub.add_argument("--weights", required=True, metavar="FILE",
                     help="the .safetensors file to publish, or a sharded checkpoint's model.safetensors.index.json")
    pub.add_argument("--keyframe-every", type=int, default=10, metavar="K",
                     help="publish a full keyframe every K versions, deltas between (default 10)")
    pub.add_argument("--keep-versions", type=int, default=8, metavar="N",
                     help="versions kept under the prefix, and every version since the newest keyframe older "
                          "than those (a subscriber needs it); older ones are deleted (default 8)")
    pub.add_argument("--chunk-bytes", type=parse_size, default=4 << 20, metavar="SIZE",
                     help="bytes per chunk, the unit of upload and digest (default 4 MiB)")
    pub.add_argument("--overwrite", action="store_true", help="also publish overwrite objects (for retries)")
    pub.add_argument("--workers", type=int, default=4, metavar="N", help="chunks encoded and uploaded concurrently")
    pub.set_defaults(func=_publish)
    pull = sub.add_parser("pull", help="update a safetensors file in place to the latest version")
    pull.add_argument("--prefix", required=True, type=_prefix, metavar="URI",
                      help="where the versions were published (a URI, or a local folder's path)")
    pull.add_argument("--weights", required=True, metavar="FILE",
                      help="the .safetensors file to update in place, or a sharded checkpoint's "
                           "model.safetensors.index.json (a missing one is created from the newest version)")
    pull.add_argument("--record", metavar="FILE", help="local version record (default: FILE.refit beside the weights)")
    pull.add_argument("--workers", type=int, default=4, metavar="N", help="chunks fetched and checked concurrently")
    pull.add_argument("--max-shard-size", type=parse_size, default=5 * 1000 ** 3, metavar="SIZE",
                      help="a missing index is laid out as a new sharded checkpoint of files of at most SIZE of "
                           "tensors each, as Hugging Face's save_pretrained (default 5GB)")
    pull.set_defaults(func=_pull)
    st = sub.add_parser("status", help="list versions, their sizes and keyframes")
    st.add_argument("--prefix", required=True, type=_prefix, metavar="URI",
                    help="where the versions were published (a URI, or a local folder's path)")
    st.set_defaults(func=_status)
    for command in (pub, pull, st):
        command.add_argument("--endpoint-url", metavar="URL",
                             help="an s3:// prefix's endpoint, for MinIO, SeaweedFS, R2 ... (default: "
                                  "$AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL, else AWS)")
        command.add_argument("--region", metavar="NAME", help="an s3:// prefix's region (default: $AWS_REGION)")
        command.add_argument("--profile", metavar="NAME",
                             help="an s3:// prefix's credentials: a profile of ~/.aws (default: $AWS_PROFILE, "
                                  "else the AWS chain)")
    for command in (pub, pull, st):  # the library's errors name its settings; here they are these flags
        command.set_defaults(flags={a.dest: a.option_strings[-1] for a in command._actions
                                    if a.option_strings and a.dest != "help"})
    return p


def _prefix(text: str) -> str:
    """A `--prefix`: a URI as given, or a local folder's path as its file:// URI (as a source's path
    in a loader config is; `unsupported URI scheme` said to write one)."""
    return folder_uri(text)


def _s3_options(args: argparse.Namespace) -> None:
    """`--endpoint-url`, `--region`, `--profile` as the environment the S3 store reads them from
    (the prefix is opened by the Publisher or Subscriber); ConfigError for a prefix that is not s3://."""
    given = {name: value for name, value in (("--endpoint-url", getattr(args, "endpoint_url", None)),
                                             ("--region", getattr(args, "region", None)),
                                             ("--profile", getattr(args, "profile", None))) if value is not None}
    if given and not args.prefix.startswith("s3://"):
        raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for s3:// prefixes; "
                          f"--prefix {args.prefix} takes none")
    for name, var in (("--endpoint-url", "AWS_ENDPOINT_URL_S3"), ("--region", "AWS_REGION"),
                      ("--profile", "AWS_PROFILE")):
        if name in given:
            os.environ[var] = given[name]


def _guard(fn: Any) -> Any:
    """Run a command: a user's mistake (a bad setting or input file) exits 2, a refused or failed
    operation exits 1, each with one line (and the error's notes) on stderr."""
    def run(args: argparse.Namespace) -> int:
        try:
            _s3_options(args)
            return anyio.run(fn, args)
        except ZephonError as exc:
            flags = getattr(args, "flags", {})  # `keyframe_every=0 must be ...` as `--keyframe-every 0 must be ...`
            said = re.sub(r"\b([a-z_]+)=", lambda m: f"{flags[m[1]]} " if m[1] in flags else m[0], str(exc))
            print(f"zephon refit {args.refit_command}: error: {said}", file=sys.stderr)
            for note in getattr(exc, "__notes__", []):
                print(f"  {note}", file=sys.stderr)
            return 2 if isinstance(exc, ConfigError) else 1
        except KeyboardInterrupt:  # as `zephon stream` says where it stopped: exit 130 alone said nothing
            what = {"pull": "weights pulled in place may be part-way to the version: their record says so, and "
                            "the next pull finishes them (a new --weights file is not made)",
                    "publish": "a version is visible once whole or not at all: `zephon refit status` lists them"
                    }.get(args.refit_command, "nothing was changed")
            print(f"zephon refit {args.refit_command}: interrupted; {what}", file=sys.stderr)
            raise

    return run


PROGRESS_S = 5.0  # a publish or pull that runs longer says how far it is, every this many seconds


@contextlib.asynccontextmanager
async def _progress(command: str, store: Callable[[], Any], written: bool) -> AsyncIterator[None]:
    """A line on stderr every PROGRESS_S seconds while the block runs (none for a short one): the
    bytes the store has read (and `written`) so far, its requests tried again, and the time. A
    multi-GB model is minutes of work. (A publish reads the version it builds on first: counting
    writes alone, it said "0.0 MB written" for the seconds it read, as a stuck endpoint does.)"""
    start = time.monotonic()

    async def report() -> None:
        while True:
            await anyio.sleep(PROGRESS_S)
            st = store().statistics()
            moved = f"{st.bytes_read / 1e6:,.1f} MB read" + (f", {st.bytes_written / 1e6:,.1f} MB written"
                                                             if written else "")
            again = f" ({st.retries} requests tried again)" if st.retries else ""
            print(f"zephon refit {command}: {moved}{again} in {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)

    with unwrap_groups():  # the block's own error, not a group of one
        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()


def _weights(path: str, *, writable: bool = False) -> Mapped:
    """The weights file, or a sharded checkpoint's index (`*.index.json`: all its files as one
    state), or ConfigError (exit 2): a missing, unreadable or malformed file is the user's to fix."""
    from zephon_stream.refit import safetensors  # torch

    try:
        if _is_index(path):
            return safetensors.load_index(path, writable=writable)
        return safetensors.load(path, writable=writable)
    except ZephonError as exc:
        raise ConfigError(f"--weights {path}: {exc}") from exc


def _is_index(path: str) -> bool:
    return path.endswith(".json")


@_guard
async def _publish(args: argparse.Namespace) -> int:
    from zephon_stream.refit.publisher import Publisher  # torch

    state = _weights(args.weights)
    if args.prefix.startswith("memory://"):
        print(f"zephon refit publish: note: {args.prefix} is in this process's memory: the version is gone when "
              "the command exits (file:// or s3:// keep it)", file=sys.stderr)
    async with Publisher(args.prefix, keyframe_every=args.keyframe_every, keep_versions=args.keep_versions,
                         chunk_bytes=args.chunk_bytes, overwrite=args.overwrite, workers=args.workers) as pub:
        async with _progress("publish", lambda: pub.store, written=True):
            info = await pub.publish(state)
    kind = "keyframe" if info.keyframe else "delta"
    print(f"version {info.version} digest {info.model_digest:016x} {kind} delta_bytes {info.delta_bytes} "
          f"key_bytes {info.key_bytes} changes {info.changes}")
    return 0


@_guard
async def _pull(args: argparse.Namespace) -> int:
    from zephon_stream.refit.subscriber import Subscriber  # torch

    # a new rollout worker: the file (or a sharded checkpoint's files and index) is made from the version's table
    new = not os.path.lexists(args.weights)
    record = args.record or f"{args.weights}.refit"
    made = await _new_checkpoint(args) if new else None
    if new and made is None:
        raise RefitError(f"no version is published under {args.prefix}: nothing was pulled, {args.weights} was "
                         "not created")
    loaded = made.load if made else args.weights
    fresh_record = made is not None and not os.path.lexists(record)  # made with the new file, goes with it
    finished = False
    try:
        state = _weights(loaded, writable=True)
        try:
            async with Subscriber(args.prefix, record=record, weights=state.files or loaded,
                                  workers=args.workers) as sub:
                async with _progress("pull", lambda: sub.store, written=False):
                    version = await sub.pull(state, sync=state.flush)
                if made:  # complete: it takes its name(s), and the record is bound to the file(s) under them
                    del state
                    made.finish()
                    finished = True
                    await sub._rebind(_weights(args.weights).files if made.files else args.weights)
        except ConfigError as exc:  # the file against the versions (its tensors, shapes, dtypes): name both
            err = ConfigError(f"--weights {args.weights} against the versions under {args.prefix}: {exc}")
            if not made and ("expected" in str(exc) or "does not match the tensor table" in str(exc)):
                err.add_note(f"if the published model's layout changed (names, shapes, dtypes), delete {args.weights} "
                             f"and its record {record} to pull the new layout whole")
            raise err from exc
    finally:
        if made:
            made.clean()
            if fresh_record and not finished:  # a record of a file that was not made: it went with the file
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(record)
    if version == 0:
        raise RefitError(f"no version is published under {args.prefix}: nothing was pulled, {args.weights} is "
                         "unchanged")
    created = f" (created {args.weights}{made.shards()})" if made else ""
    print(f"version {version} digest {sub.record.model_digest:016x}{created}")
    return 0


class _NewCheckpoint:
    """Zero-filled files for a new worker, under `.partial` names until a pull has filled them:
    one safetensors file, or a sharded checkpoint's files and its index (written last, so an
    index at its name always names whole files of one version)."""

    def __init__(self, weights: str, files: dict[str, list[str]] | None = None, total: int = 0) -> None:
        self.weights, self.files = weights, files
        self.root = os.path.dirname(os.path.abspath(weights))
        # what the pull loads: the .partial file, or an index (a .json name) of the .partial files
        self.load = f"{weights}.partial" if files is None else f"{weights.removesuffix('.json')}.partial.json"
        self.partials = [self.load] + [os.path.join(self.root, f"{f}.partial") for f in files or ()]
        self.weight_map = {n: name for name, held in (files or {}).items() for n in held}
        self.total = total

    def index(self, suffix: str = "") -> str:
        return json.dumps({"metadata": {"total_size": self.total},
                           "weight_map": {n: f"{name}{suffix}" for n, name in self.weight_map.items()}}, indent=2)

    def shards(self) -> str:
        if not self.files:
            return ""
        return f" and {next(iter(self.files))}" if len(self.files) == 1 else f" and its {len(self.files)} files"

    def finish(self) -> None:
        if self.files is None:
            os.replace(self.load, self.weights)
            return
        for name in self.files:
            os.replace(os.path.join(self.root, f"{name}.partial"), os.path.join(self.root, name))
        with open(f"{self.weights}.tmp", "w") as f:
            f.write(self.index())
        os.replace(f"{self.weights}.tmp", self.weights)

    def clean(self) -> None:
        for path in [*self.partials, f"{self.weights}.tmp"]:
            if os.path.lexists(path):
                os.unlink(path)


async def _new_checkpoint(args: argparse.Namespace) -> _NewCheckpoint | None:
    """Zero-filled files that hold the newest version's tensors (None: no version is published):
    a safetensors file beside `--weights`, or for an index (`*.index.json`) a sharded checkpoint
    of `--max-shard-size` files, named and indexed as Hugging Face's `save_pretrained` does."""
    import torch

    from zephon_stream.refit import safetensors

    if not os.path.isdir(os.path.dirname(os.path.abspath(args.weights))):
        raise ConfigError(f"--weights {args.weights}: directory {os.path.dirname(args.weights)!r} does not exist")
    store, prefix = open_store(args.prefix)
    async with store:
        latest = await find_latest(store, prefix)
        got = await read_manifest(store, prefix, latest) if latest else None
    if got is None:
        return None
    tensors = {spec.name: (getattr(torch, spec.dtype), spec.shape) for spec in got[1].specs}
    if not tensors:
        raise RefitError(f"version {latest} under {args.prefix} holds no tensors: nothing to lay out at {args.weights}")
    if not _is_index(args.weights):
        made = _NewCheckpoint(args.weights)
    else:
        stem = os.path.basename(args.weights).removesuffix(".json").removesuffix(".index").removesuffix(".safetensors")
        total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in tensors.values())
        files = safetensors.shard_files(tensors, args.max_shard_size, stem or "model")
        made = _NewCheckpoint(args.weights, files, total)
        for name in files:  # a checkpoint of another layout (one file, no index) or a leftover: never replaced
            if os.path.lexists(path := os.path.join(made.root, name)):
                hint = (f"; to update it in place, pull into it: --weights {path}" if len(files) == 1 else
                        ": move it away, or pull into another directory")
                raise ConfigError(f"--weights {args.weights}: no such index, but {path} is there, which the new "
                                  f"checkpoint's files would replace{hint}")
    try:
        if made.files is None:
            safetensors.allocate(made.load, tensors)
            return made
        for name, held in made.files.items():
            safetensors.allocate(os.path.join(made.root, f"{name}.partial"), {n: tensors[n] for n in held})
        with open(made.load, "w") as f:
            f.write(made.index(".partial"))
    except BaseException:
        made.clean()
        raise
    return made


@_guard
async def _status(args: argparse.Namespace) -> int:
    store, prefix = open_store(args.prefix)
    async with store:
        latest = await find_latest(store, prefix)
        print(f"latest {latest}")
        print(f"{'version':>8} {'base':>6} {'keyframe':>8} {'delta_bytes':>12} {'key_bytes':>12} "
              f"{'changes':>10} {'ratio':>8} digest")
        versions = await list_versions(store, prefix)
        if not versions:  # on stderr: stdout keeps its two lines for scripts
            missing = " (its folder does not exist)" if missing_locally(args.prefix) else ""
            print(f"no version is published under {args.prefix}{missing}",
                  file=sys.stderr)
        for v in versions:
            try:
                got = await read_manifest(store, prefix, v)
            except (DataError, RefitError) as exc:  # one bad version: say so, and show the others
                print(f"{v:>8} unusable: {exc}")
                continue
            if got is None:
                continue
            m = got[0]
            ratio = f"{m.model_bytes / m.delta_bytes:.1f}x" if m.delta_bytes else "-"
            print(f"{v:>8} {m.base_version or '-':>6} {'yes' if m.keyframe else 'no':>8} {m.delta_bytes:>12} "
                  f"{m.key_bytes:>12} {m.changes:>10} {ratio:>8} {m.model_digest:016x}")
    return 0
