"""Relay logic on memory stores: lagging children, restarts, retention, foreign trees, metrics."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import anyio
import pytest

from tests.relay._helpers import (
    assert_no_partial_version,
    assert_same,
    committed,
    model,
    snapshot,
    step,
    until,
    zeros_like,
)
from zephon_stream import ConfigError, DataError, RefitError
from zephon_stream.cli.relay import serve_metrics
from zephon_stream.connectors import MemoryStore
from zephon_stream.connectors.base import ServerSideCopy, Store
from zephon_stream.refit import Publisher, Subscriber
from zephon_stream.relay import Prefix, Relay
from zephon_stream.testing.stores import WrappedStore


async def _publish(pub: Publisher, w: dict, versions: range, models: dict) -> dict:
    for v in versions:
        w = step(w, v, frac=0.2)
        models[v] = snapshot(w)
        assert (await pub.publish(w)).version == v
    return w


def test_lagging_child_restarts_at_newest_keyframe() -> None:
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        models: dict = {}
        w = model(5)
        replica = zeros_like(w)
        sub = Subscriber("c/", store=child)
        async with Publisher("p/", store=parent, chunk_bytes=256, keyframe_every=3, keep_versions=2) as pub, \
                Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)], workers=2) as relay:
            w = await _publish(pub, w, range(1, 3), models)
            assert (await relay.sync()).committed == {"c/": [1, 2]}
            assert await sub.pull(replica) == 2
            w = await _publish(pub, w, range(3, 10), models)  # keyframes 1, 4, 7; the parent keeps 7..9
            assert await committed(parent, "p/") == [7, 8, 9]
            report = await relay.sync()
            assert report.ok and report.committed == {"c/": [7, 8, 9]}
            assert await committed(child, "c/") == [7, 8, 9]  # old versions below the gap swept
            assert not [k for k in child.objects if k.startswith(("c/v1/", "c/v2/"))]
            assert await sub.pull(replica) == 9  # across the gap: from keyframe 7
            assert_same(models[9], replica)
            w = await _publish(pub, w, range(10, 13), models)  # intact chain: every delta, composed by subscribers
            assert (await relay.sync()).committed == {"c/": [10, 11, 12]}
            assert await sub.pull(replica) == 12
            assert_same(models[12], replica)
            assert await committed(child, "c/") == await committed(parent, "p/")

    anyio.run(main)


class Killed(BaseException):
    """Stands in for kill -9: nothing after it runs."""


class _Dies:
    def __init__(self, inner: Store, after: int) -> None:
        self.inner, self.after = inner, after

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        self.after -= 1
        if self.after < 0:
            raise Killed(key)
        await self.inner.put(key, data, if_none_match=if_none_match)


def test_a_new_child_starts_at_the_keyframe_without_a_warning(caplog) -> None:
    """Every new, empty child starts at the parent's newest keyframe: that logged 'child behind the
    parent's garbage collection' at WARNING on each first sync (a trial's alerts would fire)."""
    async def main() -> None:
        parent, child, lagging = MemoryStore(), MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256, keyframe_every=3, keep_versions=2) as pub:
            w = await _publish(pub, model(5), range(1, 3), {})
            async with Relay(Prefix("p/", store=parent), [Prefix("l/", store=lagging)]) as relay:
                assert (await relay.sync()).ok
            await _publish(pub, w, range(3, 6), {})  # keyframe 4; keeps 4, 5
        with caplog.at_level(logging.INFO, logger="zephon_stream.relay"):
            async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child), Prefix("l/", store=lagging)]) \
                    as relay:
                assert (await relay.sync()).committed == {"c/": [4, 5], "l/": [4, 5]}
        said = {(r.levelname, r.getMessage().split(":")[0], getattr(r, "child", None)) for r in caplog.records
                if getattr(r, "event", None) in ("child_jump", "child_start")}
        assert said == {("INFO", "new child", "c/"),
                        ("WARNING", "child behind the parent's garbage collection", "l/")}, said

    anyio.run(main)


