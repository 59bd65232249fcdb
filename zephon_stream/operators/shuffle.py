"""Shuffle: a bounded per-lane window of documents.

The window fills to `size` documents; each pull takes the document at index
`mix64(seed, lane, pulls) % len(window)` and moves the last one into its place. Together with
the per-epoch permutation of splits (see `loader.lane`), this mixes documents across and within
shards with memory bounded by `size`. The state is the window's document references in window
order plus the pull counter; restore re-reads those documents.
"""

from __future__ import annotations

import msgspec

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.engine.rng import mix64
from zephon_stream.operators.types import Doc, DocRef

__all__ = ["Shuffle", "ShuffleState"]


class ShuffleState(msgspec.Struct, frozen=True, array_like=True):
    window: list[DocRef]  # in window order
    pulls: int  # documents taken out of the window


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
        while not self._upstream_done and len(self.window) < self.size:
            doc = await self.upstream.next()
            if doc is None:
                self._upstream_done = True
            else:
                self.window.append(doc)
        if not self.window:
            return None
        i = mix64(self.seed, self.lane, self.pulls) % len(self.window)
        self.pulls += 1
        doc = self.window[i]
        self.window[i] = self.window[-1]
        self.window.pop()
        return doc

    def state(self) -> ShuffleState:
        return ShuffleState([ref for ref, _ in self.window], self.pulls)

    def refs(self, state: ShuffleState) -> list[DocRef]:
        return [tuple(r) for r in state.window]

    def restore(self, state: ShuffleState, resolve: Resolve) -> None:
        refs = self.refs(state)
        if len(refs) > self.size:
            refuse("shuffle.window", f"{len(refs)} documents", f"holds at most the window size {self.size}")
        if len(set(refs)) != len(refs):
            refuse("shuffle.window", refs, "refers to the same document twice")
        if state.pulls < 0:
            refuse("shuffle.pulls", state.pulls, "must be >= 0")
        self.window, self.pulls = [resolve(r) for r in refs], state.pulls
