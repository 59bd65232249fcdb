"""Scheduling for the first batch that changes no output: a lean feed reads nothing ahead
(`Feed.lean`), and a restored window fetches the document a pull takes while it fills for it
(`Shuffle._fill`)."""

from __future__ import annotations

import anyio
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream.engine.rng import mix64
from zephon_stream.operators.feed import Feed
from zephon_stream.operators.shuffle import Deferred, Shuffle, window_target
from zephon_stream.testing.operators import ListSource


def _docs(n: int) -> list[tuple]:
    return [((0, 0, 10 * i, 10), np.full(2, i, dtype=np.uint32)) for i in range(n)]


def test_a_lean_feed_makes_a_document_only_while_the_lane_waits_for_one() -> None:
    docs = _docs(120)
    lean = [True]
    seen: list[tuple[int, int, int, bool]] = []  # (documents sent, taken, the room given, lean then)

    async def produce(position: int, offset: int, piece: int, send) -> None:
        async with send:
            i = 0
            while i < len(docs):
                n = await send.room(8)
                seen.append((i, feed.taken, n, lean[0]))
                await send.send(docs[i:i + n])
                i += n

    async def main() -> list:
        out = []
        async with anyio.create_task_group() as tg:
            with feed.start(tg.start_soon), anyio.fail_after(10):
                while (doc := await feed.next()) is not None:
                    out.append(doc[0])
                    lean[0] = len(out) < 30
                    await anyio.wait_all_tasks_blocked()  # the producer does all it may now
        return out

    feed = Feed(produce, buffer=3)
    feed.lean(lambda: lean[0])
    assert anyio.run(main) == [d[0] for d in docs]
    while_lean = [s for s in seen if s[3]]
    assert len(while_lean) == 30
    assert all(n == 1 and sent == taken for sent, taken, n, _ in while_lean), while_lean[:5]
    assert max(n for *_, n, was_lean in seen if not was_lean) == 8  # then it reads ahead as before


class _Upstream:
    """Documents from `docs` on; each `next` waits for `gate` first (when given)."""

    def __init__(self, docs: list, gate: anyio.Event | None = None) -> None:
        self.docs, self.gate = list(docs), gate

    async def next(self):
        if self.gate is not None:
            await self.gate.wait()
        return self.docs.pop(0) if self.docs else None


def _restored(size: int, seed: int, pulls: int, docs: list, deferred: bool, gate: anyio.Event | None = None,
              fetched: list | None = None) -> Shuffle:
    """A Shuffle run for `pulls` pulls over `docs`, then restored into a new one over the rest:
    with every window document `Deferred` (set `gate` when fetched), or resolved at once."""
    first = Shuffle(size, seed, 3, ListSource(docs))
    for _ in range(pulls):
        anyio.run(first.next)
    state = first.state()
    by_ref = {d[0]: d for d in docs}

    async def fetch(ref):
        if fetched is not None:
            fetched.append(ref)
        if gate is not None:
            gate.set()
        return by_ref[ref][1]

    again = Shuffle(size, seed, 3, _Upstream(docs[pulls + len(state.window):], gate))
    again.restore(state, lambda r: (r, Deferred(fetch)) if deferred else by_ref[r])
    return again


def _drain(shuffle: Shuffle) -> list:
    async def main() -> list:
        out = []
        with anyio.fail_after(10):
            while (doc := await shuffle.next()) is not None:
                out.append((doc[0], int(doc[1][0])))
        return out
    return anyio.run(main)


def test_a_pull_fetches_its_window_document_while_the_window_fills() -> None:
    """The upstream gives nothing until the fetch has started: a pull that fetched only after
    filling would wait forever (fail_after)."""
    size, seed, docs = 16, 7, _docs(60)
    pulls = next(p for p in range(4, 14) if mix64(seed, 3, p) % window_target(size, p) < p - 1)
    gate = anyio.Event()
    shuffle = _restored(size, seed, pulls, docs, True, gate)
    assert _drain(shuffle) == _drain(_restored(size, seed, pulls, docs, False))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 40), size=st.integers(1, 12), pulls=st.integers(0, 40), seed=st.integers(0, 2**63))
def test_a_restored_window_gives_what_an_eager_one_gives_even_where_the_upstream_ends(n, size, pulls, seed) -> None:
    """Where the upstream ends while the window fills, the pull takes another index than the one
    fetched meanwhile: that document stays, fetched, for a later pull. Each fetched once."""
    docs = _docs(n)
    pulls = min(pulls, n)
    fetched: list = []
    got = _drain(_restored(size, seed, pulls, docs, True, fetched=fetched))
    assert got == _drain(_restored(size, seed, pulls, docs, False))
    assert len(fetched) == len(set(fetched))
