"""S3Store through the fault proxy (real SigV4 through it, to SeaweedFS): exact bytes, counted retries."""

from __future__ import annotations

import logging
import re
import time

import anyio
import pytest

from tests.connectors.test_s3 import text_bytes
from zephon_stream import AlreadyExists, ConnectorError, Throttled
from zephon_stream.connectors.s3 import MiB, S3Store
from zephon_stream.testing.proxy import FAULT_KINDS, Faults, Link

pytestmark = [pytest.mark.anyio, pytest.mark.s3, pytest.mark.timeout(60)]

RETRIED = tuple(k for k in FAULT_KINDS if k != "latency")  # each costs the client one retry


async def _seed(s3, objects: dict[str, bytes]) -> None:
    async with S3Store(s3.bucket, **s3.options) as direct:
        for key, data in objects.items():
            await direct.put(key, data)


@pytest.mark.parametrize("rate", [0.1, 0.3])
async def test_reads_and_writes_are_exact_under_every_fault_kind(s3, s3_proxy, rate: float) -> None:
    objects = {f"shard-{i:02d}": text_bytes(200_000 + 7919 * i, seed=i) for i in range(6)}
    await _seed(s3, objects)
    proxy, options = s3_proxy(faults=Faults.every_kind(rate, latency_s=0.01), seed=int(rate * 100))
    settings = dict(max_attempts=12, part_size=48 * 1024, read_ahead=4, multipart_threshold=5 * MiB,
                    multipart_part_size=5 * MiB)
    big = text_bytes(6 * MiB, seed=9)

    async def check(store: S3Store, key: str, data: bytes) -> None:
        assert await store.read(key) == data
        assert await store.read(key, 1234, 150_000) == data[1234:150_000]
        async with store.open_read(key) as parts:
            assert b"".join([p async for p in parts]) == data
        await store.put(f"written/{key}", data)

    with anyio.fail_after(60):
        async with S3Store(s3.bucket, **options, **settings) as store:
            assert [o.key for o in await store.list("shard-")] == sorted(objects)
            async with anyio.create_task_group() as tg:  # concurrent, so backoffs overlap
                for key, data in objects.items():
                    tg.start_soon(check, store, key, data)
                tg.start_soon(store.put, "big", big)  # multipart, two parts
            stats = store.statistics()
    faults = proxy.statistics().faults
    if rate >= 0.3:
        assert set(faults) == {*RETRIED, "latency"}, faults  # every kind was injected
    assert stats.retries == sum(faults.get(k, 0) for k in RETRIED) > 0  # one retry per recovered fault
    async with S3Store(s3.bucket, **s3.options) as direct:
        for key, data in objects.items():
            assert await direct.read(f"written/{key}") == data
        assert await direct.read("big") == big


@pytest.mark.parametrize("kind", ["reset_body", "truncate_body"])
async def test_a_broken_body_resumes_from_the_last_byte(s3, s3_proxy, kind: str) -> None:
    data = text_bytes(2 * MiB, seed=4)
    await _seed(s3, {"obj": data})
    proxy, options = s3_proxy(seed=5)
    async with S3Store(s3.bucket, **options) as store:
        proxy.inject(kind, count=3, method="GET")
        assert await store.read("obj", 1000) == data[1000:]
        assert store.statistics().retries == 3
    gets = [r for r in proxy.statistics().records if r.method == "GET"]
    assert [r.fault for r in gets] == [kind] * 3 + [None]
    offset = 1000
    for rec in gets:  # each GET asks for exactly what the previous ones did not deliver
        assert rec.range == f"bytes={offset}-"
        offset += rec.body_bytes
    assert offset == len(data) and sum(r.body_bytes for r in gets) == len(data) - 1000  # nothing re-read


async def test_a_broken_part_of_a_windowed_read_resumes_only_that_part(s3, s3_proxy) -> None:
    data = text_bytes(1 * MiB, seed=6)
    await _seed(s3, {"obj": data})
    proxy, options = s3_proxy(seed=6)
    part = 128 * 1024
    async with S3Store(s3.bucket, **options, part_size=part, read_ahead=3) as store:
        proxy.inject("reset_body", method="GET", match=f"Range: bytes={3 * part}-")
        async with store.open_read("obj") as parts:
            assert b"".join([p async for p in parts]) == data
        assert store.statistics().retries == 1
    stats = proxy.statistics()
    assert stats.body_bytes("GET") == len(data)  # the broken part's remainder only, nothing else twice
    broken = next(r for r in stats.records if r.fault == "reset_body")
    assert broken.range == f"bytes={3 * part}-{4 * part - 1}"
    assert any(r.range == f"bytes={3 * part + broken.body_bytes}-{4 * part - 1}" for r in stats.records)


