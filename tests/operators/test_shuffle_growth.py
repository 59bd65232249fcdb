"""Shuffle's growing window: the first pull needs one document, the window grows by one a pull,
the draws are a pure function of (seed, lane, pulls) and the pulled sequence, and a restore in
the middle of the growth (with payloads fetched lazily, in need order) resumes the same stream."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import IncompatibleState
from zephon_stream.engine.rng import mix64
from zephon_stream.operators.shuffle import (
    Deferred,
    Shuffle,
    ShuffleState,
    draw_order,
    window_bound,
    window_target,
)
from zephon_stream.testing.operators import ListSource, assert_roundtrip


def _docs(n: int, salt: int = 0) -> list[tuple]:
    return [((0, i // 10, (i % 10) * 50, 50), np.full(3, i + salt, dtype=np.uint32)) for i in range(n)]


async def _drain(op, limit: int | None = None) -> list:
    out = []
    while (limit is None or len(out) < limit) and (d := await op.next()) is not None:
        out.append(d)
    return out


def _reference(n: int, size: int, seed: int, lane: int, window_before: int = 0, pulls: int = 0) -> list[int]:
    """The indexes (in pull order) of documents 0..n-1 of the upstream, by the rule written out
    plainly: fill to min(size, p + 1), take mix64(seed, lane, p) % len, move the last in its place.
    `window_before` documents `-1, -2, ...` are in the window already, after `pulls` pulls."""
    window, upstream, out, p = [-1 - i for i in range(window_before)], list(range(n)), [], pulls
    while window or upstream:
        while upstream and len(window) < (min(size, p + 1) if size else 1):
            window.append(upstream.pop(0))
        i = mix64(seed, lane, p) % len(window) if size else 0
        out.append(window[i])
        window[i] = window[-1]
        window.pop()
        p += 1
    return out


def test_the_first_pull_needs_one_document_and_the_window_grows_by_one_a_pull() -> None:
    src = ListSource(_docs(100))
    shuffle = Shuffle(8, 5, 1, src)
    read = []
    for p in range(20):
        anyio.run(shuffle.next)
        read.append(src.index)
        assert len(shuffle.window) == window_target(8, p) - 1 <= window_bound(8, shuffle.pulls)
    assert read[:8] == [1, 3, 5, 7, 9, 11, 13, 15]  # two documents a pull while the window grows
    assert read[8:] == list(range(16, 28))  # then one a pull, the window full (8) before each


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 80), st.integers(0, 20), st.integers(0, 2**63), st.integers(0, 40))
def test_the_draws_are_the_written_rule_and_do_not_depend_on_the_documents(n, size, seed, lane) -> None:
    got = [int(d[1][0]) for d in anyio.run(_drain, Shuffle(size, seed, lane, ListSource(_docs(n))))]
    assert got == _reference(n, size, seed, lane)
    other = [int(d[1][0]) - 1000 for d in anyio.run(_drain, Shuffle(size, seed, lane, ListSource(_docs(n, 1000))))]
    assert other == got  # other payloads, the same pulls


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 24), st.integers(0, 2**63), st.integers(0, 60), st.data())
def test_draw_order_names_the_documents_in_the_order_the_pulls_take_them(size, seed, pulls, data) -> None:
    window = data.draw(st.integers(0, window_bound(size, pulls)))
    order = draw_order(size, seed, 3, window, pulls)
    pulled = _reference(40 * size + 50, size, seed, 3, window, pulls)  # an upstream that outlasts the window
    assert sorted(order) == list(range(window))
    assert order == [-1 - x for x in pulled if x < 0]


def test_draw_order_follows_a_bounded_number_of_pulls() -> None:
    full = draw_order(64, 7, 1, 63, 500)
    short = draw_order(64, 7, 1, 63, 500, horizon=20)
    k = sum(1 for x in _reference(100, 64, 7, 1, 63, 500)[:20] if x < 0)  # window documents the 20 pulls take
    assert 0 < k < 63
    assert short[:k] == full[:k]  # those first, in the order they are taken
    assert short[k:] == sorted(set(range(63)) - set(full[:k]))  # then the rest, in window order


@pytest.mark.parametrize("size", [2, 5, 64])
def test_roundtrip_at_every_point_of_the_growth(size: int) -> None:
    docs = _docs(70)
    by_ref = {d[0]: d for d in docs}

    def make():
        src = ListSource(docs)
        return [src, Shuffle(size, 3, 0, src)]

    assert anyio.run(lambda: assert_roundtrip(make, resolve=by_ref.__getitem__)) == 70


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 60), st.integers(1, 16), st.integers(0, 2**63), st.integers(0, 80))
def test_restore_mid_growth_with_lazy_payloads_fetched_in_need_order(n, size, seed, k) -> None:
    docs = _docs(n)
    by_ref = {d[0]: d for d in docs}
    whole = [d[0] for d in anyio.run(_drain, Shuffle(size, seed, 2, ListSource(docs)))]

    first_src = ListSource(docs)
    first = Shuffle(size, seed, 2, first_src)
    head = [d[0] for d in anyio.run(_drain, first, k)]
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(first.state()), type=ShuffleState)
    fetched: list = []
    ended: list = []  # whether the upstream had ended at each fetch

    async def fetch(ref):
        fetched.append(ref)
        ended.append(again._upstream_done)
        return by_ref[ref][1]

    src = ListSource(docs)
    src.restore(first_src.state(), by_ref.__getitem__)
    again = Shuffle(size, seed, 2, src)
    need = again.refs(state)
    again.restore(state, lambda ref: (ref, Deferred(fetch)))
    rest = anyio.run(_drain, again)
    assert head + [d[0] for d in rest] == whole
    assert all(not isinstance(d[1], Deferred) for d in rest)
    assert sorted(fetched) == sorted(need) == sorted(tuple(r) for r in state.window)
    if not any(ended):  # the upstream went on while the window's documents were taken: the named order
        assert fetched == need


def test_a_failed_fetch_leaves_the_document_in_the_window() -> None:
    docs = _docs(30)
    by_ref = {d[0]: d for d in docs}
    whole = [d[0] for d in anyio.run(_drain, Shuffle(4, 9, 0, ListSource(docs)))]
    first_src = ListSource(docs)
    first = Shuffle(4, 9, 0, first_src)
    anyio.run(_drain, first, 10)
    calls = []

    async def fetch(ref):
        calls.append(ref)
        if len(calls) == 1:
            raise OSError("read failed")
        return by_ref[ref][1]

    src = ListSource(docs)
    src.restore(first_src.state(), by_ref.__getitem__)
    again = Shuffle(4, 9, 0, src)
    again.restore(first.state(), lambda ref: (ref, Deferred(fetch)))
    with pytest.raises(OSError):
        anyio.run(again.next)
    assert [d[0] for d in anyio.run(_drain, again)] == whole[10:]
    assert calls[1] == calls[0] == whole[10]


def _old_rule(docs, size, seed, lane, pulls_until):
    """The state after `pulls_until` pulls of a window that fills whole before every pull (before windows grew)."""
    src = ListSource(docs)
    window, p = [], 0
    while p < pulls_until:
        while len(window) < size and src.index < len(docs):
            window.append(anyio.run(src.next))
        i = mix64(seed, lane, p) % len(window)
        window[i] = window[-1]
        window.pop()
        p += 1
    return ShuffleState([d[0] for d in window], p), src


@pytest.mark.parametrize("pulls", [1, 5, 7])
def test_an_old_state_within_its_first_size_pulls_is_refused(pulls: int) -> None:
    docs = _docs(50)
    state, _ = _old_rule(docs, 8, 4, 0, pulls)
    with pytest.raises(IncompatibleState, match=r"grows by one document a pull up to 8.*resume it with that version"):
        Shuffle(8, 4, 0, ListSource(docs)).restore(state, {d[0]: d for d in docs}.__getitem__)


@pytest.mark.parametrize("pulls", [8, 9, 30])
def test_an_old_state_past_its_first_size_pulls_resumes_as_before(pulls: int) -> None:
    docs = _docs(50)
    by_ref = {d[0]: d for d in docs}
    state, src = _old_rule(docs, 8, 4, 0, pulls)
    start = src.index
    # from pull `size - 1` on the old rule and the new one fill the window alike: the old stream goes on
    old_rest = [int(by_ref[tuple(state.window[-1 - x])][1][0]) if x < 0 else start + x
                for x in _reference(50 - start, 8, 4, 0, len(state.window), pulls)]
    shuffle = Shuffle(8, 4, 0, src)
    shuffle.restore(state, by_ref.__getitem__)
    assert [int(d[1][0]) for d in anyio.run(_drain, shuffle)] == old_rest
