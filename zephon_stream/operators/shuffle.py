"""Shuffle: a bounded per-lane window of documents that grows as it is drawn from.

Before pull `p` the window is filled up to `target(p) = min(size, p + 1)` documents; the pull
takes the document at index `mix64(seed, lane, p) % len(window)` and moves the last one into
its place. So the first pull needs one document, not a whole window: the window grows by one
document a pull (the upstream gives two a pull meanwhile) and from pull `size - 1` on it holds
`size` documents before every pull, as a window that fills whole first would.

```
size 4, upstream a b c d e f g ...
pull 0: fill to 1: [a]        draw 0 -> a   []
pull 1: fill to 2: [b c]      draw 1 -> b   [c]
pull 2: fill to 3: [c d e]    draw 2 -> e   [c d]
pull 3: fill to 4: [c d f g]  ...           from here on 4 before each pull
```

Together with the per-epoch permutation of splits (see `loader.lane`), this mixes documents
across and within shards with memory bounded by `size`. The draws are a pure function of
(seed, lane, pulls) and the sequence the upstream gives.

State: the window's document references in window order, and the pull counter. Right after
pull `p` the window holds at most `target(p) - 1` documents, so `restore` refuses a fuller one
(`window_bound`): a state written before windows grew (by zephon-stream up to this change,
which filled the window whole before its first pull) loads, and resumes as it would have, once
its window has had `size` pulls; earlier such states are refused.

Restore re-reads the window's documents. `refs(state)` lists them in the order the next pulls
take them (while the upstream goes on), and `resolve(ref)` may give a document whose payload
is `Deferred`: the window then awaits that payload when a pull takes the document, so whoever
restores re-reads what the first pulls need first, and the rest when it is needed. The index a
pull takes is known before the window is filled for it (the counter and `target`), so when that
is a `Deferred` document its fetch runs while the upstream fills the window: the pull waits for
the longer of the two, not for both one after the other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.engine.rng import mix64
from zephon_stream.errors import unwrap_groups
from zephon_stream.operators.types import Doc, DocRef

__all__ = ["Deferred", "Shuffle", "ShuffleState", "draw_order", "window_bound", "window_target"]


class ShuffleState(msgspec.Struct, frozen=True, array_like=True):
    window: list[DocRef]  # in window order
    pulls: int  # documents taken out of the window


class Deferred:
    """The payload of a restored window document not read again yet: `await fetch(ref)` gives it."""

    __slots__ = ("fetch",)

    def __init__(self, fetch: Callable[[DocRef], Awaitable[Any]]) -> None:
        self.fetch = fetch

    def __repr__(self) -> str:
        return "Deferred()"


def window_target(size: int, pulls: int) -> int:
    """Documents the window is filled to before pull number `pulls` (0-based)."""
    return min(size, pulls + 1)


def window_bound(size: int, pulls: int) -> int:
    """The most documents a window can hold right after `pulls` pulls (0 before the first)."""
    return window_target(size, pulls - 1) - 1 if pulls else 0


def draw_order(size: int, seed: int, lane: int, window: int, pulls: int, horizon: int = 4096) -> list[int]:
    """The indexes of a window of `window` documents after `pulls` pulls, in the order the next
    pulls take them, as long as the upstream gives documents (pulls are a pure function of the
    counter and the window's length, never of the documents). Only the next `horizon` pulls are
    followed (a document still there after them is rare below windows of a few hundred): the
    rest come last, in window order."""
    slots: list[int] = list(range(window))  # -1: a document pulled in after the state
    order: list[int] = []
    end = pulls + horizon
    while len(order) < window and pulls < end:
        slots += [-1] * (window_target(size, pulls) - len(slots))
        i = mix64(seed, lane, pulls) % len(slots)
        pulls += 1
        if slots[i] >= 0:
            order.append(slots[i])
        slots[i] = slots[-1]
        slots.pop()
    return order + sorted(i for i in slots if i >= 0)


class Shuffle:
    def __init__(self, size: int, seed: int, lane: int, upstream: Operator[Doc]) -> None:
        if size < 0:
            raise ValueError(f"Shuffle size must be >= 0 (0 = off), got {size}")
        self.size, self.seed, self.lane, self.upstream = size, seed, lane, upstream
        self.window: list[Doc] = []
        self.pulls = 0
        self._upstream_done = False

    def __repr__(self) -> str:
        return f"Shuffle(size={self.size})"

    async def next(self) -> Doc | None:
        if self.size == 0:
            return await self.upstream.next()
        target = window_target(self.size, self.pulls)
        draw = mix64(self.seed, self.lane, self.pulls)
        if not self._upstream_done and len(self.window) < target:
            await self._fill(target, draw % target)
        if not self.window:
            return None
        i = draw % len(self.window)
        await self._resolve(i)  # before any change: a failed fetch leaves the window as it was
        doc = self.window[i]
        self.pulls += 1
        self.window[i] = self.window[-1]
        self.window.pop()
        return doc

    async def _fill(self, target: int, drawn: int) -> None:
        """Fill the window to `target` documents. Unless the upstream ends meanwhile, the pull then
        takes index `drawn`: a document there not read again yet is fetched while the window fills."""
        if drawn < len(self.window) and isinstance(self.window[drawn][1], Deferred):
            with unwrap_groups():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._resolve, drawn)
                    await self._take(target)
        else:
            await self._take(target)

    async def _take(self, target: int) -> None:
        while not self._upstream_done and len(self.window) < target:
            doc = await self.upstream.next()
            if doc is None:
                self._upstream_done = True
            else:
                self.window.append(doc)

    async def _resolve(self, i: int) -> None:
        """The payload of document `i` of the window, fetched if it is `Deferred` (appends leave `i` in place)."""
        ref, payload = self.window[i]
        if isinstance(payload, Deferred):
            self.window[i] = (ref, await payload.fetch(ref))

    def state(self) -> ShuffleState:
        return ShuffleState([ref for ref, _ in self.window], self.pulls)

    def refs(self, state: ShuffleState) -> list[DocRef]:
        """The window's references in the order the next pulls take them (see `draw_order`)."""
        refs = [tuple(r) for r in state.window]
        if not self.size or not 0 <= len(refs) <= window_bound(self.size, state.pulls):
            return refs  # a state `restore` refuses: any order
        return [refs[i] for i in draw_order(self.size, self.seed, self.lane, len(refs), state.pulls)]

    def restore(self, state: ShuffleState, resolve: Resolve) -> None:
        refs = [tuple(r) for r in state.window]
        if len(refs) > self.size:
            refuse("shuffle.window", f"{len(refs)} documents", f"holds at most the window size {self.size}")
        if len(set(refs)) != len(refs):
            refuse("shuffle.window", refs, "refers to the same document twice")
        if state.pulls < 0:
            refuse("shuffle.pulls", state.pulls, "must be >= 0")
        if len(refs) > window_bound(self.size, state.pulls):
            refuse("shuffle.window", f"{len(refs)} documents after {state.pulls} pulls",
                   f"a window grows by one document a pull up to {self.size}, so it holds at most "
                   f"{window_bound(self.size, state.pulls)} here (a state written by zephon-stream before windows "
                   f"grew, within its window's first {self.size} pulls: resume it with that version)")
        self.window, self.pulls = [resolve(r) for r in refs], state.pulls