@pytest.mark.parametrize("after", [0, 3, 7, 12])
def test_restart_copies_only_what_is_missing(after: int) -> None:
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        models: dict = {}
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await _publish(pub, model(6), range(1, 3), models)
        with pytest.raises(Killed):
            async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=_Dies(child, after))], workers=1) as r:
                await r.sync()
        done = await assert_no_partial_version(child, "c/")

        def pending(k: str) -> bool:  # an object of a version the killed relay did not commit
            return "/MANIFEST" not in k and "LATEST" not in k and int(k[3:].partition("/")[0]) not in done

        there = {k: len(v) for k, v in child.objects.items() if pending(k)}
        total = sum(len(v) for k, v in parent.objects.items() if pending(k))
        before = parent.statistics().bytes_read
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)], workers=3) as relay:
            assert (await relay.sync()).ok
            stats = relay.statistics()
        assert stats.children[0].objects_skipped == len(there)
        assert stats.bytes_read == total - sum(there.values())  # nothing already at the child read again
        manifests = sum(len(v) for k, v in parent.objects.items() if k.endswith("/MANIFEST"))
        assert parent.statistics().bytes_read - before <= total - sum(there.values()) + manifests + 64
        replica = zeros_like(models[2])
        assert await Subscriber("c/", store=child).pull(replica) == 2
        assert_same(models[2], replica)

    anyio.run(main)


def test_corrupt_object_at_child_is_replaced() -> None:
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        models: dict = {}
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await _publish(pub, model(7), range(1, 2), models)
        key = next(k for k in parent.objects if "/key-" in k)
        child.objects["c/" + key[2:]] = bytes(len(parent.objects[key]))  # a stale, wrong object of the right size
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            assert (await relay.sync()).ok
        assert child.objects["c/" + key[2:]] == parent.objects[key]

    anyio.run(main)


def test_keep_versions_at_the_children() -> None:
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256, keyframe_every=2, keep_versions=100) as pub, \
                Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)], keep_versions=2) as relay:
            await _publish(pub, model(8), range(1, 8), {})
            assert (await relay.sync()).ok
        assert await committed(parent, "p/") == list(range(1, 8))
        assert await committed(child, "c/") == [6, 7]  # min(newest keyframe 7, 7 - 2 + 1)

    anyio.run(main)


def test_child_fed_by_another_tree_is_refused() -> None:
    async def main() -> None:
        parent, other, child = MemoryStore(), MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await _publish(pub, model(9), range(1, 3), {})
        async with Publisher("p/", store=other, chunk_bytes=256) as pub:
            await _publish(pub, model(10), range(1, 2), {})
        async with Relay(Prefix("p/", store=other), [Prefix("c/", store=child)]) as relay:
            assert (await relay.sync()).ok
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            report = await relay.sync()
        assert not report.ok and isinstance(report.errors[0], RefitError)
        assert "another tree" in str(report.errors[0])
        assert await committed(child, "c/") == [1]

    anyio.run(main)


@pytest.mark.parametrize("relay_kept", ["new", "same", "same, after a resync"])
def test_child_fed_by_another_run_is_refused_after_the_parent_collected_its_version(relay_kept: str) -> None:
    """The parent no longer holds the child's newest version number (collected): the check above has
    nothing to compare, and the relay grafted the other run's next versions onto the child, exit 0
    (a new-user trial: a wiped prefix, keep 4). Its next version's base model says so: for a new
    relay (--once), and for a daemon's, which knew its child's version and kept the old run's
    manifest of that number (a review)."""
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256, keyframe_every=4, keep_versions=4) as pub:
            await _publish(pub, model(9), range(1, 5), {})
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as first:
            assert (await first.sync()).ok
            for key in list(parent.objects):  # the trainer starts again on a wiped prefix
                await parent.delete(key)
            async with Publisher("p/", store=parent, chunk_bytes=256, keyframe_every=4, keep_versions=4) as pub:
                await _publish(pub, model(10), range(1, 9), {})
            assert await committed(parent, "p/") == [5, 6, 7, 8]
            if relay_kept == "new":
                async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
                    report = await relay.sync()
            else:
                if relay_kept.endswith("resync"):
                    first.forget()
                report = await first.sync()
        assert not report.ok and isinstance(report.errors[0], RefitError)
        assert "version 5 at the parent p/ is a delta from another model" in str(report.errors[0]), report.errors
        assert await committed(child, "c/") == [1, 2, 3, 4]

    anyio.run(main)


def test_child_key_with_leading_zero_is_not_a_version() -> None:
    """A stray `v01/MANIFEST` at a child (a user's copy, another tool) is not version 1 there: the
    relay still copies version 1, and leaves the stranger's key alone."""
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await pub.publish(model(3))
        await child.put("c/v01/MANIFEST", await parent.read("p/v1/MANIFEST"))
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            report = await relay.sync()
            assert report.ok and report.committed == {"c/": [1]}
            assert relay.statistics().children[0].latest == 1
        assert await committed(child, "c/") == [1] and "c/v01/MANIFEST" in child.objects
        assert await assert_no_partial_version(child, "c/") == [1]

    anyio.run(main)


