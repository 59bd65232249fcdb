"""The fault proxy itself, in front of a tiny stdlib HTTP server: relay, each fault, rates, WAN."""

from __future__ import annotations

import http.client
import http.server
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from zephon_stream.testing.proxy import FAULT_KINDS, FaultProxy, Faults, Link

BODY = bytes(range(256)) * 1024  # 256 KiB

pytestmark = pytest.mark.timeout(30)


class _Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, str | None, int]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _record(self, n: int = 0) -> None:
        self.seen.append((self.command, self.path, self.headers.get("Host"), n))

    def do_GET(self) -> None:
        self._record()
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def do_HEAD(self) -> None:
        self._record()
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()

    def do_PUT(self) -> None:
        n = int(self.headers["Content-Length"])
        data = self.rfile.read(n)
        self._record(len(data))
        reply = str(len(data)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A connection the proxy cut on purpose is no error here (socketserver printed its traceback)."""
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Upstream)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _conn(proxy: FaultProxy) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), timeout=10)


def _get(proxy: FaultProxy, path: str = "/obj", method: str = "GET") -> tuple[int, bytes]:
    conn = _conn(proxy)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_relays_unchanged_and_counts_bytes(upstream: str) -> None:
    _Upstream.seen.clear()
    with FaultProxy(upstream) as proxy:
        conn = _conn(proxy)
        try:
            for _ in range(3):  # keep-alive: three requests on one client connection
                conn.request("GET", "/obj")
                resp = conn.getresponse()
                assert (resp.status, resp.read()) == (200, BODY)
            conn.request("HEAD", "/obj")
            head = conn.getresponse()
            assert head.read() == b"" and head.getheader("Content-Length") == str(len(BODY))
            conn.request("PUT", "/obj", body=b"x" * 1000)
            assert conn.getresponse().read() == b"1000"
        finally:
            conn.close()
        stats = proxy.statistics()
    host = proxy.url.removeprefix("http://")
    assert [s[2] for s in _Upstream.seen] == [host] * 5  # Host forwarded as the client sent it
    assert stats.requests == 5 and stats.faults == {}
    assert stats.body_bytes_down == 3 * len(BODY) + len(b"1000") == stats.body_bytes("GET") + 4
    assert stats.bytes_down > stats.body_bytes_down and stats.bytes_up > 1000


def test_chunked_response_and_expect_continue(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        assert _get(proxy, "/chunked") == (200, b"hello chunked world")
        conn = _conn(proxy)
        try:
            conn.putrequest("PUT", "/obj")
            conn.putheader("Content-Length", "5")
            conn.putheader("Expect", "100-continue")
            conn.endheaders()
            conn.send(b"abcde")
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, b"5")
        finally:
            conn.close()
        assert proxy.statistics().body_bytes("GET") == len(b"hello chunked world")


@pytest.mark.parametrize("kind", ["slowdown", "internal_error"])
def test_error_faults_answer_with_s3_xml(upstream: str, kind: str) -> None:
    _Upstream.seen.clear()
    with FaultProxy(upstream) as proxy:
        proxy.inject(kind)
        status, body = _get(proxy)
    code = {"slowdown": (503, b"<Code>SlowDown</Code>"),
            "internal_error": (500, b"<Code>InternalError</Code>")}
    assert status == code[kind][0] and code[kind][1] in body
    assert _Upstream.seen == []  # never forwarded
    assert proxy.statistics().faults == {kind: 1}


@pytest.mark.parametrize("kind", ["reset_before_response", "lost_response"])
def test_reset_faults(upstream: str, kind: str) -> None:
    _Upstream.seen.clear()
    with FaultProxy(upstream) as proxy:
        proxy.inject(kind, method="PUT")
        conn = _conn(proxy)
        try:
            conn.request("PUT", "/obj", body=b"y" * 100)
            with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
                conn.getresponse().read()
        finally:
            conn.close()
    # a lost response was acted on upstream; a reset before the response was not
    assert [s[0] for s in _Upstream.seen] == (["PUT"] if kind == "lost_response" else [])


@pytest.mark.parametrize("kind", ["reset_body", "truncate_body"])
def test_body_faults_cut_inside_the_body(upstream: str, kind: str) -> None:
    with FaultProxy(upstream, seed=3) as proxy:
        proxy.inject(kind)
        conn = _conn(proxy)
        try:
            conn.request("GET", "/obj")
            resp = conn.getresponse()
            assert resp.getheader("Content-Length") == str(len(BODY))
            with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                resp.read()
        finally:
            conn.close()
        rec = proxy.statistics().records[0]
    assert rec.fault == kind and 0 < rec.body_bytes < len(BODY)


def test_body_fault_skipped_when_there_is_no_body(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        proxy.inject("truncate_body", method="HEAD")
        assert _get(proxy, method="HEAD") == (200, b"")
        assert proxy.statistics().faults == {}


def test_latency_fault_and_link_latency(upstream: str) -> None:
    with FaultProxy(upstream, link=Link(latency_s=0.05)) as proxy:
        proxy.inject("latency")
        proxy.set_faults(Faults(latency_s=0.2))
        t0 = time.monotonic()
        assert _get(proxy)[0] == 200
        assert time.monotonic() - t0 >= 0.25


def test_seeded_rates_are_reproducible(upstream: str) -> None:
    def run(seed: int) -> list[str | None]:
        faults = Faults(slowdown=0.2, internal_error=0.1, latency=0.1, latency_s=0.0)
        with FaultProxy(upstream, faults=faults, seed=seed) as proxy:
            for _ in range(120):
                _get(proxy, method="HEAD")
            return [r.fault for r in proxy.statistics().records]

    first = run(11)
    assert first == run(11) and first != run(12)
    n = len(first)
    assert 0.1 * n < first.count("slowdown") < 0.32 * n  # p=0.2, about 5 sigma either way
    assert 0.02 * n < first.count("internal_error") < 0.2 * n


def test_fault_methods_filter_and_validation(upstream: str) -> None:
    with FaultProxy(upstream, faults=Faults(slowdown=1.0, methods=frozenset({"PUT"}))) as proxy:
        assert _get(proxy)[0] == 200
    with pytest.raises(ValueError, match="sum to <= 1"):
        Faults(slowdown=0.7, reset_body=0.7)
    with pytest.raises(ValueError, match="unknown fault kind"):
        FaultProxy(upstream).inject("gremlins")
    assert sum(getattr(Faults.every_kind(0.35), k) for k in FAULT_KINDS) == pytest.approx(0.35)


def test_bandwidth_is_capped_both_ways(upstream: str) -> None:
    rate = 2 * 1024 * 1024
    with FaultProxy(upstream, link=Link(bandwidth=rate, burst=32 * 1024)) as proxy:
        t0 = time.monotonic()
        for _ in range(4):
            assert _get(proxy) == (200, BODY)  # 1 MiB down in all
        down = time.monotonic() - t0
        conn = _conn(proxy)
        try:
            t0 = time.monotonic()
            conn.request("PUT", "/obj", body=b"z" * (512 * 1024))
            assert conn.getresponse().read() == str(512 * 1024).encode()
            up = time.monotonic() - t0
        finally:
            conn.close()
    assert down >= (4 * len(BODY) - 32 * 1024) / rate * 0.9
    assert up >= (512 * 1024 - 32 * 1024) / rate * 0.9