async def test_windowed_read_is_a_sliding_window_not_batches(s3, s3_proxy) -> None:
    data = text_bytes(1 * MiB, seed=7)
    await _seed(s3, {"obj": data})
    proxy, options = s3_proxy(faults=Faults(latency_s=0.6))
    part = 64 * 1024
    async with S3Store(s3.bucket, **options, part_size=part, read_ahead=3) as store:
        proxy.inject("latency", method="GET", match=f"Range: bytes={1 * part}-")  # part 1 is slow
        async with store.open_read("obj") as parts:
            assert b"".join([p async for p in parts]) == data
    done = [r.range for r in proxy.statistics().records if r.method == "GET"]
    # With a window of 3, part 3 starts as soon as part 0 is taken and finishes while part 1
    # is still delayed; a batch of three would wait for part 1 before starting part 3.
    assert done.index(f"bytes={3 * part}-{4 * part - 1}") < done.index(f"bytes={part}-{2 * part - 1}")


async def test_resumes_are_bounded_by_max_attempts(s3, s3_proxy) -> None:
    await _seed(s3, {"obj": text_bytes(500_000)})
    proxy, options = s3_proxy()
    async with S3Store(s3.bucket, **options, max_attempts=3) as store:
        proxy.inject("truncate_body", count=3, method="GET")
        with pytest.raises(ConnectorError, match="gave up after 3 attempts"):
            await store.read("obj")
        assert store.statistics().retries == 2


async def test_throttling_is_retried_then_reported(s3, s3_proxy) -> None:
    proxy, options = s3_proxy(faults=Faults(slowdown=1.0))
    async with S3Store(s3.bucket, **options, max_attempts=2) as store:
        with pytest.raises(Throttled, match="kept throttling after 2 attempts"):
            await store.head("anything")
        assert store.statistics().retries == 1


async def test_retry_deadline_bounds_total_time(s3, s3_proxy) -> None:
    proxy, options = s3_proxy(faults=Faults(internal_error=1.0))
    async with S3Store(s3.bucket, **options, max_attempts=100, retry_deadline=0.5) as store:
        t0 = time.monotonic()
        with pytest.raises(ConnectorError, match="InternalError"):
            await store.read("anything")
        assert time.monotonic() - t0 < 10
        assert store.statistics().retries < 10


@pytest.mark.parametrize("size", [300_000, 6 * MiB])
async def test_conditional_put_whose_response_was_lost_still_wins(s3, s3_proxy, size: int) -> None:
    data = text_bytes(size, seed=8)
    proxy, options = s3_proxy()
    settings = dict(multipart_threshold=5 * MiB, multipart_part_size=5 * MiB)
    async with S3Store(s3.bucket, **options, **settings) as store:
        # the single PUT, or the multipart completion, reaches the server; its answer does not
        proxy.inject("lost_response", method="POST" if size > 5 * MiB else "PUT",
                     match="uploadId=" if size > 5 * MiB else None)
        await store.put("manifest", data, if_none_match=True)
        assert proxy.pending_injections() == 0 and store.statistics().retries >= 1
        proxy.inject("lost_response", method="POST" if size > 5 * MiB else "PUT",
                     match="uploadId=" if size > 5 * MiB else None)
        with pytest.raises(AlreadyExists):  # other bytes: a real loss is still a loss
            await store.put("manifest", data[::-1], if_none_match=True)
        assert await store.read("manifest") == data


async def test_wan_link_byte_accounting(s3, s3_proxy) -> None:
    data = text_bytes(2 * MiB, seed=10)
    await _seed(s3, {"obj": data})
    rate = 16 * MiB
    proxy, options = s3_proxy(link=Link(bandwidth=rate, latency_s=0.005))
    async with S3Store(s3.bucket, **options, part_size=256 * 1024, read_ahead=4) as store:
        t0 = time.monotonic()
        async with store.open_read("obj") as parts:
            assert b"".join([p async for p in parts]) == data
        elapsed = time.monotonic() - t0
        await store.put("up", data[: MiB])
    stats = proxy.statistics()
    assert stats.body_bytes("GET") == len(data) and elapsed >= (len(data) - 64 * 1024) / rate * 0.9
    assert stats.bytes_up >= MiB and stats.bytes_down >= len(data)


async def test_multipart_put_whose_completion_response_was_lost(s3, s3_proxy) -> None:
    data = text_bytes(6 * MiB, seed=11)
    proxy, options = s3_proxy()
    settings = dict(multipart_threshold=5 * MiB, multipart_part_size=5 * MiB)
    async with S3Store(s3.bucket, **options, **settings) as store:
        proxy.inject("lost_response", method="POST", match="uploadId=")
        await store.put("big", data)
        assert proxy.pending_injections() == 0 and store.statistics().retries >= 1
        assert await store.read("big") == data


async def test_a_request_that_times_out_is_retried(s3, s3_proxy) -> None:
    data = text_bytes(100_000, seed=12)
    await _seed(s3, {"obj": data})
    proxy, options = s3_proxy(faults=Faults(latency_s=2.0))
    async with S3Store(s3.bucket, **options, read_timeout=0.5) as store:
        proxy.inject("latency", method="GET")  # the server answers after the client gave up
        assert await store.read("obj") == data
        assert store.statistics().retries == 1


