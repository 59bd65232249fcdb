"""Mix: interleave several weighted sources inside a lane.

Token-aware by default: the next document comes from the active source whose realized token
count is smallest relative to its weight (`tokens[s] / weight[s]`), so realized token shares
track the weights to within one document. Ties break by `mix64(seed, lane, position, s)`. The
choice is a pure function of (seed, lane, position) and the per-source counters in the state;
with `mix = "documents"` the counters count documents instead of tokens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from zephon_stream.engine.rng import mix64

Doc = tuple[tuple[int, int, int, int], Any]  # ((source, position, offset, length), tokens)


class Mix:
    def __init__(self, weights: Sequence[float], seed: int, lane: int, by_tokens: bool,
                 pull: Sequence[Callable[[], Awaitable[Doc | None]]]) -> None:
        self.weights, self.seed, self.lane, self.by_tokens, self._pull = list(weights), seed, lane, by_tokens, pull
        self.counts = [0] * len(weights)
        self.position = 0
        self.cursors = [(0, 0)] * len(weights)  # per source: (split position, offset) of the next document
        self._active = list(range(len(weights)))

    def __repr__(self) -> str:
        return f"Mix(weights={self.weights}, by_tokens={self.by_tokens})"

    def restore(self, counts: list[int], position: int, cursors: list[tuple[int, int]]) -> None:
        self.counts, self.position, self.cursors = list(counts), position, [tuple(c) for c in cursors]

    async def next(self) -> Doc | None:
        while self._active:
            s = min(self._active, key=lambda s: (self.counts[s] / self.weights[s],
                                                mix64(self.seed, self.lane, self.position, s)))
            doc = await self._pull[s]()
            if doc is None:
                self._active.remove(s)
                continue
            (_, p, off, length), tokens = doc
            self.counts[s] += len(tokens) if self.by_tokens else 1
            self.position += 1
            self.cursors[s] = (p, off + length)
            return doc
        return None
