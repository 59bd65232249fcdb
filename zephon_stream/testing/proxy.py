"""A fault-injecting, WAN-emulating HTTP/1.1 reverse proxy, for tests, demos and benchmarks.

    with FaultProxy("http://127.0.0.1:8333", faults=Faults(slowdown=0.1, reset_body=0.1), seed=7) as proxy:
        store = S3Store("bucket", endpoint_url=proxy.url, addressing_style="path", ...)
        ...
        stats = proxy.statistics()        # requests, faults by kind, bytes each way, per-request log

It listens on 127.0.0.1 and forwards every request unchanged, Host header included, so SigV4
signatures made for the proxy's address still verify at the server (point the client at
`proxy.url` with path-style addressing). It runs an asyncio loop in a background thread, so
synchronous tests can start it and async code can use it alike.

Each request draws at most one fault, from a seeded generator, by the rates in `Faults`:

    slowdown               503 SlowDown with an S3 XML error body (not forwarded)
    internal_error         500 InternalError with an S3 XML error body (not forwarded)
    reset_before_response  the request is read, not forwarded, and the connection reset
    lost_response          forwarded (the server acts on it), its response dropped, connection reset
    reset_body             headers and part of the body sent, then the connection reset
    truncate_body          headers (full Content-Length) and part of the body sent, then closed
    latency                the request waits `Faults.latency_s` more before it is forwarded

Body faults apply only to 2xx responses with a body of 2 bytes or more; elsewhere the request
passes untouched and no fault is counted. `inject(kind)` queues faults for the next matching
requests ahead of the random ones, for tests that need one fault at a known place.

`Link` emulates a WAN: a token bucket per direction caps bytes/s, and every request waits
`latency_s` before it is forwarded.
"""

from __future__ import annotations

import array
import asyncio
import collections
import dataclasses
import random
import socket
import struct
import threading
from urllib.parse import urlparse

try:  # Linux/BSD: lets a reset wait until the peer has every byte sent before it
    import fcntl
    import termios
except ImportError:  # pragma: no cover
    fcntl = termios = None

__all__ = ["FAULT_KINDS", "FaultProxy", "Faults", "Link", "ProxyStatistics", "RequestRecord"]

FAULT_KINDS = (
    "slowdown", "internal_error", "reset_before_response", "lost_response", "reset_body", "truncate_body",
    "latency",
)
_BODY_FAULTS = ("reset_body", "truncate_body")
_CHUNK = 64 * 1024
_HEAD_LIMIT = 1 << 20


@dataclasses.dataclass(frozen=True)
class Faults:
    """Probability of each fault per request (their sum must be <= 1), and which requests qualify."""

    slowdown: float = 0.0
    internal_error: float = 0.0
    reset_before_response: float = 0.0
    lost_response: float = 0.0
    reset_body: float = 0.0
    truncate_body: float = 0.0
    latency: float = 0.0
    latency_s: float = 0.05
    methods: frozenset[str] | None = None  # None: any method may get a fault

    def __post_init__(self) -> None:
        rates = [getattr(self, k) for k in FAULT_KINDS]
        if any(r < 0 for r in rates) or sum(rates) > 1 + 1e-9:
            raise ValueError(f"fault rates must be >= 0 and sum to <= 1, got {dict(zip(FAULT_KINDS, rates))}")

    @classmethod
    def every_kind(cls, total: float, **kwargs: object) -> Faults:
        """`total` spread evenly over every fault kind."""
        share = total / len(FAULT_KINDS)
        return cls(**{k: share for k in FAULT_KINDS}, **kwargs)


