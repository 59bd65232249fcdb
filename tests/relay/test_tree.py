"""The relay tree end to end on SeaweedFS: publisher -> root relay -> two regions -> a zone, with
subscribers at the leaves, racing relays, a corrupt parent object, and byte accounting."""

from __future__ import annotations

import anyio
import pytest
import torch

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
from tests.relay.conftest import Region
from zephon_stream import DigestMismatch
from zephon_stream.connectors.base import Store
from zephon_stream.refit import Publisher, Subscriber
from zephon_stream.relay import Prefix, Relay, prometheus_text

pytestmark = pytest.mark.s3

CHUNK = 2048


def test_tree_end_to_end_bit_exact(regions) -> None:
    """Ten versions with keyframes and GC through root -> {A, B} and A -> zone (server-side copies):
    every leaf subscriber is bit-exact at every version, no child ever shows a partial version,
    and every child ends with the parent's retention window."""
    trainer, a, b = regions("trainer", proxy=False), regions("a"), regions("b")
    leaves = [(a, "policy/"), (b, "policy/"), (a, "zone1/")]

    async def watch(stop: anyio.Event, checks: list[int]) -> None:
        stores = [(r.open(p)) for r, p in leaves]
        while not stop.is_set():
            for store, prefix in stores:
                checks.extend(await assert_no_partial_version(store, prefix))
            await anyio.sleep(0.005)
        for store, _ in stores:
            await store.aclose()

    async def main() -> None:
        pstore, pkey = trainer.open("policy/")
        w = model(1, {"w": ((64, 96), torch.bfloat16), "b": ((96,), torch.float32)})
        root = Relay(trainer.prefix("policy/"), [a.prefix("policy/"), b.prefix("policy/")], workers=4,
                     poll_interval=0.01)
        zone = Relay(a.prefix("policy/"), [a.prefix("zone1/")], workers=4, poll_interval=0.01)
        subs = [(Subscriber(p, store=s), zeros_like(w)) for s, p in (r.open(p) for r, p in leaves)]
        stop, checks = anyio.Event(), []
        with anyio.fail_after(120):
            async with pstore, Publisher(pkey, store=pstore, chunk_bytes=CHUNK, keyframe_every=4,
                                         keep_versions=3) as pub, root, zone:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(root.run, stop)
                    tg.start_soon(zone.run, stop)
                    tg.start_soon(watch, stop, checks)
                    for v in range(1, 11):
                        w = step(w, v, frac=0.1)
                        assert (await pub.publish(w)).version == v
                        for sub, replica in subs:
                            await until(lambda sub=sub, replica=replica, v=v: _reached(sub, replica, v))
                            assert_same(w, replica)
                    stop.set()
                for relay in (root, zone):  # one more sync: the publisher's last GC is mirrored too
                    assert (await relay.sync()).ok
                want = await committed(pstore, pkey)
                assert want == [8, 9, 10]
                for sub, _ in subs:
                    assert await committed(sub.store, sub.key_prefix) == want
                    await sub.store.aclose()
        assert checks, "the watcher never saw a version"
        zs = zone.statistics().children[0]
        assert zs.server_side_copies > 0 and zs.bytes_written == 0  # same endpoint: nothing uploaded
        rs = root.statistics()
        assert [c.versions_relayed for c in rs.children] == [10, 10] and rs.errors == {}
        assert all(c.versions_collected >= 7 for c in rs.children)

    anyio.run(main)


async def _reached(sub: Subscriber, replica: dict, v: int) -> bool:
    return await sub.pull(replica) >= v


class _Gate:
    """Holds each relay's first MANIFEST put until both relays are there: a real race."""

    def __init__(self, n: int) -> None:
        self.n, self.arrived, self.open = n, 0, anyio.Event()


class _GatedStore:
    def __init__(self, inner: Store, gate: _Gate) -> None:
        self.inner, self.gate, self.waited = inner, gate, False

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        if key.endswith("/MANIFEST") and not self.waited:
            self.waited = True
            self.gate.arrived += 1
            if self.gate.arrived >= self.gate.n:
                self.gate.open.set()
            await self.gate.open.wait()
        await self.inner.put(key, data, if_none_match=if_none_match)


