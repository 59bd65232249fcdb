"""Mix: weighted, token-aware interleaving; a pure function of (seed, lane, position, counters)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import IncompatibleState
from zephon_stream.operators.mix import Mix, MixState
from zephon_stream.testing.operators import ListSource, assert_roundtrip


def _docs(source: int, lengths: list[int]) -> list[tuple]:
    return [((source, 0, i * 100, 100), np.arange(n, dtype=np.uint32)) for i, n in enumerate(lengths)]


def _chain(sources: list[list[tuple]], weights: list[float], by_tokens: bool = True):
    ups = [ListSource(s) for s in sources]
    return [*ups, Mix(weights, 7, 3, by_tokens, ups)]


@pytest.mark.parametrize("equal", [False, True])
def test_roundtrip_at_every_point(equal: bool) -> None:
    """With equal weights and lengths every choice is a tie, broken by (seed, lane, position)."""
    if equal:
        sources, weights = [_docs(s, [4] * 5) for s in range(3)], [1.0, 1.0, 1.0]
    else:
        sources, weights = [_docs(0, [5, 9, 2, 7]), _docs(1, [30, 1, 4]), _docs(2, [3] * 5)], [1, 2, 0.5]
    n = anyio.run(lambda: assert_roundtrip(lambda: _chain(sources, weights), resolve=lambda r: None))
    assert n == sum(map(len, sources))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50), min_size=0, max_size=30), min_size=1, max_size=4),
       st.booleans())
def test_every_document_once_and_shares_track_weights(lengths: list[list[int]], by_tokens: bool) -> None:
    sources = [_docs(s, ls) for s, ls in enumerate(lengths)]
    weights = [1.0 + s for s in range(len(sources))]
    mix = _chain(sources, weights, by_tokens)[-1]

    async def drain() -> list[tuple]:
        out = []
        while (d := await mix.next()) is not None:
            out.append(d[0])
        return out

    got = anyio.run(drain)
    assert sorted(got) == sorted(d[0] for s in sources for d in s)  # nothing lost, nothing twice
    for s in range(len(sources)):  # each source's documents in their own order
        assert [r for r in got if r[0] == s] == [d[0] for d in sources[s]]


def test_token_shares_follow_the_weights_within_one_document() -> None:
    sources = [_docs(0, [10] * 200), _docs(1, [10] * 200)]
    mix = _chain(sources, [1.0, 3.0])[-1]

    async def take(n: int) -> None:
        for _ in range(n):
            await mix.next()

    anyio.run(take, 100)
    assert mix.counts[1] == pytest.approx(3 * mix.counts[0], abs=3 * 10)


def test_restore_refuses_a_state_for_other_sources() -> None:
    mix = _chain([_docs(0, [1]), _docs(1, [1])], [1, 1])[-1]
    with pytest.raises(IncompatibleState, match=r"mix.counts = \[0, 0, 0\]: needs one count >= 0 per source \(2 "):
        mix.restore(MixState([0, 0, 0], 0), lambda r: None)
    with pytest.raises(IncompatibleState, match=r"mix.counts = \[0, -1\]"):
        mix.restore(MixState([0, -1], 0), lambda r: None)