class _Bucket(MemoryStore):
    """A bucket of a fake server: it copies server-side (`ServerSideCopy`) from buckets of its server."""

    def __init__(self, server: str) -> None:
        super().__init__()
        self.server, self.copied = server, 0

    def copies_from(self, source: object) -> bool:
        return isinstance(source, _Bucket) and source.server == self.server

    async def copy_from(self, source: Store, src_key: str, dst_key: str) -> None:
        self.copied += 1
        self.objects[dst_key] = source.objects[src_key]


def test_server_side_copy_is_a_protocol_not_a_probe() -> None:
    """A child store that implements ServerSideCopy and accepts the parent's copies on the server;
    one that does not accept it (another server) gets PUTs of the checked bytes."""
    async def main() -> None:
        parent, near, far = _Bucket("one"), _Bucket("one"), _Bucket("two")
        assert isinstance(near, ServerSideCopy) and not isinstance(MemoryStore(), ServerSideCopy)
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await pub.publish(model(7))
        objects = len([k for k in parent.objects if "/MANIFEST" not in k and "LATEST" not in k])
        async with Relay(Prefix("p/", store=parent), [Prefix("n/", store=near), Prefix("f/", store=far)]) as relay:
            assert (await relay.sync()).committed == {"n/": [1], "f/": [1]}
            near_stats, far_stats = relay.statistics().children
        assert near.copied == near_stats.server_side_copies == objects and near_stats.bytes_written == 0
        assert far.copied == far_stats.server_side_copies == 0 and far_stats.objects_written == objects
        for child, key in ((near, "n/"), (far, "f/")):
            assert await assert_no_partial_version(child, key) == [1]

    anyio.run(main)


def test_bad_settings_refused() -> None:
    with pytest.raises(RefitError, match="at least one child"):
        Relay("memory://x/p/", [])
    with pytest.raises(ConfigError, match="is its parent"):
        Relay("memory://x/p/", ["memory://x/p/"])
    with pytest.raises(RefitError, match="workers=0"):
        Relay("memory://x/p/", ["memory://x/c/"], workers=0)
    assert "secret" not in repr(Prefix("s3://b/p/", endpoint_url="http://u:secret@h:1", secret_access_key="secret"))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_metrics_endpoint(host) -> None:
    """On 127.0.0.1 by default; --metrics-host (here ::1, the other loopback) for other listeners."""
    async def get(port: int, path: str, method: str = "GET") -> tuple[str, str]:
        head, body = await _request(host, port, path, method)
        return head.split("\r\n")[0], body

    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await _publish(pub, model(11), range(1, 3), {})
        with anyio.fail_after(30):
            async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay, \
                    anyio.create_task_group() as tg:
                assert (await relay.sync()).ok
                port = await (tg.start(serve_metrics, relay, 0, host) if host != "127.0.0.1" else
                              tg.start(serve_metrics, relay, 0))
                status, body = await get(port, "/metrics")
                assert status == "HTTP/1.1 200 OK"
                assert 'zephon_relay_versions_relayed_total{child="c/"} 2' in body
                assert 'zephon_relay_lag_versions{child="c/"} 0' in body
                assert "zephon_relay_up 1" in body
                assert await get(port, "/healthz") == ("HTTP/1.1 200 OK", "ok\n")
                assert (await get(port, "/nope"))[0] == "HTTP/1.1 404 Not Found"
                # HEAD, as some load balancers' health checks send it: the status alone (it was 405)
                assert await get(port, "/healthz", "HEAD") == ("HTTP/1.1 200 OK", "")
                assert (await get(port, "/healthz", "POST"))[0] == "HTTP/1.1 405 Method Not Allowed"
                assert "Allow: GET, HEAD" in (await _request(host, port, "/healthz", "POST"))[0], "a 405 says so"
                tg.cancel_scope.cancel()

    anyio.run(main)


def test_hostile_parent_manifest_reported_not_copied() -> None:
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await _publish(pub, model(12), range(1, 3), {})
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            assert (await relay.sync()).ok
        child.objects.pop("c/v2/MANIFEST")
        parent.objects["p/v1/MANIFEST"] = b"\x81\xa7version\x01"  # not a manifest
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            report = await relay.sync()  # the child's newest version is checked against the parent's
        assert not report.ok and isinstance(report.errors[0], DataError), report.errors
        assert "p/v1/MANIFEST" in str(report.errors[0])
        assert await committed(child, "c/") == [1]

    anyio.run(main)