@dataclasses.dataclass(frozen=True)
class Link:
    """WAN emulation: bytes/s each way (None: unthrottled) and delay added to every request."""

    bandwidth: float | None = None
    latency_s: float = 0.0
    burst: int = _CHUNK


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One request as the proxy saw it: what was asked, what came back, and what was injected."""

    method: str
    path: str
    range: str | None
    status: int | None
    body_bytes: int  # response body bytes delivered to the client
    fault: str | None


@dataclasses.dataclass(frozen=True)
class ProxyStatistics:
    requests: int
    faults: dict[str, int]
    bytes_up: int  # client -> server, forwarded (heads and bodies)
    bytes_down: int  # server (or proxy) -> client (heads and bodies)
    body_bytes_down: int  # response body bytes delivered to clients
    records: tuple[RequestRecord, ...]

    def body_bytes(self, method: str = "GET", path_contains: str = "") -> int:
        return sum(r.body_bytes for r in self.records if r.method == method and path_contains in r.path)


class _Head:
    """A parsed request or response head; `raw` is forwarded byte for byte."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        lines = raw.decode("latin-1").split("\r\n")
        self.start = lines[0].split(" ", 2)
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                self.headers[name.strip().lower()] = value.strip()

    def get(self, name: str) -> str | None:
        return self.headers.get(name)

    @property
    def chunked(self) -> bool:
        return "chunked" in (self.get("transfer-encoding") or "").lower()

    @property
    def length(self) -> int | None:
        value = self.get("content-length")
        return int(value) if value is not None else None


