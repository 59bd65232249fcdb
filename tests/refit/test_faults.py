"""Faults on a real S3 server (SeaweedFS) and on the memory store: each refused before anything
is applied, with an error that names what was wrong."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest

from tests.refit._helpers import assert_same, model, step, zeros_like
from zephon_stream import BaseVersionMismatch, DataError, DigestMismatch, ObjectNotFound
from zephon_stream.connectors import MemoryStore, open_store
from zephon_stream.connectors.base import Store
from zephon_stream.refit import Publisher, Subscriber
from zephon_stream.refit.manifest import Manifest, encode_manifest

BACKENDS = ["memory", pytest.param("seaweed", marks=pytest.mark.s3)]


@pytest.fixture(params=BACKENDS)
def make_store(request: pytest.FixtureRequest) -> Callable[[], object]:
    if request.param == "memory":
        return lambda: _memory()
    target = request.getfixturevalue("s3")
    return lambda: _s3(target)


@asynccontextmanager
async def _memory() -> AsyncIterator[tuple[Store, str]]:
    yield MemoryStore(), "m/"


@asynccontextmanager
async def _s3(target) -> AsyncIterator[tuple[Store, str]]:
    store, prefix = open_store(target.uri, **target.options)
    async with store:
        yield store, prefix + "refit/"


async def _key(store: Store, prefix: str, what: str) -> str:
    keys = [o.key for o in await store.list(f"{prefix}v2/{what}-")]
    assert keys, f"no {what} objects in v2"
    return keys[0]


async def _setup(store: Store, prefix: str, *, overwrite: bool = False):
    v1 = model(11)
    v2 = step(v1, 12, frac=0.2)
    replica = zeros_like(v1)
    sub = Subscriber(prefix, store=store)
    async with Publisher(prefix, store=store, chunk_bytes=512, keyframe_every=100, overwrite=overwrite) as pub:
        await pub.publish(v1)
        assert await sub.pull(replica) == 1
        await pub.publish(v2)
    return v1, v2, replica, sub


def go(make_store, body) -> None:
    async def main() -> None:
        with anyio.fail_after(60):
            async with make_store() as (store, prefix):
                await body(store, prefix)

    anyio.run(main)


def _refused(v1, replica, sub) -> None:
    assert_same(v1, replica)  # nothing applied
    assert sub.version == 1 and sub.record.target is None


def test_flipped_byte_in_chunk_refused(make_store) -> None:
    async def body(store: Store, prefix: str) -> None:
        v1, _, replica, sub = await _setup(store, prefix)
        key = await _key(store, prefix, "chunk")
        data = bytearray(await store.read(key))
        data[len(data) // 2] ^= 0x01
        await store.put(key, bytes(data))
        with pytest.raises(DigestMismatch, match="corrupt object") as exc:
            await sub.pull(replica)
        assert "nothing was applied" in "".join(exc.value.__notes__)
        _refused(v1, replica, sub)

    go(make_store, body)


def test_flipped_byte_falls_back_to_overwrite(make_store) -> None:
    async def body(store: Store, prefix: str) -> None:
        _, v2, replica, sub = await _setup(store, prefix, overwrite=True)
        key = await _key(store, prefix, "chunk")
        data = bytearray(await store.read(key))
        data[-1] ^= 0x80
        await store.put(key, bytes(data))
        assert await sub.pull(replica) == 2
        assert_same(v2, replica)

    go(make_store, body)


def test_missing_chunk_refused(make_store) -> None:
    async def body(store: Store, prefix: str) -> None:
        v1, _, replica, sub = await _setup(store, prefix)
        await store.delete(await _key(store, prefix, "chunk"))
        with pytest.raises(ObjectNotFound):
            await sub.pull(replica)
        _refused(v1, replica, sub)

    go(make_store, body)


def test_truncated_object_refused(make_store) -> None:
    async def body(store: Store, prefix: str) -> None:
        v1, _, replica, sub = await _setup(store, prefix)
        key = await _key(store, prefix, "chunk")
        data = await store.read(key)
        await store.put(key, data[: len(data) - 7])
        with pytest.raises(DataError, match="truncated"):
            await sub.pull(replica)
        _refused(v1, replica, sub)

    go(make_store, body)


def test_manifest_for_wrong_base_refused(make_store) -> None:
    async def body(store: Store, prefix: str) -> None:
        v1, v2, replica, sub = await _setup(store, prefix)
        fork = f"{prefix}fork/"
        async with Publisher(fork, store=store, chunk_bytes=512, keyframe_every=100) as pub:
            await pub.publish(v1)
            await pub.publish(step(v1, 99))  # another v2
            await pub.publish(step(v2, 13))  # v3 on top of the other v2
        for o in await store.list(f"{fork}v3/"):
            await store.put(prefix + o.key[len(fork):], await store.read(o.key))
        with pytest.raises(BaseVersionMismatch, match="delta from a model with digest"):
            await sub.pull(replica)
        _refused(v1, replica, sub)

    go(make_store, body)


@pytest.mark.parametrize("evil", ["huge size", "negative offset", "huge tensor", "bad attempt", "garbage"])
def test_hostile_manifest_refused(make_store, evil: str) -> None:
    async def body(store: Store, prefix: str) -> None:
        v1, _, replica, sub = await _setup(store, prefix)
        key = f"{prefix}v2/MANIFEST"
        m = msgspec.msgpack.decode(await store.read(key), type=Manifest)
        c = m.chunks[0]
        if evil == "huge size":
            m = msgspec.structs.replace(m, chunks=[msgspec.structs.replace(c, size=1 << 40), *m.chunks[1:]])
        elif evil == "negative offset":
            raw = msgspec.to_builtins(m)
            raw["chunks"][0][1] = -4096
            data = msgspec.msgpack.encode(raw)
        elif evil == "huge tensor":
            t = m.table[0]
            m = msgspec.structs.replace(m, table=[msgspec.structs.replace(t, shape=(1 << 40, 1 << 40)), *m.table[1:]])
        elif evil == "bad attempt":
            m = msgspec.structs.replace(m, attempt="../../etc")
        if evil == "garbage":
            data = b"\x93\xff\x00" * 10
        elif evil != "negative offset":
            data = encode_manifest(m)
        await store.delete(key)
        await store.put(key, data)
        with pytest.raises(DataError, match="manifest"):
            await sub.pull(replica)
        _refused(v1, replica, sub)

    go(make_store, body)


class Killed(Exception):
    """Stands for the process dying at this point."""


class KillingStore:
    """Delegates to a real store and dies on its n-th put."""

    def __init__(self, inner: Store, after: int) -> None:
        self.inner, self.after = inner, after

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        self.after -= 1
        if self.after == 0:
            raise Killed(f"killed while writing {key}")
        await self.inner.put(key, data, if_none_match=if_none_match)


@pytest.mark.parametrize("after", [1, 4])
def test_publisher_killed_mid_version_never_visible(make_store, after: int) -> None:
    async def body(store: Store, prefix: str) -> None:
        v1, v2, replica, sub = await _setup(store, prefix)
        v3 = step(v2, 77, frac=0.2)
        with pytest.raises(Killed):
            async with Publisher(prefix, store=KillingStore(store, after), chunk_bytes=512) as pub:
                await pub.publish(v3)
        assert await sub.pull(replica) == 2  # v3 does not exist
        assert_same(v2, replica)
        async with Publisher(prefix, store=store, chunk_bytes=512) as pub:
            assert (await pub.publish(v3)).version == 3
        assert await sub.pull(replica) == 3
        assert_same(v3, replica)

    go(make_store, body)


def test_subscriber_killed_mid_apply_recovers(make_store, monkeypatch, tmp_path) -> None:
    from zephon_stream.refit import subscriber as subscriber_mod

    real = subscriber_mod._Pull._write

    def torn(self, i, route, decoded):
        base, pos, val = decoded
        if i == 1 and base is None and len(pos) > 1:
            real(self, i, route, (None, pos[: len(pos) // 2], val[: len(pos) // 2]))
            raise Killed("killed mid-apply")
        real(self, i, route, decoded)

    async def body(store: Store, prefix: str) -> None:
        v1 = model(11)
        v2 = step(v1, 12, frac=0.3)
        replica = zeros_like(v1)
        async with Publisher(prefix, store=store, chunk_bytes=512) as pub:
            await pub.publish(v1)
            await Subscriber(prefix, store=store, record=tmp_path / "rec").pull(replica)
            await pub.publish(v2)
        monkeypatch.setattr(subscriber_mod._Pull, "_write", torn)
        with pytest.raises(Killed):
            await Subscriber(prefix, store=store, record=tmp_path / "rec").pull(replica)
        monkeypatch.setattr(subscriber_mod._Pull, "_write", real)
        assert Subscriber(prefix, store=store, record=tmp_path / "rec").record.target == 2  # torn, and it knows
        assert await Subscriber(prefix, store=store, record=tmp_path / "rec").pull(replica) == 2
        assert_same(v2, replica)

    go(make_store, body)


async def _run_twice(store: Store, prefix: str, seeds: tuple[int, int], versions: tuple[int, int], **options):
    """Two trainer runs on one prefix, the second after the prefix was wiped: their models."""
    runs = []
    for seed, n in zip(seeds, versions):
        for info in await store.list(prefix):
            await store.delete(info.key)
        state, states = model(seed), []
        async with Publisher(prefix, store=store, **options) as pub:
            for v in range(n):
                state = step(state, seed * 100 + v) if v else state
                await pub.publish(state)
                states.append({k: t.clone() for k, t in state.items()})
        runs.append(states)
        yield runs


@pytest.mark.parametrize("fresh", [False, True])
def test_a_prefix_started_again_is_pulled_not_taken_for_the_old_run(make_store, tmp_path, caplog, fresh):
    """The trainer starts again on a wiped prefix: its version N is another model than the one a
    subscriber pulled as N. The pull said it had the version (same number) and kept the old
    weights, then refused every delta until a keyframe. `fresh`: a new Subscriber with the record
    file (as `zephon refit pull` is); else the same one, whose manifests were read before."""

    async def go():
        async with make_store() as (store, prefix):
            replica = zeros_like(model(1))
            sub = Subscriber(prefix, store=store, record=tmp_path / "rec")
            async for runs in _run_twice(store, prefix, (1, 2), (3, 3)):
                if len(runs) == 1:
                    assert await sub.pull(replica) == 3
                    assert_same(replica, runs[0][-1])
            if fresh:
                sub = Subscriber(prefix, store=store, record=tmp_path / "rec")
            with caplog.at_level("WARNING", logger="zephon_stream.refit.subscriber"):
                assert await sub.pull(replica) == 3
            assert_same(replica, runs[1][-1])
            assert any("was started again" in r.getMessage() for r in caplog.records), caplog.records
            async with Publisher(prefix, store=store) as pub:  # and the deltas after it apply
                nxt = step(runs[1][-1], 999)
                await pub.publish(nxt)
            assert await sub.pull(replica) == 4
            assert_same(replica, nxt)

    anyio.run(go)


@pytest.mark.parametrize("fresh", [False, True])
def test_a_prefix_started_again_past_the_version_pulled_is_pulled(make_store, tmp_path, caplog, fresh):
    """The second run has published past the subscriber's version and collected it (keep 4 of 8):
    only the version after it says it is another run's (a delta from another model). Every pull
    was refused ("refusing the chain"), though a keyframe was there (a new-user trial)."""

    async def go():
        async with make_store() as (store, prefix):
            replica = zeros_like(model(1))
            sub = Subscriber(prefix, store=store, record=tmp_path / "rec")
            async for runs in _run_twice(store, prefix, (1, 2), (4, 8), keyframe_every=4, keep_versions=4):
                if len(runs) == 1:
                    assert await sub.pull(replica) == 4
            if fresh:  # else the same one, whose copy of the old version 4 hid the restart (a review)
                sub = Subscriber(prefix, store=store, record=tmp_path / "rec")
            with caplog.at_level("WARNING", logger="zephon_stream.refit.subscriber"):
                assert await sub.pull(replica) == 8
            assert_same(replica, runs[1][-1])
            assert any("was started again (its version 5 is a delta from another model" in r.getMessage()
                       for r in caplog.records), caplog.records

    anyio.run(go)


def test_a_version_collected_during_a_pull_says_to_pull_again() -> None:
    """keep_versions collected the version while a pull read it: a bare ObjectNotFound named a chunk."""
    from zephon_stream.testing.stores import WrappedStore

    class Collecting(WrappedStore):
        armed = False

        async def read(self, key, start=0, end=None):
            if self.armed and "/key-" in key:  # the publisher's retention takes the version mid-pull
                self.armed = False
                for info in await self.inner.list("m/v1/"):
                    await self.inner.delete(info.key)
            return await self.inner.read(key, start, end)

    async def go():
        store = Collecting(MemoryStore())
        async with Publisher("m/", store=store) as pub:
            await pub.publish(model(9))
        store.armed = True
        with pytest.raises(ObjectNotFound) as err:
            await Subscriber("m/", store=store).pull(zeros_like(model(9)))
        assert "version 1 was collected while this pull read it" in "".join(err.value.__notes__), err.value.__notes__

    anyio.run(go)