class _HoldManifest:
    """The publisher's store: its MANIFEST put of `version` waits for `release`."""

    def __init__(self, inner: Store, version: int) -> None:
        self.inner, self.version = inner, version
        self.waiting, self.release = anyio.Event(), anyio.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        if key.endswith(f"v{self.version}/MANIFEST"):
            self.waiting.set()
            await self.release.wait()
        await self.inner.put(key, data, if_none_match=if_none_match)


def test_stream_ahead_copies_while_publishing_and_reads_once() -> None:
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        held = _HoldManifest(parent, 2)
        models: dict = {}
        w = model(13)
        stop = anyio.Event()
        with anyio.fail_after(30):
            async with Publisher("p/", store=held, chunk_bytes=256) as pub, \
                    Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)], stream_ahead=True,
                          poll_interval=0.002) as relay, anyio.create_task_group() as tg:
                w = await _publish(pub, w, range(1, 2), models)
                tg.start_soon(relay.run, stop)
                await until(lambda: _has(child, "c/", 1))
                before = relay.statistics().bytes_read
                tg.start_soon(_publish, pub, w, range(2, 3), models)
                await held.waiting.wait()  # every object of v2 is at the parent, its MANIFEST is not
                objects = {k: len(v) for k, v in parent.objects.items() if k.startswith("p/v2/")}
                await until(lambda: _ahead(relay, len(objects)))
                assert not [k for k in child.objects if k.startswith("c/v2/MANIFEST")]  # invisible so far
                held.release.set()
                await until(lambda: _has(child, "c/", 2))
                stop.set()
            stats = relay.statistics()
        assert stats.bytes_read - before == sum(objects.values())  # each object read once, ahead
        assert stats.children[0].objects_skipped == len(objects)
        replica = zeros_like(w)
        assert await Subscriber("c/", store=child).pull(replica) == 2
        assert_same(models[2], replica)

    anyio.run(main)


async def _has(store: MemoryStore, prefix: str, v: int) -> bool:
    return v in await committed(store, prefix)


async def _ahead(relay: Relay, n: int) -> bool:
    return relay.statistics().objects_ahead >= n


@pytest.mark.parametrize("stream_ahead", [False, True])
def test_a_daemon_jumps_at_once_when_the_parent_collected_past_its_next_version(stream_ahead: bool) -> None:
    # A publisher that published v3..v9 and collected v1..v6 between two polls: the daemon polled for v3
    # alone, found nothing, and waited for its resync (a minute) with lag 0 and healthz ok.
    async def main() -> None:
        staging, parent, child = MemoryStore(), MemoryStore(), MemoryStore()
        models: dict = {}
        w = model(5)
        async with Publisher("p/", store=staging, chunk_bytes=256, keyframe_every=3, keep_versions=2) as pub:
            w = await _publish(pub, w, range(1, 3), models)
            parent.objects.update(staging.objects)
            async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)], workers=2, poll_interval=0.02,
                             resync_interval=1000.0, stream_ahead=stream_ahead) as relay, \
                    anyio.create_task_group() as tg:
                stop = anyio.Event()
                tg.start_soon(relay.run, stop)
                await until(lambda: _child_has(child, [1, 2]), timeout=10)
                w = await _publish(pub, w, range(3, 10), models)  # keyframes 1, 4, 7; keeps 7..9
                parent.objects.clear()
                parent.objects.update(staging.objects)  # at once, between two polls
                await until(lambda: _child_has(child, [7, 8, 9]), timeout=10)
                stop.set()
        replica = zeros_like(w)
        assert await Subscriber("c/", store=child).pull(replica) == 9
        assert_same(models[9], replica)

    anyio.run(main)


class _Daemon(NamedTuple):
    relay: Relay
    store: WrappedStore  # the parent as the relay sees it
    stop: anyio.Event
    ended: anyio.Event  # run() returned


