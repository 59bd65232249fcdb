"""Shuffle: a bounded per-lane window of documents.

The window fills to `size` documents; each pull takes the document at index
`mix64(seed, lane, pulls) % len(window)` and moves the last one into its place. Together with
the per-epoch permutation of splits (`Lanes._permutation`), this mixes documents across and within
shards with memory bounded by `size`. The state is the window's document references in
window order plus the pull counter; restore re-reads those documents.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from zephon_stream.engine.rng import mix64
from zephon_stream.operators.mix import Doc


class Shuffle:
    def __init__(self, size: int, seed: int, lane: int, pull: Callable[[], Awaitable[Doc | None]]) -> None:
        self.size, self.seed, self.lane, self._pull = size, seed, lane, pull
        self.window: list[Doc] = []
        self.pulls = 0
        self._upstream_done = False

    def __repr__(self) -> str:
        return f"Shuffle(size={self.size})"

    def restore(self, window: list[Doc], pulls: int) -> None:
        self.window, self.pulls = list(window), pulls

    async def next(self) -> Doc | None:
        if self.size == 0:
            return await self._pull()
        while not self._upstream_done and len(self.window) < self.size:
            doc = await self._pull()
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
