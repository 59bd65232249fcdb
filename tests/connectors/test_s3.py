"""S3Store semantics against real servers: SeaweedFS (signed requests) and moto."""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

import anyio
import pytest

from zephon_stream import AlreadyExists, ConfigError, ConnectorError, ObjectNotFound
from zephon_stream.connectors import MemoryStore, Store, open_store
from zephon_stream.connectors.base import ServerSideCopy
from zephon_stream.connectors.s3 import MiB, S3ClientPool, S3Settings, S3Store

pytestmark = [pytest.mark.anyio, pytest.mark.s3, pytest.mark.timeout(60)]


@functools.cache
def _corpus() -> bytes:
    """24 MiB of real, compressible text: this Python's stdlib sources, in a fixed order."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_path("stdlib")).rglob("*.py")):
        out.append(path.read_bytes())
        size += len(out[-1])
        if size >= 24 * MiB:
            break
    return b"".join(out)


def text_bytes(n: int, seed: int = 0) -> bytes:
    """`n` bytes of the text corpus, from an offset chosen by `seed` (wrapping around)."""
    corpus = _corpus()
    assert n <= len(corpus), f"the corpus has {len(corpus)} bytes, {n} asked"
    start = seed * 1_000_003 % len(corpus)
    return (corpus[start:] + corpus[:n])[:n]


def md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


async def test_put_list_head_read_delete(any_s3) -> None:
    objects = {"a/1": b"one", "a/2/x": text_bytes(70_000), "a/0": b"", "b/1": b"bee", "a/\u00e9": b"utf8 key"}
    async with S3Store(any_s3.bucket, **any_s3.options, list_page_size=2) as store:
        assert isinstance(store, Store)
        for key, data in objects.items():
            await store.put(key, data)
        listed = await store.list("a/")
        assert [o.key for o in listed] == sorted(k for k in objects if k.startswith("a/"))
        expected = [(len(objects[o.key]), md5(objects[o.key])) for o in listed]
        assert [(o.size, o.etag) for o in listed] == expected
        assert [o.key for o in await store.list()] == sorted(objects)
        assert await store.list("zzz/") == []
        info = await store.head("a/2/x")
        assert (info.key, info.size, info.etag) == ("a/2/x", 70_000, md5(objects["a/2/x"]))

        data = objects["a/2/x"]
        assert await store.read("a/2/x") == data
        assert await store.read("a/2/x", 1000) == data[1000:]
        assert await store.read("a/2/x", 1000, 1010) == data[1000:1010]
        assert await store.read("a/2/x", 69_990, 80_000) == data[69_990:]
        assert await store.read("a/2/x", 70_000) == b""
        assert await store.read("a/2/x", 5, 5) == b""
        assert await store.read("a/0") == b""

        await store.delete("a/1")
        await store.delete("a/1")  # deleting what is gone is fine
        with pytest.raises(ObjectNotFound, match="a/1"):
            await store.read("a/1")
        stats = store.statistics()
    assert stats.bytes_written == sum(map(len, objects.values()))
    assert stats.requests > 10 and stats.retries == 0 and stats.in_flight == 0


async def test_open_store_uri_gives_an_s3_store_and_prefix(any_s3) -> None:
    store, prefix = open_store(any_s3.uri + "runs/7", **any_s3.options)
    async with store:
        assert isinstance(store, S3Store) and prefix == "runs/7/"
        await store.put(prefix + "k", b"v")
        assert [o.key for o in await store.list(prefix)] == ["runs/7/k"]


async def test_multipart_put_and_conditional_multipart(any_s3) -> None:
    data = text_bytes(7 * MiB + 123)
    opts = dict(multipart_threshold=6 * MiB, multipart_part_size=5 * MiB)
    async with S3Store(any_s3.bucket, **any_s3.options, **opts) as store:
        await store.put("big", data)
        info = await store.head("big")
        assert info.size == len(data) and info.etag.endswith("-2")  # two parts
        assert await store.read("big") == data
        assert await store.read("big", 5 * MiB - 10, 5 * MiB + 10) == data[5 * MiB - 10 : 5 * MiB + 10]
        await store.put("new-big", data, if_none_match=True)
        with pytest.raises(AlreadyExists, match="new-big"):
            await store.put("new-big", data[::-1], if_none_match=True)
        assert await store.read("new-big", 0, 100) == data[:100]
    uploads = any_s3.client().list_multipart_uploads(Bucket=any_s3.bucket)
    assert uploads.get("Uploads", []) == []  # the losing upload was aborted, not left behind


async def test_copy_is_server_side(any_s3) -> None:
    data = text_bytes(300_000, seed=3)
    async with S3Store(any_s3.bucket, **any_s3.options) as store:
        await store.put("src", data)
        before = store.statistics().bytes_read
        await store.copy("src", "dst/copy")
        assert store.statistics().bytes_read == before  # no bytes through this process
        assert await store.read("dst/copy") == data
        assert (await store.head("dst/copy")).etag == md5(data)
        with pytest.raises(ObjectNotFound, match="missing"):
            await store.copy("missing", "dst/other")


async def test_exactly_one_conditional_creator_wins(any_s3) -> None:
    async with S3Store(any_s3.bucket, **any_s3.options) as store:
        # SeaweedFS queues conditional puts to one key about a second apart: one round there
        for round_ in range(1 if any_s3.kind == "seaweed" else 4):
            key = f"manifest-{round_}"
            outcome: dict[int, str] = {}

            async def create(i: int, key: str = key, outcome: dict[int, str] = outcome) -> None:
                try:
                    await store.put(key, f"writer {i}".encode() * 100, if_none_match=True)
                    outcome[i] = "won"
                except AlreadyExists:
                    outcome[i] = "lost"

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for i in range(8):
                        tg.start_soon(create, i)
            winners = [i for i, o in outcome.items() if o == "won"]
            assert len(outcome) == 8 and len(winners) == 1, outcome
            assert await store.read(key) == f"writer {winners[0]}".encode() * 100


async def test_open_read_streams_parts_in_order_with_a_bounded_window(s3) -> None:
    data = text_bytes(3 * MiB + 5, seed=1)
    async with S3Store(s3.bucket, **s3.options, part_size=256 * 1024, read_ahead=3) as store:
        await store.put("obj", data)
        async with store.open_read("obj") as parts:
            got = [part async for part in parts]
        assert b"".join(got) == data and [len(p) for p in got[:-1]] == [256 * 1024] * (len(got) - 1)
        assert store.statistics().peak_in_flight <= 3
        async with store.open_read("obj", 100_000, 900_000, part_size=100_000) as parts:
            assert b"".join([p async for p in parts]) == data[100_000:900_000]
        async with store.open_read("obj", 3 * MiB, None) as parts:
            assert b"".join([p async for p in parts]) == data[3 * MiB :]
        requests = store.statistics().requests
        async with store.open_read("obj", part_size=64 * 1024, read_ahead=2) as parts:
            async for _ in parts:
                break  # leaving early cancels the window: no request for the rest
        assert store.statistics().requests - requests <= 1 + 3  # HEAD + at most window + 1 GETs
        with pytest.raises(ObjectNotFound, match="nope"):
            async with store.open_read("nope") as parts:
                pass


async def test_open_read_pins_one_version_of_the_object(any_s3) -> None:
    data = text_bytes(600_000, seed=5)
    async with S3Store(any_s3.bucket, **any_s3.options, part_size=100_000, read_ahead=1) as store:
        await store.put("obj", data)
        info = (await store.list("obj"))[0]
        requests = store.statistics().requests
        async with store.open_read("obj", 0, info.size + 300_000, etag=info.etag) as parts:
            assert b"".join([p async for p in parts]) == data  # parts past the end are dropped
        assert store.statistics().requests - requests == 9  # no HEAD: the size came from list()
        with pytest.raises(ConnectorError, match="changed while it was read"):
            async with store.open_read("obj", 0, info.size, etag="0123456789abcdef0123456789abcdef") as parts:
                async for _ in parts:
                    pass
        with pytest.raises(ConnectorError, match="changed while it was read"):
            async with store.open_read("obj", 0, info.size) as parts:
                async for _ in parts:
                    await store.put("obj", data[::-1])  # overwritten after the first part


async def test_a_store_belongs_to_one_event_loop(moto_s3) -> None:
    async with S3Store(moto_s3.bucket, **moto_s3.options) as store:
        await store.put("k", b"v")
        with pytest.raises(ConnectorError, match="another event loop"):
            await anyio.to_thread.run_sync(anyio.run, store.read, "k")


async def test_pool_limiter_caps_requests_in_flight_across_stores(s3) -> None:
    data = text_bytes(2 * MiB, seed=2)
    async with S3ClientPool(max_in_flight=2) as pool:
        first = S3Store(s3.bucket, **s3.options, pool=pool, part_size=128 * 1024, read_ahead=8)
        second = S3Store(s3.bucket, **s3.options, pool=pool)
        await first.put("obj", data)

        async def read_all(store: S3Store) -> None:
            async with store.open_read("obj", part_size=128 * 1024, read_ahead=8) as parts:
                assert b"".join([p async for p in parts]) == data

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, first)
            tg.start_soon(read_all, second)
        peak = first.statistics().peak_in_flight + second.statistics().peak_in_flight
        assert first.statistics().peak_in_flight <= 2 and second.statistics().peak_in_flight <= 2
        assert peak >= 2
        assert "clients=1" in repr(pool)  # one client for the endpoint, shared by both stores
        await first.aclose()  # a shared pool is closed by its owner, not by the stores
        assert await second.read("obj", 0, 10) == data[:10]


async def test_store_closes_its_client_once_and_refuses_after(s3) -> None:
    store = S3Store(s3.bucket, **s3.options)
    await store.put("k", b"v")
    await store.aclose()
    with pytest.raises(Exception, match="closed"):
        await store.read("k")


def test_settings_and_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="unknown S3 option"):
        S3Store("b", part_sise=3)
    with pytest.raises(ConfigError, match="addressing_style"):
        S3Store("b", addressing_style="sideways")
    with pytest.raises(ConfigError, match="part_size must be > 0"):
        S3Settings(part_size=0)
    with pytest.raises(ConfigError, match="5 MiB"):
        S3Settings(multipart_part_size=MiB)
    with pytest.raises(ConfigError, match="together"):
        S3Store("b", access_key_id="AKID")
    with pytest.raises(ConfigError, match="bucket"):
        S3Store("b/prefix")


def test_endpoint_and_region_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_REGION", "eu-north-1")
    store = S3Store("b")
    assert store.endpoint == "http://127.0.0.1:2" and "eu-north-1" in repr(store) and "'path'" in repr(store)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    assert S3Store("b").endpoint == "http://127.0.0.1:1"
    assert S3Store("b", endpoint_url="http://127.0.0.1:3", addressing_style="virtual").endpoint.endswith(":3")


async def test_server_side_copy_only_from_a_store_of_the_same_endpoint_and_credentials() -> None:
    store = S3Store("b", endpoint_url="http://127.0.0.1:1", access_key_id="k", secret_access_key="s")
    same = S3Store("c", endpoint_url="http://127.0.0.1:1", access_key_id="k", secret_access_key="s")
    other = S3Store("c", endpoint_url="http://127.0.0.1:1", access_key_id="k2", secret_access_key="s")
    assert isinstance(store, ServerSideCopy) and store.copies_from(same) and not store.copies_from(other)
    for source in (other, MemoryStore()):
        assert not store.copies_from(source)
        with pytest.raises(ConfigError, match="cannot copy from"):
            await store.copy_from(source, "k", "k")  # refused before any request
    assert store.statistics().requests == 0


async def test_open_read_window_of_one_reads_one_part_at_a_time(s3) -> None:
    data = text_bytes(1 * MiB + 7, seed=3)
    async with S3Store(s3.bucket, **s3.options, part_size=128 * 1024, read_ahead=1) as store:
        await store.put("obj", data)
        async with store.open_read("obj") as parts:
            got = [part async for part in parts]
        assert b"".join(got) == data and len(got) == 9
        assert store.statistics().peak_in_flight == 1
