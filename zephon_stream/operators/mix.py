"""Mix: interleave several weighted sources inside a lane.

Token-aware by default: the next document comes from the active source whose realized token
count is smallest relative to its weight (`tokens[s] / weight[s]`), so realized token shares
track the weights to within one document. Ties break by `mix64(seed, lane, position, s)`. The
choice is a pure function of (seed, lane, position) and the per-source counters in the state;
with `by_tokens=False` the counters count documents instead of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.engine.rng import mix64
from zephon_stream.operators.types import Doc

__all__ = ["Mix", "MixState"]


class MixState(msgspec.Struct, frozen=True, array_like=True):
    counts: list[int]  # per source: tokens (or documents) taken
    position: int  # documents taken


class Mix:
    def __init__(self, weights: Sequence[float], seed: int, lane: int, by_tokens: bool,
                 upstreams: Sequence[Operator[Doc]]) -> None:
        if len(weights) != len(upstreams) or not weights:
            raise ValueError(f"Mix needs one weight per upstream, got {len(weights)} for {len(upstreams)}")
        self.weights, self.seed, self.lane, self.by_tokens = list(weights), seed, lane, by_tokens
        self.upstreams = list(upstreams)
        self.counts = [0] * len(weights)
        self.position = 0
        self._active = list(range(len(weights)))

    def __repr__(self) -> str:
        return f"Mix(weights={self.weights}, by_tokens={self.by_tokens})"

    async def next(self) -> Doc | None:
        while self._active:
            s = min(self._active, key=lambda s: (self.counts[s] / self.weights[s],
                                                mix64(self.seed, self.lane, self.position, s)))
            doc = await self.upstreams[s].next()
            if doc is None:
                self._active.remove(s)
                continue
            self.counts[s] += len(doc[1]) if self.by_tokens else 1
            self.position += 1
            return doc
        return None

    def state(self) -> MixState:
        return MixState(list(self.counts), self.position)

    def refs(self, state: MixState) -> list[object]:
        return []

    def restore(self, state: MixState, resolve: Resolve) -> None:
        if len(state.counts) != len(self.weights) or min(state.counts) < 0:
            refuse("mix.counts", state.counts, f"needs one count >= 0 per source ({len(self.weights)} sources)")
        if state.position < 0:
            refuse("mix.position", state.position, "must be >= 0")
        self.counts, self.position = list(state.counts), state.position
