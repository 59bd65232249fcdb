"""Mix: interleave several weighted sources inside a lane, with weights that change by step.

Token-aware by default: the next document comes from the active source whose token count since
the weights in force came into force is smallest relative to its weight
(`(counts[s] - base[s]) / weight[s]`), so realized token shares track the weights to within one
document. A source of weight 0 is paused: it is drawn from only once every source with a weight
has ended (with `max_epochs`, so that every document still appears), and then as if weighted 1.
Ties break by `mix64(seed, lane, position, s)`. The choice is a pure function of
(seed, lane, position) and the counters in the state; with `by_tokens=False` the counters count
documents instead of tokens.

Weights by step (`Schedule`): the lane calls `enter(step)` before it makes each sample, with
the global step that sample belongs to. Every document drawn while that sample is made is drawn
with the weights in force at that step, so a change at step `b` applies to the documents drawn
for the samples of step `b` on. At a change the counters restart (`base` = the counts then):
the steps after it track the new weights, not a cumulative mix of old and new.

```
schedule: {0: [0.7, 0.3], 2000: [0.3, 0.7]}
lane 5 makes its sample 1000 (global step 1000*L+5 // G = 2000): enter(2000)
  -> since = 2000, weights = [0.3, 0.7], base = counts       (counts since the change: zero)
```

Documents drawn before the change and still in the shuffle window come out in the first steps
after it; the window (not the mix) sets how soon the realized shares settle.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.engine.rng import mix64
from zephon_stream.operators.types import Doc

__all__ = ["Mix", "MixState", "Schedule"]


class MixState(msgspec.Struct, frozen=True, array_like=True):
    counts: list[int]  # per source: tokens (or documents) taken
    position: int  # documents taken
    since: int = 0  # the step from which the weights in force apply: a step of the lane's Schedule
    base: list[int] = []  # counts when those weights came into force (empty: all zero)


class Schedule:
    """Weights by global step: `[(step, weights)]`, the first at step 0.

    An entry whose weights equal the ones in force is dropped, so a repeated decision never
    restarts the counters. Weights must be finite and >= 0, one of them > 0.
    """

    def __init__(self, entries: Sequence[tuple[int, Sequence[float]]]) -> None:
        by_step = dict(sorted((int(step), [float(w) for w in ws]) for step, ws in entries))
        if 0 not in by_step:
            raise ValueError(f"a Schedule needs weights at step 0, got steps {sorted(by_step)}")
        self.steps: list[int] = []
        self.weights: list[list[float]] = []
        for step, ws in by_step.items():
            if (not ws or len(ws) != len(by_step[0]) or not all(0 <= w < float("inf") for w in ws)
                    or not any(ws)):
                raise ValueError(f"Schedule weights at step {step} = {ws}: need one finite weight >= 0 per source, "
                                 "one of them > 0")
            if not self.weights or ws != self.weights[-1]:
                self.steps.append(step)
                self.weights.append(ws)

    def __repr__(self) -> str:
        return f"Schedule({list(zip(self.steps, self.weights))})"

    def since(self, step: int) -> int:
        """The step from which the weights in force at `step` apply."""
        return self.steps[bisect.bisect_right(self.steps, step) - 1]

    def at(self, since: int) -> list[float] | None:
        """The weights that apply from `since` (a step of the schedule), else None."""
        i = bisect.bisect_left(self.steps, since)
        return self.weights[i] if i < len(self.steps) and self.steps[i] == since else None


class Mix:
    def __init__(self, weights: Sequence[float] | Schedule, seed: int, lane: int, by_tokens: bool,
                 upstreams: Sequence[Operator[Doc]]) -> None:
        self.schedule = weights if isinstance(weights, Schedule) else Schedule([(0, weights)])
        if len(self.schedule.weights[0]) != len(upstreams):
            raise ValueError(f"Mix needs one weight per upstream, got {len(self.schedule.weights[0])} for "
                             f"{len(upstreams)}")
        self.seed, self.lane, self.by_tokens = seed, lane, by_tokens
        self.upstreams = list(upstreams)
        self.weights = self.schedule.weights[0]
        self.counts = [0] * len(self.weights)
        self.base = [0] * len(self.weights)
        self.position = 0
        self.since = 0
        self._active = list(range(len(self.weights)))

    def __repr__(self) -> str:
        return f"Mix(schedule={self.schedule}, by_tokens={self.by_tokens})"

    def enter(self, step: int) -> None:
        """The next documents are drawn for a sample of global step `step`: take its weights
        (restarting the counters when they change)."""
        since = self.schedule.since(step)
        if since != self.since:
            self.since, self.base = since, list(self.counts)
            self.weights = self.schedule.at(since) or self.weights

    async def next(self) -> Doc | None:
        while self._active:
            live = self._active
            if 0.0 in self.weights:  # a source of weight 0 waits until every weighted one has ended
                live = [s for s in live if self.weights[s] > 0] or live
            if len(live) == 1:  # one source left (or only one): the draw has one outcome
                s = live[0]
            else:
                s = min(live, key=lambda s: ((self.counts[s] - self.base[s]) / (self.weights[s] or 1.0),
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
        base = list(self.base) if any(self.base) else []
        return MixState(list(self.counts), self.position, self.since, base)

    def refs(self, state: MixState) -> list[object]:
        return []

    def restore(self, state: MixState, resolve: Resolve) -> None:
        n = len(self.weights)
        if len(state.counts) != n or min(state.counts) < 0:
            refuse("mix.counts", state.counts, f"needs one count >= 0 per source ({n} sources)")
        if state.position < 0:
            refuse("mix.position", state.position, "must be >= 0")
        weights = self.schedule.at(state.since)
        if weights is None:
            refuse("mix.since", state.since, f"weights change only at steps {self.schedule.steps} of this run's "
                   "schedule and set_weights log")
        base = list(state.base) or [0] * n
        if len(base) != n or not all(0 <= b <= c for b, c in zip(base, state.counts)):
            refuse("mix.base", state.base, "needs one count per source, each in [0, mix.counts[s]]")
        self.counts, self.position, self.since, self.weights, self.base = (
            list(state.counts), state.position, state.since, weights, base)