def test_two_relays_racing_on_one_child(regions) -> None:
    trainer, child = regions("trainer", proxy=False), regions("child")

    async def main() -> None:
        pstore, pkey = trainer.open("p/")
        gate = _Gate(2)
        (s1, k1), (s2, k2) = child.open("p/"), child.open("p/")
        w = model(2)
        models = {}
        with anyio.fail_after(60):
            async with pstore, s1, s2, Publisher(pkey, store=pstore, chunk_bytes=256, keyframe_every=3) as pub:
                for v in range(1, 6):
                    w = step(w, v, frac=0.2)
                    models[v] = snapshot(w)
                    await pub.publish(w)
                relays = [Relay(trainer.prefix("p/"), [Prefix(k, store=_GatedStore(s, gate))], workers=3)
                          for s, k in ((s1, k1), (s2, k2))]
                async with relays[0], relays[1]:
                    reports = []

                    async def one(r: Relay) -> None:
                        reports.append(await r.sync())

                    async with anyio.create_task_group() as tg:
                        for r in relays:
                            tg.start_soon(one, r)
                    assert all(r.ok for r in reports), [r.errors for r in reports]
                    stats = [r.statistics().children[0] for r in relays]
                    assert sum(s.manifests_raced for s in stats) >= 1  # the conditional put decided
                    assert sum(s.objects_skipped for s in stats) >= 1  # the loser found the winner's objects
                for v in await committed(s1, k1):
                    assert await s1.read(f"{k1}v{v}/MANIFEST") == await pstore.read(f"{pkey}v{v}/MANIFEST")
                assert await assert_no_partial_version(s1, k1)
                replica = zeros_like(w)
                assert await Subscriber(k1, store=s1).pull(replica) == 5
                assert_same(models[5], replica)

    anyio.run(main)


def test_corrupt_parent_object_not_propagated_then_retried(regions) -> None:
    trainer, child = regions("trainer", proxy=False), regions("child")

    async def main() -> None:
        pstore, pkey = trainer.open("p/")
        cstore, ckey = child.open("p/")
        w = model(3)
        models = {}
        with anyio.fail_after(60):
            async with pstore, cstore, Publisher(pkey, store=pstore, chunk_bytes=256) as pub:
                for v in range(1, 4):
                    w = step(w, v, frac=0.2)
                    models[v] = snapshot(w)
                    await pub.publish(w)
                bad = [o.key for o in await pstore.list(f"{pkey}v2/chunk-")][1]
                good = await pstore.read(bad)
                await pstore.put(bad, bytes([good[0]]) + good[1:-1] + bytes([good[-1] ^ 0x40]))
                relay = Relay(trainer.prefix("p/"), [child.prefix("p/")], workers=2, poll_interval=0.01,
                              max_backoff=0.05)
                async with relay:
                    report = await relay.sync()
                    assert not report.ok and isinstance(report.errors[0], DigestMismatch)
                    assert bad in str(report.errors[0])
                    assert await committed(cstore, ckey) == [1]  # v2 refused, and v3 waits behind it
                    assert not [o for o in await cstore.list(ckey) if o.key.endswith(bad.rpartition("/")[2])]
                    stats = relay.statistics()
                    assert stats.errors == {"digest": 1} and not stats.healthy
                    assert 'zephon_relay_errors_total{kind="digest"} 1' in prometheus_text(stats)
                    replica = zeros_like(w)
                    sub = Subscriber(ckey, store=cstore)
                    assert await sub.pull(replica) == 1
                    assert_same(models[1], replica)
                    stop = anyio.Event()
                    async with anyio.create_task_group() as tg:  # the daemon retries until the parent heals
                        tg.start_soon(relay.run, stop)
                        await until(lambda: _errors(relay, 2))
                        await pstore.put(bad, good)
                        await until(lambda: _committed_at(cstore, ckey, 3))
                        stop.set()
                    assert relay.statistics().healthy
                    assert await sub.pull(replica) == 3
                    assert_same(models[3], replica)

    anyio.run(main)