@asynccontextmanager
async def _daemon(wrap: type[WrappedStore], versions: int, **options: Any) -> AsyncIterator[_Daemon]:
    """A relay daemon (`run`) from a parent of `versions` versions, read through `wrap`, to a child
    that holds them all when the block starts; stopped at its end."""
    parent, child = MemoryStore(), MemoryStore()
    async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
        await _publish(pub, model(5), range(1, versions + 1), {})
    store = wrap(parent)
    async with Relay(Prefix("p/", store=store), [Prefix("c/", store=child)], **options) as relay, \
            anyio.create_task_group() as tg:
        daemon = _Daemon(relay, store, anyio.Event(), anyio.Event())

        async def running() -> None:
            await relay.run(daemon.stop)
            daemon.ended.set()

        tg.start_soon(running)
        await until(lambda: _child_has(child, list(range(1, versions + 1))), timeout=10)
        yield daemon
        daemon.stop.set()


def test_an_idle_relay_checks_its_newest_version_at_most_once_a_second() -> None:
    # the check above made every idle poll two HEADs: 200 a second at 10 ms polls
    class Counting(WrappedStore):
        heads: list[str] = []

        async def head(self, key: str):  # type: ignore[no-untyped-def]
            self.heads.append(key)
            return await super().head(key)

    async def main() -> None:
        async with _daemon(Counting, 2, workers=2, poll_interval=0.01) as daemon:
            daemon.store.heads.clear()
            polls = daemon.relay.statistics().polls
            await anyio.sleep(1.5)
        polls = daemon.relay.statistics().polls - polls
        newest = sum(k.startswith("p/v2/") for k in daemon.store.heads)
        assert polls >= 20 and 1 <= newest <= 2, (polls, newest)

    anyio.run(main)


def test_a_parent_that_fails_or_stalls_its_polls_makes_the_relay_unhealthy_at_once(monkeypatch) -> None:
    # /healthz said ok for 4 minutes while the parent was down: a poll's error did not count, and a poll
    # whose requests retried (up to retry_deadline) held the loop until the next sync gave up
    from zephon_stream.errors import ConnectorError
    from zephon_stream.relay import node

    class Flaky(WrappedStore):
        mode = "ok"

        async def head(self, key: str):  # type: ignore[no-untyped-def]
            if self.mode == "down":
                raise ConnectorError("connection refused (test)")
            while self.mode == "stalled":
                await anyio.sleep(0.01)
            return await super().head(key)

    monkeypatch.setattr(node, "POLL_STALL_S", 0.3)

    async def main() -> None:
        async with _daemon(Flaky, 2, poll_interval=0.01, resync_interval=1000.0) as daemon:
            relay, flaky = daemon.relay, daemon.store
            assert relay.statistics().healthy
            flaky.mode = "down"
            await until(lambda: _unhealthy(relay, "connection refused (test)"), timeout=5)
            flaky.mode = "ok"
            await until(lambda: _healthy(relay), timeout=5)  # answered again: healthy without a sync
            flaky.mode = "stalled"
            await until(lambda: _unhealthy(relay, "has not answered a poll for"), timeout=5)
            flaky.mode = "ok"
            await until(lambda: _healthy(relay), timeout=5)

    anyio.run(main)


def test_stop_cuts_a_poll_that_waits_for_the_parent() -> None:
    # SIGTERM while a poll's requests retried an unreachable parent waited out the whole --grace
    class Stalled(WrappedStore):
        stalled = False

        async def head(self, key: str):  # type: ignore[no-untyped-def]
            while self.stalled:
                await anyio.sleep(0.01)
            return await super().head(key)

    async def main() -> None:
        async with _daemon(Stalled, 1, poll_interval=0.01, resync_interval=1000.0) as daemon:
            daemon.store.stalled = True
            polls = daemon.relay.statistics().polls
            await until(lambda: _polled_since(daemon.relay, polls), timeout=5)  # a poll waits for the parent now
            await anyio.sleep(0.1)
            with anyio.fail_after(2):  # run() returns: the poll is cut, not waited for
                daemon.stop.set()
                await daemon.ended.wait()

    anyio.run(main)


async def _request(host: str, port: int, path: str, method: str = "GET") -> tuple[str, str]:
    """(status line and headers, body) of `method path` to the metrics server."""
    async with await anyio.connect_tcp(host, port) as s:
        await s.send(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        try:
            while True:
                data += await s.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    head, _, body = data.decode().partition("\r\n\r\n")
    return head, body


async def _polled_since(relay: Relay, polls: int) -> bool:
    return relay.statistics().polls > polls


async def _unhealthy(relay: Relay, says: str) -> bool:
    stats = relay.statistics()
    return not stats.healthy and says in stats.last_error


async def _healthy(relay: Relay) -> bool:
    return relay.statistics().healthy


async def _child_has(store: Store, versions: list[int]) -> bool:
    return await committed(store, "c/") == versions
