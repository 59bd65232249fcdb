"""A joiner's one-pass keyframe load: decompress into the weights, XOR the deltas, hash once.

Only a state that holds no version takes it (a joiner, or one killed while joining); a state
that holds a version keeps verify-then-write, so a refused pull leaves it as it was."""

from __future__ import annotations

import anyio
import pytest
import torch

from tests.refit._helpers import assert_same, model, step, zeros_like
from zephon_stream.errors import DigestMismatch
from zephon_stream.refit import Publisher, Subscriber, codec
from zephon_stream.refit import subscriber as subscriber_mod

SHAPES = None  # the helpers' default mix of dtypes and sizes


class Killed(Exception):
    pass


async def publish_chain(store, n: int, *, keyframe_every: int, keep_versions: int = 8):
    states = [model(1, SHAPES)]
    async with Publisher("p/", store=store, chunk_bytes=256, keyframe_every=keyframe_every,
                         keep_versions=keep_versions) as pub:
        for v in range(1, n + 1):
            if v > 1:
                states.append(step(states[-1], seed=v, frac=0.3))
            await pub.publish(states[-1])
    return states


def flipped(plane) -> memoryview:
    """A copy of a plane with its first bit flipped (a raw plane is read-only pieces of the object)."""
    data = bytearray(b"".join(plane) if isinstance(plane, tuple) else plane)
    data[0] ^= 1
    return memoryview(data)


def flip_one_bit(monkeypatch) -> list[int]:
    """Make the keyframe decoder write one wrong bit (a decoder bug or bad memory)."""
    real, calls = codec.full_planes, []

    def wrong(data, *, itemsize, words, key):
        planes = real(data, itemsize=itemsize, words=words, key=key)
        calls.append(1)
        if len(calls) == 2:
            planes[0] = flipped(planes[0])
        return planes

    monkeypatch.setattr(codec, "full_planes", wrong)
    return calls


def test_joiner_at_a_delta_version_is_bit_exact(store) -> None:
    async def main() -> None:
        states = await publish_chain(store, 6, keyframe_every=4)  # keyframes 1 and 5, then a delta
        replica = zeros_like(states[-1])
        sub = Subscriber("p/", store=store)
        assert await sub.pull(replica) == 6
        assert_same(states[-1], replica)

    anyio.run(main)


def test_a_wrong_keyframe_chunk_is_refused_and_the_next_pull_repairs_it(store, monkeypatch, tmp_path) -> None:
    async def main() -> None:
        states = await publish_chain(store, 3, keyframe_every=10)
        replica = zeros_like(states[-1])
        calls = flip_one_bit(monkeypatch)
        sub = Subscriber("p/", store=store, record=tmp_path / "rec")
        with pytest.raises(DigestMismatch, match="holds no version"):
            await sub.pull(replica)
        assert len(calls) >= 2
        assert sub.version == 0 and sub.record.target == 3  # it knows the state holds no version
        monkeypatch.undo()
        again = Subscriber("p/", store=store, record=tmp_path / "rec")  # a restart: loads the record
        assert await again.pull(replica) == 3
        assert_same(states[-1], replica)

    anyio.run(main)


def test_a_joiner_killed_mid_load_resumes_bit_exact(store, monkeypatch, tmp_path) -> None:
    async def main() -> None:
        states = await publish_chain(store, 4, keyframe_every=3)
        replica = zeros_like(states[-1])
        real, done = subscriber_mod._Pull._load_key, []

        def killed(self, i, objects):
            if len(done) == 3:
                raise Killed  # stands in for SIGKILL: the apply stops where it is
            real(self, i, objects)
            done.append(i)

        monkeypatch.setattr(subscriber_mod._Pull, "_load_key", killed)
        with pytest.raises(Killed):
            await Subscriber("p/", store=store, record=tmp_path / "rec", workers=1).pull(replica)
        monkeypatch.undo()
        restarted = Subscriber("p/", store=store, record=tmp_path / "rec")
        assert restarted.version == 0 and restarted.record.target == 4
        assert await restarted.pull(replica) == 4
        assert_same(states[-1], replica)

    anyio.run(main)


def test_a_held_version_is_not_overwritten_by_a_keyframe_that_fails(store, monkeypatch) -> None:
    """A subscriber at v1 whose delta chain was collected falls back to the keyframe route; a
    keyframe that does not verify is refused before anything is written."""
    async def main() -> None:
        v1 = model(1, SHAPES)
        replica = zeros_like(v1)
        sub = Subscriber("p/", store=store)
        async with Publisher("p/", store=store, chunk_bytes=256, keyframe_every=3, keep_versions=1) as pub:
            await pub.publish(v1)
            assert await sub.pull(replica) == 1
            state = v1
            for v in range(2, 8):  # v4 and v7 are keyframes; v1's chain to v7 is gone
                state = step(state, seed=v, frac=0.3)
                await pub.publish(state)

        real = codec.full_planes

        def wrong(data, *, itemsize, words, key):
            planes = real(data, itemsize=itemsize, words=words, key=key)
            planes[0] = flipped(planes[0])
            return planes

        monkeypatch.setattr(codec, "full_planes", wrong)
        with pytest.raises(DigestMismatch):
            await sub.pull(replica)
        assert_same(v1, replica)  # nothing written
        assert sub.version == 1 and sub.record.target is None

    anyio.run(main)


@pytest.mark.parametrize(("workers", "staged_bytes", "most"), [(2, 4 * 256, 2), (2, 256 << 20, 4), (1, 0, 1)])
def test_a_joiners_keyframe_chunks_reach_the_workers_in_bounded_batches(store, monkeypatch, workers, staged_bytes,
                                                                       most) -> None:
    """One worker-thread call loads a run of keyframe chunks (the per-chunk hand-off cost was a
    tenth of the pull): every chunk exactly once, a batch's model bytes within staged_bytes per
    worker, and at least 4 batches a worker, so the workers end together."""
    async def main() -> None:
        state = model(1, {"w": ((64, 64), torch.bfloat16)})  # 32 chunks of 256 bytes
        async with Publisher("p/", store=store, chunk_bytes=256) as pub:
            await pub.publish(state)
        real, batches = subscriber_mod._Pull._load_keys, []

        def spy(self, loads):
            batches.append([i for i, _ in loads])
            real(self, loads)

        monkeypatch.setattr(subscriber_mod._Pull, "_load_keys", spy)
        replica = zeros_like(state)
        assert await Subscriber("p/", store=store, workers=workers, staged_bytes=staged_bytes).pull(replica) == 1
        assert_same(state, replica)
        assert sorted(i for b in batches for i in b) == list(range(32))
        assert max(map(len, batches)) == most

    anyio.run(main)