def test_a_corrupt_parent_version_is_jumped_by_the_keyframe_after_it(regions) -> None:
    """A version whose object is corrupt at the parent can never be relayed: with a keyframe after it,
    the child restarts there, as past a garbage-collection gap (it waited at the version before
    until the parent collected the corrupt one, while subscribers at the parent went on)."""
    trainer, child = regions("trainer", proxy=False), regions("child")

    async def main() -> None:
        pstore, pkey = trainer.open("p/")
        cstore, ckey = child.open("p/")
        w, models = model(4), {}
        with anyio.fail_after(60):
            async with pstore, cstore, Publisher(pkey, store=pstore, chunk_bytes=256, keyframe_every=3) as pub:
                for v in range(1, 6):  # v1 and v4 are keyframes
                    w = step(w, v, frac=0.2)
                    models[v] = snapshot(w)
                    await pub.publish(w)
                bad = [o.key for o in await pstore.list(f"{pkey}v5/chunk-")][0]
                good = await pstore.read(bad)
                await pstore.put(bad, good[:-1] + bytes([good[-1] ^ 0x01]))
                relay = Relay(trainer.prefix("p/"), [child.prefix("p/")], workers=2, poll_interval=0.01)
                async with relay:
                    report = await relay.sync()
                    assert not report.ok and isinstance(report.errors[0], DigestMismatch)
                    assert await committed(cstore, ckey) == [1, 2, 3, 4]
                    assert (await relay.sync()).ok is False  # no keyframe after it yet: it waits
                    for v in range(6, 8):  # v7 is a keyframe
                        w = step(w, v, frac=0.2)
                        models[v] = snapshot(w)
                        await pub.publish(w)
                    report = await relay.sync()
                    assert report.ok, report.errors
                    assert await committed(cstore, ckey) == [1, 2, 3, 4, 7]
                # a relay run once (`zephon relay --once`, from cron) is a fresh process: one sync does it
                cstore2, ckey2 = child.open("q/")
                async with cstore2, Relay(trainer.prefix("p/"), [child.prefix("q/")], workers=2) as once:
                    report = await once.sync()
                assert isinstance(report.errors[0], DigestMismatch) and len(report.errors) == 1
                assert report.committed[child.prefix("q/").name] == [1, 2, 3, 4, 7]
                replica = zeros_like(w)
                assert await Subscriber(ckey, store=cstore).pull(replica) == 7
                assert_same(models[7], replica)

    anyio.run(main)


async def _errors(relay: Relay, n: int) -> bool:
    return relay.statistics().errors.get("digest", 0) >= n


async def _committed_at(store: Store, prefix: str, v: int) -> bool:
    return v in await committed(store, prefix)


def test_parent_reads_once_whatever_the_number_of_children(regions, seaweed) -> None:
    """Bytes read from the parent per version (counted by the parent's proxy) equal the
    version's objects once, for one child and for three."""
    trainer = regions("trainer")  # behind a proxy that counts what the relay reads
    direct = Region("direct", trainer.bucket, seaweed.store_options(), None)  # the publisher's way in: uncounted
    assert trainer.proxy is not None

    async def main() -> None:
        pstore, pkey = direct.open("p/")
        w = model(4)
        sizes = {}
        with anyio.fail_after(60):
            async with pstore, Publisher(pkey, store=pstore, chunk_bytes=256, overwrite=True) as pub:
                for v in (1, 2, 3):
                    w = step(w, v, frac=0.2)
                    info = await pub.publish(w)
                    sizes[v] = info.delta_bytes + info.key_bytes + info.over_bytes
            for n in (1, 3):
                trainer.proxy.reset_statistics()
                children = [regions(f"c{n}{i}") for i in range(n)]
                async with Relay(trainer.prefix("p/"), [c.prefix("p/") for c in children], workers=4) as relay:
                    assert (await relay.sync()).ok
                    assert relay.statistics().bytes_read == sum(sizes.values())
                records = trainer.proxy.statistics().records
                for v, size in sizes.items():
                    got = sum(r.body_bytes for r in records if r.method == "GET" and f"/v{v}/" in r.path
                              and not r.path.endswith("/MANIFEST"))
                    assert got == size, (n, v, got, size)

    anyio.run(main)


def test_child_bucket_on_the_parent_endpoint_is_copied_server_side(regions) -> None:
    """Another bucket on the same endpoint with the same credentials: CopyObject, no uploads."""
    trainer, other = regions("trainer", proxy=False), regions("other", proxy=False)

    async def main() -> None:
        pstore, pkey = trainer.open("policy/")
        w = model(2, {"w": ((64, 96), torch.bfloat16)})
        relay = Relay(trainer.prefix("policy/"), [other.prefix("copy/")], workers=4)
        replica = zeros_like(w)
        with anyio.fail_after(60):
            async with pstore, Publisher(pkey, store=pstore, chunk_bytes=CHUNK) as pub, relay:
                for v in range(1, 4):
                    w = step(w, v, frac=0.1)
                    await pub.publish(w)
                    assert (await relay.sync()).ok
                store, key = other.open("copy/")
                async with store:
                    assert await Subscriber(key, store=store).pull(replica) == 3
        assert_same(w, replica)
        c = relay.statistics().children[0]
        assert c.server_side_copies > 0 and c.bytes_written == 0 and c.versions_relayed == 3

    anyio.run(main)
