"""Shuffle: a bounded window; the order is a pure function of (seed, lane, pulls)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import IncompatibleState
from zephon_stream.operators.shuffle import Shuffle, ShuffleState
from zephon_stream.testing.operators import ListSource, assert_roundtrip


def _docs(n: int) -> list[tuple]:
    return [((0, i // 10, (i % 10) * 50, 50), np.full(3, i, dtype=np.uint32)) for i in range(n)]


@pytest.mark.parametrize("size", [0, 1, 4, 50])
def test_roundtrip_at_every_point(size: int) -> None:
    docs = _docs(23)
    by_ref = {d[0]: d for d in docs}

    def make():
        src = ListSource(docs)
        return [src, Shuffle(size, 11, 2, src)]

    assert anyio.run(lambda: assert_roundtrip(make, resolve=by_ref.__getitem__)) == 23


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), st.integers(0, 16), st.integers(0, 2**63))
def test_a_permutation_of_the_input_that_moves_documents_at_most_a_window(n: int, size: int, seed: int) -> None:
    docs = _docs(n)
    shuffle = Shuffle(size, seed, 0, ListSource(docs))

    async def drain() -> list[int]:
        out = []
        while (d := await shuffle.next()) is not None:
            out.append(int(d[1][0]))
        return out

    got = anyio.run(drain)
    assert sorted(got) == list(range(n))
    for k, i in enumerate(got):  # document i can only leave once it entered the window
        assert i <= k + max(size, 1) - 1
    if size <= 1:
        assert got == list(range(n))


def test_restore_refuses_a_window_too_big_or_with_a_document_twice() -> None:
    docs = _docs(5)
    by_ref = {d[0]: d for d in docs}
    shuffle = Shuffle(2, 1, 0, ListSource(docs))
    refs = [d[0] for d in docs]
    with pytest.raises(IncompatibleState, match="holds at most the window size 2"):
        shuffle.restore(ShuffleState(refs[:3], 0), by_ref.__getitem__)
    with pytest.raises(IncompatibleState, match="same document twice"):
        shuffle.restore(ShuffleState([refs[0], refs[0]], 0), by_ref.__getitem__)
    with pytest.raises(IncompatibleState, match="shuffle.pulls = -1"):
        shuffle.restore(ShuffleState([], -1), by_ref.__getitem__)
