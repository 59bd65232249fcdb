"""Publisher -> store -> subscriber: bit-exact after every version, across dtypes, chains,
keyframes, compaction, garbage collection, shardings, conflicts and crashes."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.refit._helpers import DTYPES, assert_same, from_bytes, model, step, zeros_like
from zephon_stream import AlreadyExists
from zephon_stream.connectors import MemoryStore
from zephon_stream.refit import Publisher, Sharding, Subscriber, VersionConflict
from zephon_stream.refit import subscriber as subscriber_mod
from zephon_stream.refit.versions import find_latest, list_versions


def run(fn, *args):
    async def main():
        with anyio.fail_after(60):
            return await fn(*args)

    return anyio.run(main)


@st.composite
def versions(draw: st.DrawFn) -> list[dict[str, torch.Tensor]]:
    """A few tensors of any supported dtype with arbitrary bit patterns, then 1-3 sparse edits."""
    specs = draw(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 40)), min_size=1, max_size=4))
    first = {}
    for i, (dtype, n) in enumerate(specs):
        data = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        first[f"t{i}"] = from_bytes(data, dtype, (n,))
    out = [first]
    for _ in range(draw(st.integers(1, 3))):
        nxt = {}
        for k, t in out[-1].items():
            b = bytearray(t.view(torch.uint8).numpy().tobytes()) if t.dtype != torch.bool else None
            if b is None:
                nxt[k] = t ^ torch.tensor(draw(st.lists(st.booleans(), min_size=t.numel(), max_size=t.numel())))
                continue
            for j in draw(st.lists(st.integers(0, len(b) - 1), max_size=6)):
                b[j] = draw(st.integers(0, 255))
            nxt[k] = from_bytes(bytes(b), t.dtype, tuple(t.shape))
        out.append(nxt)
    return out


@given(versions(), st.sampled_from([8, 24, 64]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_bit_exact_every_dtype_and_bit_pattern(vs: list[dict[str, torch.Tensor]], chunk_bytes: int) -> None:
    async def go() -> None:
        store = MemoryStore()
        replica = zeros_like(vs[0])
        async with Publisher("m/", store=store, chunk_bytes=chunk_bytes) as pub, Subscriber("m/", store=store) as sub:
            for n, state in enumerate(vs, 1):
                assert (await pub.publish(state)).version == n
                assert await sub.pull(replica) == n
                assert_same(state, replica)

    run(go)


def test_signed_zero_and_nan_payload_reach_subscriber(store: MemoryStore) -> None:
    a = {"x": torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)}
    b = {"x": a["x"].clone()}
    b["x"].view(torch.int16)[0] = -32768  # -0.0
    b["x"].view(torch.int16)[1] += 1  # another NaN payload

    async def go() -> None:
        replica = zeros_like(a)
        async with Publisher("z/", store=store) as pub, Subscriber("z/", store=store) as sub:
            await pub.publish(a)
            await sub.pull(replica)
            info = await pub.publish(b)
            assert info.changes == 2
            await sub.pull(replica)
        assert_same(b, replica)

    run(go)


def test_chain_of_20_with_keyframes_compaction_gc_and_joiners(store: MemoryStore) -> None:
    async def go() -> None:
        states = [model(0)]
        for s in range(1, 20):
            states.append(step(states[-1], s))
        follower, lagger = zeros_like(states[0]), zeros_like(states[0])
        lag_sub = Subscriber("c/", store=store)
        async with Publisher("c/", store=store, keyframe_every=5, keep_versions=3, chunk_bytes=256) as pub:
            async with Subscriber("c/", store=store) as sub:
                for v, state in enumerate(states, 1):
                    info = await pub.publish(state)
                    assert info.keyframe == ((v - 1) % 5 == 0)
                    assert await sub.pull(follower) == v
                    assert_same(state, follower)
                    if v in (2, 4, 9):  # a lagging subscriber composes the deltas it missed
                        assert await lag_sub.pull(lagger) == v
                        assert_same(state, lagger)
                kept = await list_versions(store, "c/")
                assert kept == list(range(16, 21))  # last 3 and the newest keyframe (16) onward
                # the lagger fell behind past GC (it holds 9): it starts from keyframe 16
                assert await lag_sub.pull(lagger) == 20
                assert_same(states[-1], lagger)
                joiner = zeros_like(states[0])
                assert await Subscriber("c/", store=store).pull(joiner) == 20
                assert_same(states[-1], joiner)

    run(go)


ROW = {"w1": 0, "w2": 0, "emb": 0}
COL = {"w1": 1, "w2": 1, "emb": 1}


def shard(state: dict[str, torch.Tensor], sharding: Sharding) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in state.items():
        dim = sharding.dims.get(k)
        out[k] = t.clone() if dim is None else t.chunk(sharding.world_size, dim)[sharding.rank].contiguous()
    return out


@pytest.mark.parametrize(("pub_dims", "sub_dims", "pubs", "subs"), [
    (ROW, ROW, 4, 2), (COL, COL, 4, 2), (ROW, COL, 4, 2), (COL, ROW, 2, 4), (COL, {}, 4, 1), ({}, ROW, 1, 4),
])
def test_sharded_publishers_to_other_sharded_subscribers(store: MemoryStore, pub_dims, sub_dims, pubs, subs) -> None:
    states = [model(1)]
    for s in range(1, 5):
        states.append(step(states[-1], 100 + s, frac=0.1))
    pub_sh = [Sharding(r, pubs, pub_dims) for r in range(pubs)]
    sub_sh = [Sharding(r, subs, sub_dims) for r in range(subs)]

    async def go() -> None:
        pubs_ = [Publisher("s/", store=store, sharding=sh, session="ab12cd34", chunk_bytes=128, keyframe_every=3)
                 for sh in pub_sh]
        subs_ = [Subscriber("s/", store=store, sharding=sh) for sh in sub_sh]
        replicas = [zeros_like(shard(states[0], sh)) for sh in sub_sh]
        for v, state in enumerate(states, 1):
            for p in pubs_:
                p.session = f"ab12cd{v:02d}"
            infos = []
            async with anyio.create_task_group() as tg:
                for p, sh in zip(pubs_, pub_sh):
                    async def one(p=p, sh=sh, infos=infos, state=state) -> None:
                        infos.append(await p.publish(shard(state, sh)))
                    tg.start_soon(one)
            assert {i.version for i in infos} == {v} and any(i.committed for i in infos)
            for s, sh, rep in zip(subs_, sub_sh, replicas):
                assert await s.pull(rep) == v
                assert_same(shard(state, sh), rep)

    run(go)


class BarrierStore(MemoryStore):
    """Holds the first MANIFEST put of `version` until a second one arrives: a true race."""

    def __init__(self, version: int) -> None:
        super().__init__()
        self.key, self.arrived, self.both = f"x/v{version}/MANIFEST", 0, anyio.Event()

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        if key == self.key:
            self.arrived += 1
            if self.arrived == 2:
                self.both.set()
            await self.both.wait()
        await super().put(key, data, if_none_match=if_none_match)


def test_second_publisher_of_same_version_fails_cleanly() -> None:
    a = model(2)
    b, c = step(a, 7), step(a, 9)
    store = BarrierStore(version=3)

    async def go() -> None:
        results: dict[str, object] = {}
        async with Publisher("x/", store=store) as p1, Publisher("x/", store=store) as p2:
            await p1.publish(a)
            await p2.publish(a)  # p2 resyncs from v1 and publishes v2 = a again

            async def one(name: str, pub: Publisher, state: dict[str, torch.Tensor]) -> None:
                try:
                    results[name] = (await pub.publish(state)).version
                except VersionConflict as exc:
                    results[name] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "p1", p1, b)
                tg.start_soon(one, "p2", p2, c)
        winners = [k for k, r in results.items() if r == 3]
        losers = [r for r in results.values() if isinstance(r, VersionConflict)]
        assert len(winners) == 1 and len(losers) == 1
        assert "committed by another publisher" in str(losers[0])
        replica = zeros_like(a)
        assert await Subscriber("x/", store=store).pull(replica) == 3
        assert_same(b if winners == ["p1"] else c, replica)  # the loser's objects are never read

    run(go)


class Killed(Exception):
    """Stands for the process dying at this point."""


class FailingStore(MemoryStore):
    """Raises on the n-th put: a publisher killed mid-version."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.puts = 0

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        self.puts += 1
        if self.puts == self.fail_at:
            raise Killed(f"killed while writing {key}")
        await super().put(key, data, if_none_match=if_none_match)