async def _outage_for(proxy, seconds: float) -> None:
    """Every request refused (a reset before any response) for `seconds`, then the endpoint is back."""
    proxy.set_faults(Faults(reset_before_response=1.0))
    await anyio.sleep(seconds)
    proxy.set_faults(Faults())


async def test_an_outage_of_an_endpoint_that_answered_is_ridden_out(s3, s3_proxy, caplog) -> None:
    """A training job must not die of S3 being away for a few seconds: once the endpoint has answered,
    a request that fails all of botocore's attempts is tried again until `retry_deadline`."""
    data = text_bytes(300_000, seed=3)
    await _seed(s3, {"obj": data})
    proxy, options = s3_proxy()
    async with S3Store(s3.bucket, **options, max_attempts=2, retry_deadline=30) as store:
        assert await store.read("obj", 0, 10) == data[:10]  # the endpoint answered
        retries = store.statistics().retries
        with caplog.at_level(logging.WARNING, logger="zephon_stream.connectors.s3"):
            async with anyio.create_task_group() as tg:
                proxy.set_faults(Faults(reset_before_response=1.0))
                tg.start_soon(_outage_for, proxy, 3.0)
                t0 = time.monotonic()
                assert await store.read("obj") == data
                assert [o.key for o in await store.list("")] == ["obj"]
        assert time.monotonic() - t0 >= 2.5
        assert store.statistics().retries - retries >= 2
    refused = proxy.statistics().faults.get("reset_before_response", 0)
    assert refused >= 4, refused  # two attempts of botocore's, at least twice
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "it answered before, so it is retried until retry_deadline = 30 s" in m]) == 1, said
    assert any(re.search(r"answers again, after [\d.]+ s", m) for m in said), said


async def test_an_endpoint_that_never_answered_fails_after_max_attempts(s3, s3_proxy) -> None:
    """A wrong host or port, or a server that is down at the start: no outage to ride out, a quick error."""
    proxy, options = s3_proxy(faults=Faults(reset_before_response=1.0))
    async with S3Store(s3.bucket, **options, max_attempts=2, retry_deadline=60) as store:
        t0 = time.monotonic()
        with pytest.raises(ConnectorError, match="check that the endpoint is reachable"):
            await store.read("obj")
        assert time.monotonic() - t0 < 10
    assert proxy.statistics().faults["reset_before_response"] == 2


async def test_an_outage_longer_than_retry_deadline_fails(s3, s3_proxy) -> None:
    await _seed(s3, {"obj": b"x" * 1000})
    proxy, options = s3_proxy()
    async with S3Store(s3.bucket, **options, max_attempts=2, retry_deadline=2) as store:
        await store.head("obj")
        proxy.set_faults(Faults(reset_before_response=1.0))
        t0 = time.monotonic()
        with pytest.raises(ConnectorError, match="check that the endpoint is reachable"):
            await store.read("obj")
        assert 1.5 < time.monotonic() - t0 < 10


def test_only_what_botocore_retries_is_an_outage() -> None:
    from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError

    from zephon_stream.connectors.s3 import _outage

    def answer(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert [_outage(answer(s, c)) for s, c in [(500, "InternalError"), (502, "502"), (503, "SlowDown"),
                                               (504, "504"), (400, "Throttling")]] == [True] * 5
    # a 501 (an endpoint without conditional puts) fails at once, as 4xx answers and timeouts do
    assert [_outage(answer(s, c)) for s, c in [(501, "NotImplemented"), (505, "505"), (404, "NoSuchKey"),
                                               (412, "PreconditionFailed"), (403, "AccessDenied")]] == [False] * 5
    assert _outage(EndpointConnectionError(endpoint_url="http://x")) is True
    assert _outage(ConnectTimeoutError(endpoint_url="http://x")) is False


async def test_an_outage_does_not_hold_the_pool_s_slots(s3, s3_proxy) -> None:
    """Stores of one pool share its limiter: a request waiting out one endpoint's outage held its
    slot, and a store on an endpoint that was up waited for it."""
    from zephon_stream.connectors.s3 import S3ClientPool

    await _seed(s3, {"obj": b"x" * 1000})
    proxy, options = s3_proxy()
    async with S3ClientPool(max_in_flight=1) as pool, \
            S3Store(s3.bucket, **options, pool=pool, max_attempts=2, retry_deadline=30) as down, \
            S3Store(s3.bucket, **s3.options, pool=pool) as up:
        await down.head("obj")
        async with anyio.create_task_group() as tg:
            proxy.set_faults(Faults(reset_before_response=1.0))
            tg.start_soon(down.read, "obj")
            await anyio.sleep(1.0)  # its attempts are spent: it waits out the outage
            t0 = time.monotonic()
            assert (await up.head("obj")).size == 1000
            assert time.monotonic() - t0 < 1.0
            proxy.set_faults(Faults())
