"""Subscriber.prefetch: phase 1 done before the MANIFEST, used only for the objects it names."""

from __future__ import annotations

import anyio
import pytest
import torch

from tests.refit._helpers import assert_same, model, step, zeros_like
from zephon_stream.connectors import MemoryStore
from zephon_stream.refit import Publisher, Subscriber


class CountingStore(MemoryStore):
    """Counts the reads of delta objects."""

    def __init__(self) -> None:
        super().__init__()
        self.chunk_reads: list[str] = []

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if "/chunk-" in key:
            self.chunk_reads.append(key)
        return await super().read(key, start, end)


def run(fn):
    async def main():
        with anyio.fail_after(60):
            return await fn()

    return anyio.run(main)


def hide_manifest(store: MemoryStore, version: int) -> tuple[str, bytes]:
    """The state of the store while version `version` is being published: chunks, no MANIFEST."""
    key = f"p/v{version}/MANIFEST"
    return key, store.objects.pop(key)


async def v2_in_flight(s1, s2, **publisher):
    """v1 published and pulled by a subscriber; v2's objects written, its MANIFEST held back."""
    store = CountingStore()
    replica = zeros_like(s1)
    async with Publisher("p/", store=store, chunk_bytes=256, **publisher) as pub:
        await pub.publish(s1)
        sub = Subscriber("p/", store=store)
        await sub.pull(replica)
        await pub.publish(s2)
    key, manifest = hide_manifest(store, 2)
    return store, sub, replica, key, manifest


def test_prefetched_version_applies_without_fetching_again() -> None:
    s1 = model(1)
    s2 = step(s1, 2)

    async def go() -> None:
        store = CountingStore()
        replica = zeros_like(s1)
        async with Publisher("p/", store=store, chunk_bytes=256) as pub:
            await pub.publish(s1)
            sub = Subscriber("p/", store=store)
            assert await sub.prefetch(replica) == 0  # nothing to build on yet
            assert await sub.pull(replica) == 1
            await pub.publish(s2)
        key, manifest = hide_manifest(store, 2)
        assert await sub.prefetch(replica) > 0
        assert_same(s1, replica)  # prefetch writes nothing
        store.objects[key] = manifest
        store.chunk_reads.clear()
        assert await sub.pull(replica) == 2
        assert store.chunk_reads == []
        assert_same(s2, replica)
        assert sub._ahead == {}  # results are dropped once applied

    run(go)


def test_objects_of_an_attempt_that_lost_are_not_used() -> None:
    """A publisher dies after its chunks; another publishes other weights as the same version."""
    s1 = model(1)
    dead, live = step(s1, 2), step(s1, 3)

    async def go() -> None:
        store = CountingStore()
        replica = zeros_like(s1)
        async with Publisher("p/", store=store, chunk_bytes=256) as pub:
            await pub.publish(s1)
        sub = Subscriber("p/", store=store)
        await sub.pull(replica)
        async with Publisher("p/", store=store, chunk_bytes=256) as pub:
            await pub.publish(dead)
        hide_manifest(store, 2)
        store.objects.pop("p/LATEST", None)
        assert await sub.prefetch(replica) > 0
        async with Publisher("p/", store=store, chunk_bytes=256) as pub:  # resyncs to v1, publishes v2
            assert (await pub.publish(live)).version == 2
        store.chunk_reads.clear()
        assert await sub.pull(replica) == 2
        assert_same(live, replica)
        assert store.chunk_reads  # fetched what the MANIFEST names

    run(go)


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_object_seen_early_still_fails_verification(damage: str) -> None:
    """Prefetch holds nothing for an object it cannot use; the pull judges it against the MANIFEST."""
    s1 = model(1)
    s2 = step(s1, 2, frac=0.3)

    async def go() -> None:
        store, sub, replica, key, manifest = await v2_in_flight(s1, s2, overwrite=True)
        bad = next(k for k in sorted(store.objects) if k.startswith("p/v2/chunk-"))
        good = store.objects[bad]
        store.objects[bad] = good[:-3] if damage == "truncate" else good[:-1] + bytes([good[-1] ^ 1])
        await sub.prefetch(replica)
        store.objects[bad] = good  # repaired (a relay re-copied it) before the MANIFEST
        store.objects[key] = manifest
        assert await sub.pull(replica) == 2
        assert_same(s2, replica)
        assert bad in store.chunk_reads  # its early copy was not trusted

    run(go)


def test_early_result_from_corrupt_local_values_is_not_used() -> None:
    """Local values at changed positions were already wrong when prefetch read them: the early
    digest change does not add up, so the pull takes the normal path and its fallbacks."""
    s1 = model(1)
    s2 = step(s1, 2, frac=0.3)

    async def go() -> None:
        store, sub, replica, key, manifest = await v2_in_flight(s1, s2, overwrite=True, keyframe_every=100)
        w1 = replica["w1"].view(-1)
        at = int(torch.nonzero(s1["w1"].view(-1).view(torch.int16) != s2["w1"].view(-1).view(torch.int16))[0])
        w1[at] = -w1[at] + 1  # bit rot where the next version changes a value
        assert await sub.prefetch(replica) > 0
        store.objects[key] = manifest
        store.chunk_reads.clear()
        assert await sub.pull(replica) == 2
        assert_same(s2, replica)  # repaired through the overwrite objects, as without prefetch
        assert store.chunk_reads  # the chunk holding `at` was fetched again

    run(go)
