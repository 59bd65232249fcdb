"""A stalled S3 endpoint fails fast, and the error names the request and the timeout that ran out.

The endpoint is a TCP server on 127.0.0.1 that accepts connections and never answers (or
answers the headers and never sends the body): what a hung server or a dead proxy looks like.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import msgspec
import pytest
from botocore.exceptions import ConnectTimeoutError

from zephon_stream import ConnectorError
from zephon_stream.connectors.s3 import S3Settings, S3Store, translate_error
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import open_stores

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

CREDENTIALS = {"access_key_id": "AKIDTEST", "secret_access_key": "secret", "region": "us-east-1"}
HEADERS_ONLY = (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\nETag: "abc"\r\n'
                b"Content-Type: application/octet-stream\r\n\r\n")


class _Stalled:
    """Counts the connections it accepted; holds each open until the server stops."""

    def __init__(self, reply: bytes) -> None:
        self.reply, self.connections, self.url = reply, 0, ""

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        self.connections += 1
        async with stream:
            if self.reply:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += await stream.receive()
                await stream.send(self.reply)
            await anyio.Event().wait()  # never answer (more)


@asynccontextmanager
async def stalled_endpoint(reply: bytes = b"") -> AsyncIterator[_Stalled]:
    server = _Stalled(reply)
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, anyio.create_task_group() as tg:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        server.url = f"http://127.0.0.1:{port}"
        tg.start_soon(listener.serve, server.handle)
        yield server
        tg.cancel_scope.cancel()


async def test_a_stalled_get_fails_after_timeout_attempts_naming_the_request() -> None:
    async with stalled_endpoint() as server, S3Store("bkt", endpoint_url=server.url, **CREDENTIALS, read_timeout=0.5,
                                                     max_attempts=5) as store:
        t0 = time.monotonic()
        with anyio.fail_after(20), pytest.raises(ConnectorError) as err:
            await store.read("shards/0001.jsonl")
        elapsed = time.monotonic() - t0
    text = str(err.value)
    assert f"GetObject s3://bkt/shards/0001.jsonl at {server.url}" in text, text
    assert "read_timeout = 0.5 s" in text and "timeout_attempts = 2" in text, text
    assert server.connections == 2, "a request that timed out twice is not retried again"
    assert 1.0 <= elapsed < 10, elapsed


async def test_timeout_attempts_bounds_the_retries_of_a_listing() -> None:
    async with stalled_endpoint() as server, S3Store("bkt", endpoint_url=server.url, **CREDENTIALS, read_timeout=0.3,
                                                     timeout_attempts=1) as store:
        with anyio.fail_after(20), pytest.raises(ConnectorError, match=r"ListObjectsV2 s3://bkt/p/ at .*"
                                                                        r"stalled.*read_timeout = 0.3 s"):
            await store.list("p/")
    assert server.connections == 1


async def test_a_body_that_stalls_after_the_headers() -> None:
    async with stalled_endpoint(HEADERS_ONLY) as server, S3Store("bkt", endpoint_url=server.url, **CREDENTIALS,
                                                                 read_timeout=0.3) as store:
        with anyio.fail_after(20), pytest.raises(ConnectorError) as err:
            await store.read("obj")
    text = str(err.value)
    assert "GetObject s3://bkt/obj" in text and "read_timeout = 0.3 s" in text, text
    assert server.connections == 2


def test_a_connect_timeout_names_its_setting() -> None:
    exc = ConnectTimeoutError(endpoint_url="http://10.0.0.1:9000/bkt/k")
    err = translate_error(exc, bucket="bkt", key="k", operation="GetObject", endpoint="http://10.0.0.1:9000",
                          settings=S3Settings(connect_timeout=0.5))
    assert type(err) is ConnectorError
    assert "GetObject s3://bkt/k at http://10.0.0.1:9000 could not connect within connect_timeout = 0.5 s" in str(err)


def test_defaults_fail_a_stalled_endpoint_within_a_minute_and_a_bit() -> None:
    s = S3Settings()
    assert s.timeout_attempts * max(s.connect_timeout, s.read_timeout) <= 60
    src = SourceConfig(name="a", uri="s3://b/")
    assert (src.connect_timeout, src.read_timeout) == (s.connect_timeout, s.read_timeout)


async def test_source_timeouts_reach_the_store_and_not_the_order() -> None:
    fast = SourceConfig(name="a", uri="s3://b1/", endpoint_url="http://127.0.0.1:9", connect_timeout=1.5,
                        read_timeout=2.5, max_attempts=3, retry_deadline=30.0)
    default = SourceConfig(name="b", uri="s3://b2/", endpoint_url="http://127.0.0.1:9")
    cfg = Config(seed=1, lanes=1, seq_len=8, global_batch_size=1, tokenizer="tok.json", sources=[fast, default])
    async with AsyncExitStack() as stack:
        stores = await open_stores(cfg, stack, None)
    assert (stores[0].settings.connect_timeout, stores[0].settings.read_timeout) == (1.5, 2.5)
    assert (stores[0].settings.max_attempts, stores[0].settings.retry_deadline) == (3, 30.0)
    assert stores[1].settings.read_timeout == S3Settings().read_timeout
    assert (stores[1].settings.max_attempts, stores[1].settings.retry_deadline) == (5, 120.0)
    assert stores[0]._key != stores[1]._key, "clients are keyed by their timeouts"
    slower = cfg.replace(sources=[msgspec.structs.replace(fast, read_timeout=99.0), default])
    assert slower.order_digest("t") == cfg.order_digest("t"), "timeouts are execution settings"
    patient = cfg.replace(sources=[msgspec.structs.replace(fast, max_attempts=9, retry_deadline=600.0), default])
    assert patient.order_digest("t") == cfg.order_digest("t"), "and so are the retries"
    from zephon_stream import ConfigError

    for change, needle in (({"max_attempts": 0}, r"max_attempts = 0: must be in \[1, 100\]"),
                           ({"retry_deadline": 0.0}, r"retry_deadline = 0.0: must be in \(0, 3600\] seconds")):
        with pytest.raises(ConfigError, match=needle):
            msgspec.structs.replace(fast, **change)


def test_an_invalid_endpoint_url_is_a_config_error() -> None:
    from zephon_stream import ConfigError

    with pytest.raises(ConfigError, match="endpoint_url 'not a url' is not a URL"):
        S3Store("bkt", endpoint_url="not a url", **CREDENTIALS)