class _Bucket:
    """Token bucket: `take(n)` waits until n bytes fit the rate."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = asyncio.get_running_loop().time()

    async def take(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= n:
                self.tokens -= n
                return
            await asyncio.sleep((n - self.tokens) / self.rate)


class _Abort(Exception):
    """Drop the client connection (already reset or closed)."""


class FaultProxy:
    """Reverse proxy from `url` (127.0.0.1, a free port) to `upstream`, injecting `faults`."""

    def __init__(self, upstream: str, *, faults: Faults | None = None, link: Link | None = None,
                 seed: int = 0, port: int = 0, max_records: int = 100_000) -> None:
        parsed = urlparse(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port)
        self.faults = faults or Faults()
        self.link = link or Link()
        self._rng = random.Random(seed)
        self._port = port
        self._script: collections.deque[tuple[str, str | None, str | None]] = collections.deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._max_records = max_records
        self.reset_statistics()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        host, port = self.upstream
        return f"FaultProxy({self.url if self._thread else 'stopped'} -> http://{host}:{port})"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # -- control (any thread) ------------------------------------------------------------------

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults

    def inject(self, kind: str, *, count: int = 1, method: str | None = None,
               match: str | None = None) -> None:
        """Give fault `kind` to the next `count` requests with `method` whose head contains `match`.

        `match` is a substring of the raw request head (request line and headers as sent), e.g.
        `"Range: bytes=1024-"` or `"uploadId="`. Scripted faults go before random ones.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}: use one of {FAULT_KINDS}")
        with self._lock:
            self._script.extend([(kind, method, match)] * count)

    def pending_injections(self) -> int:
        with self._lock:
            return len(self._script)

    def statistics(self, settle: float = 5.0) -> ProxyStatistics:
        """Counters, once the requests in progress have finished (waiting up to `settle` s).

        A client has its whole response a moment before the proxy has booked it; settling makes
        a snapshot taken right after a call complete.
        """
        with self._idle:
            self._idle.wait_for(lambda: self._active == 0, timeout=settle)
            return ProxyStatistics(self._requests, dict(self._faults), self._bytes_up, self._bytes_down,
                                   self._body_down, tuple(self._records))

    def reset_statistics(self) -> None:
        with self._lock:
            self._requests = self._bytes_up = self._bytes_down = self._body_down = 0
            self._faults: collections.Counter[str] = collections.Counter()
            self._records: collections.deque[RequestRecord] = collections.deque(maxlen=self._max_records)

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name="zephon-fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=30) or self._error is not None:
            raise RuntimeError(f"fault proxy did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        thread.join(timeout=30)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(); the thread must not die silently
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        rate = self.link.bandwidth
        self._up = _Bucket(rate, self.link.burst) if rate else None
        self._down = _Bucket(rate, self.link.burst) if rate else None
        self._tasks: set[asyncio.Task[None]] = set()
        server = await asyncio.start_server(self._handle, "127.0.0.1", self._port, limit=_HEAD_LIMIT)
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while await self._serve_one(reader, writer):
                pass
            writer.close()  # graceful: what was written still reaches the client
        except (_Abort, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.transport.abort()
        except asyncio.CancelledError:  # stop(): this task is the top of its stack, nobody awaits it
            writer.transport.abort()
        finally:
            self._tasks.discard(task)

    def _draw(self, req: _Head) -> tuple[str | None, float]:
        """The fault for one request (scripted first, then random) and where to cut a body."""
        method, text = req.start[0], req.raw.decode("latin-1")
        with self._lock:
            for i, (kind, only, match) in enumerate(self._script):
                if (only is None or only == method) and (match is None or match in text):
                    del self._script[i]
                    return kind, self._rng.random()
            faults = self.faults
            u, cut = self._rng.random(), self._rng.random()
        if faults.methods is not None and method not in faults.methods:
            return None, cut
        for kind in FAULT_KINDS:
            u -= getattr(faults, kind)
            if u < 0:
                return kind, cut
        return None, cut

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Relay one request; False when the client connection must close."""
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        req = _Head(raw)
        method, path = req.start[0], req.start[1] if len(req.start) > 1 else ""
        with self._lock:
            self._active += 1
        fault, cut = self._draw(req)
        rec = {"method": method, "path": path, "range": req.get("range"), "status": None, "body_bytes": 0,
               "fault": fault}
        try:
            return await self._relay(req, reader, writer, fault, cut, rec)
        finally:
            with self._lock:
                self._requests += 1
                if rec["fault"] is not None:
                    self._faults[rec["fault"]] += 1
                self._records.append(RequestRecord(**rec))
                self._active -= 1
                self._idle.notify_all()

    async def _relay(self, req: _Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     fault: str | None, cut: float, rec: dict[str, object]) -> bool:
        expect = (req.get("expect") or "").lower() == "100-continue"
        if self.link.latency_s:
            await asyncio.sleep(self.link.latency_s)
        if fault == "latency":
            await asyncio.sleep(self.faults.latency_s)
        if fault in ("slowdown", "internal_error", "reset_before_response"):
            if not expect:
                await _copy_body(req, reader, None, None)
            if fault == "reset_before_response":
                _reset(writer)
                raise _Abort
            rec["status"] = await self._send_error(writer, req, fault)
            return False
        up_reader, up_writer = await asyncio.open_connection(*self.upstream, limit=_HEAD_LIMIT)
        try:
            return await self._forward(req, reader, writer, up_reader, up_writer, fault, cut, rec, expect)
        finally:
            up_writer.transport.abort()

    async def _forward(self, req: _Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, fault: str | None,
                       cut: float, rec: dict[str, object], expect: bool) -> bool:
        await self._write(up_writer, req.raw, up=True)
        body_sent = not expect
        if not expect:
            await _copy_body(req, reader, up_writer, self)
        while True:
            resp = _Head(await up_reader.readuntil(b"\r\n\r\n"))
            status = int(resp.start[1])
            if status >= 200:
                break
            await self._write(writer, resp.raw, up=False)  # interim (100 Continue): always passed on
            if status == 100 and not body_sent:
                await _copy_body(req, reader, up_writer, self)
                body_sent = True
        rec["status"] = status
        has_body = req.start[0] != "HEAD" and status not in (204, 304)
        length = resp.length if has_body else 0
        if fault == "lost_response":
            await _drain_response(resp, up_reader, has_body)
            _reset(writer)
            raise _Abort
        if fault in _BODY_FAULTS and not (200 <= status < 300 and length is not None and length >= 2):
            rec["fault"] = None
        if rec["fault"] in _BODY_FAULTS:
            assert length is not None
            await self._write(writer, resp.raw, up=False)
            await self._pump(up_reader, writer, max(1, min(length - 1, int(length * cut))), rec)
            await _flushed(writer)  # so the client holds every byte counted as delivered
            if fault == "reset_body":
                _reset(writer)
            else:
                writer.close()
            raise _Abort
        await self._write(writer, resp.raw, up=False)
        if not has_body:
            pass
        elif resp.chunked:
            await self._pump_chunked(up_reader, writer, rec)
        elif length is not None:
            await self._pump(up_reader, writer, length, rec)
        else:
            await self._pump(up_reader, writer, None, rec)
            return False
        closing = "close" in ((resp.get("connection") or "") + (req.get("connection") or "")).lower()
        return body_sent and not closing

    async def _send_error(self, writer: asyncio.StreamWriter, req: _Head, fault: str) -> int:
        code, status, reason, message = {
            "slowdown": ("SlowDown", 503, "Slow Down", "Please reduce your request rate."),
            "internal_error": ("InternalError", 500, "Internal Server Error",
                               "We encountered an internal error. Please try again."),
        }[fault]
        with self._lock:
            request_id = f"zephon-proxy-{self._requests}"
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><Resource>{_xml_escape(req.start[1])}</Resource>"
                f"<RequestId>{request_id}</RequestId></Error>").encode()
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\nx-amz-request-id: {request_id}\r\n"
                "Connection: close\r\n\r\n").encode()
        await self._write(writer, head + (b"" if req.start[0] == "HEAD" else body), up=False)
        return status

    async def _write(self, writer: asyncio.StreamWriter, data: bytes, *, up: bool) -> None:
        """Write through the link's token bucket, counting the bytes."""
        bucket = self._up if up else self._down
        view = memoryview(data)
        step = min(_CHUNK, self.link.burst)
        for i in range(0, len(view), step):
            piece = view[i : i + step]
            if bucket is not None:
                await bucket.take(len(piece))
            writer.write(piece)
            await writer.drain()
            with self._lock:
                if up:
                    self._bytes_up += len(piece)
                else:
                    self._bytes_down += len(piece)

    async def _pump(self, src: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int | None,
                    rec: dict[str, object]) -> None:
        """Relay `n` response body bytes (None: until EOF) to the client."""
        left = n
        while left is None or left > 0:
            data = await src.read(_CHUNK if left is None else min(_CHUNK, left))
            if not data:
                if left is None:
                    return
                raise _Abort  # upstream broke: pass the break on
            await self._write(writer, data, up=False)
            rec["body_bytes"] = int(rec["body_bytes"]) + len(data)
            with self._lock:
                self._body_down += len(data)
            if left is not None:
                left -= len(data)

    async def _pump_chunked(self, src: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            rec: dict[str, object]) -> None:
        async for frame, payload in _chunks(src):
            await self._write(writer, frame, up=False)
            rec["body_bytes"] = int(rec["body_bytes"]) + payload
            with self._lock:
                self._body_down += payload


async def _chunks(src: asyncio.StreamReader):
    """Chunked-encoding frames as (raw bytes, payload size), through the final trailer."""
    while True:
        line = await src.readuntil(b"\r\n")
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            trailer = b""
            while True:
                t = await src.readuntil(b"\r\n")
                trailer += t
                if t == b"\r\n":
                    break
            yield line + trailer, 0
            return
        yield line + await src.readexactly(size + 2), size


async def _copy_body(req: _Head, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None,
                     proxy: FaultProxy | None) -> None:
    """Copy (or, with no `dst`, discard) a request body, by its framing."""
    async def out(data: bytes) -> None:
        if dst is not None and proxy is not None:
            await proxy._write(dst, data, up=True)

    if req.chunked:
        async for frame, _ in _chunks(src):
            await out(frame)
        return
    left = req.length or 0
    while left > 0:
        data = await src.read(min(_CHUNK, left))
        if not data:
            raise _Abort
        await out(data)
        left -= len(data)


async def _drain_response(resp: _Head, src: asyncio.StreamReader, has_body: bool) -> None:
    if not has_body:
        return
    if resp.chunked:
        async for _ in _chunks(src):
            pass
    elif resp.length is not None:
        await src.readexactly(resp.length)
    else:
        while await src.read(_CHUNK):
            pass


async def _flushed(writer: asyncio.StreamWriter, timeout: float = 2.0) -> None:
    """Wait (bounded) until the peer has acknowledged every byte written: a RST would drop the rest."""
    sock = writer.get_extra_info("socket")
    if sock is None or termios is None or not hasattr(termios, "TIOCOUTQ"):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    buf = array.array("i", [0])
    while loop.time() < deadline:
        try:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
        except OSError:
            return
        if buf[0] == 0:
            return
        await asyncio.sleep(0.001)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed server or middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def _xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