@pytest.mark.parametrize("fail_after", [1, 3, 6])
def test_publisher_killed_mid_version_leaves_no_version(fail_after: int) -> None:
    s1, s2 = model(3), step(model(3), 4)

    async def go() -> None:
        store = FailingStore(fail_at=10**9)
        async with Publisher("k/", store=store, chunk_bytes=256) as pub:
            await pub.publish(s1)
        store.fail_at = store.puts + fail_after
        with pytest.raises(Killed):
            async with Publisher("k/", store=store, chunk_bytes=256) as pub:
                await pub.publish(s2)
        assert await find_latest(store, "k/") == 1
        replica = zeros_like(s1)
        assert await Subscriber("k/", store=store).pull(replica) == 1
        assert_same(s1, replica)
        async with Publisher("k/", store=store, chunk_bytes=256) as pub:  # a restarted publisher resyncs
            assert (await pub.publish(s2)).version == 2
        assert await Subscriber("k/", store=store).pull(replica) == 2
        assert_same(s2, replica)

    run(go)


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kill_at", [0, 2, 5])
def test_subscriber_killed_mid_apply_recovers_bit_exact(tmp_path, monkeypatch, overwrite: bool, kill_at: int) -> None:
    states = [model(5)]
    for s in range(1, 4):
        states.append(step(states[-1], 50 + s, frac=0.3))
    record = tmp_path / "record"

    async def go() -> None:
        store = MemoryStore()
        replica = zeros_like(states[0])
        async with Publisher("t/", store=store, chunk_bytes=128, overwrite=overwrite, keyframe_every=100) as pub:
            await pub.publish(states[0])
            await Subscriber("t/", store=store, record=record).pull(replica)
            await pub.publish(states[1])
            await pub.publish(states[2])
        calls = 0
        real = subscriber_mod._Pull._write

        def torn(self, i, route, decoded):
            nonlocal calls
            calls += 1
            if calls > kill_at:
                base, pos, val = decoded
                if base is None and len(pos) > 1:  # half a chunk written, then the process dies
                    half = len(pos) // 2
                    real(self, i, route, (None, pos[:half], val[:half]))
                raise Killed("killed mid-apply")
            real(self, i, route, decoded)

        monkeypatch.setattr(subscriber_mod._Pull, "_write", torn)
        with pytest.raises(Killed):
            await Subscriber("t/", store=store, record=record).pull(replica)
        monkeypatch.setattr(subscriber_mod._Pull, "_write", real)
        sub = Subscriber("t/", store=store, record=record)
        assert sub.record.target == 3
        assert await sub.pull(replica) == 3
        assert_same(states[2], replica)
        assert sub.record.target is None

    run(go)


def test_conditional_put_guards_manifest(store: MemoryStore) -> None:
    async def go() -> None:
        async with Publisher("g/", store=store) as pub:
            await pub.publish(model(0))
        with pytest.raises(AlreadyExists):
            await store.put("g/v1/MANIFEST", b"x", if_none_match=True)

    run(go)


def test_two_pulls_of_one_subscriber_at_once_take_turns(tmp_path) -> None:
    # two tasks pulling into one subscriber at once: one failed with a bare KeyError (the other's
    # version tag), 7 times in 30 versions in a trial; each pull now waits for the one in progress
    async def go() -> None:
        w = model(3)
        replica = zeros_like(w)
        uri = f"file://{tmp_path}/c/"  # a local folder: its reads run in threads, so the pulls interleave
        async with Publisher(uri, chunk_bytes=256, keyframe_every=4) as pub, Subscriber(uri) as sub:
            for v in range(1, 13):
                w = step(w, v, frac=0.3)
                await pub.publish(w)
                got: list[int] = []

                async def one(got: list[int] = got) -> None:
                    got.append(await sub.pull(replica))

                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(one)
                assert got == [v, v, v]
                assert_same(w, replica)
                assert sub.version == v

    run(go)
