"""Lane workers that die are started again where their lanes stood (processes and ray backends).

A lane's output is a pure function of its state (the checkpoint contract). So when a worker
(a spawned process, a Ray actor) dies, the backend starts a new one whose lanes begin at the
state of the last sample that reached this process from each of them: every sample before it
is already in the lane's buffer here, or handed out by the sequencer, and the new worker makes
exactly the next one. Nothing is repeated or skipped and the order does not change.

```
worker 0 (lanes 0, 2) --batches--> buffers here --> sequencer
   x SIGKILL                 last[0] = state after sample 41, last[2] = after 40
worker 0' from last[0], last[2]  --> samples 42.., 41..  (the same bytes the dead one would have made)
```

Credits travel with the restart: a lane's new worker may run ahead by `sample_buffer` batches
less those still waiting here, so the bound on what is in flight holds across restarts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from zephon_stream.errors import ZephonError
from zephon_stream.loader.config import Config
from zephon_stream.loader.state import LaneState
from zephon_stream.operators.read import RecordCounts
from zephon_stream.operators.types import Sample

__all__ = ["Supervision", "supervised"]


class Supervision:
    """What a backend that restarts lane workers keeps for one run of a rank's lanes.

    `groups[w]` are the lanes of worker `w`. Only the backend's own tasks call these methods.
    """

    def __init__(self, config: Config, states: dict[int, LaneState], groups: list[list[int]]) -> None:
        self.config, self.groups = config, groups
        self.last = dict(states)  # each lane's state after its last sample received here
        self.outstanding = {lane: 0 for lane in states}  # batches received here, not yet taken by the sequencer
        self.ended: set[int] = set()
        self.restarts = [0] * len(groups)
        self._skipped = [RecordCounts() for _ in groups]  # the live worker's counts (bad records, filtered)
        self._skipped_before = [RecordCounts() for _ in groups]  # the dead ones'

    def received(self, lane: int, samples: list[Sample]) -> None:
        state = next((s.state for s in reversed(samples) if s.state is not None), None)  # not a LaneFailure's
        if state is not None:
            self.last[lane] = state
        self.outstanding[lane] += 1

    def credited(self, lane: int) -> None:
        self.outstanding[lane] -= 1

    def credits(self, lane: int) -> int:
        """How many batches a new worker may send for `lane` before the sequencer takes more."""
        return self.config.sample_buffer - self.outstanding[lane]

    def live(self, w: int) -> list[int]:
        """The lanes of worker `w` that have not ended: the ones a restart starts again."""
        return [lane for lane in self.groups[w] if lane not in self.ended]

    def states(self, w: int) -> list[LaneState]:
        return [self.last[lane] for lane in self.live(w)]

    def set_skipped(self, w: int, counts: RecordCounts) -> None:
        self._skipped[w] = counts

    def skipped(self) -> RecordCounts:
        """Records skipped (bad) and filtered out by every worker, live and dead."""
        return sum((c for pair in zip(self._skipped, self._skipped_before) for c in pair), RecordCounts())

    def lost(self, w: int, what: str) -> None:
        """Worker `w` died (`what` says how): count a restart, or raise once `max_restarts` are spent."""
        if self.restarts[w] >= self.config.max_restarts:
            raise ZephonError(
                f"lane worker {w} ({what}) died, and its max_restarts = {self.config.max_restarts} restarts are "
                f"spent: lanes {self.live(w)} stopped at samples "
                f"{[self.last[lane].samples for lane in self.live(w)]}; see the worker's output for why it died "
                "(memory? a signal?), then raise max_restarts or resume from the last checkpoint")
        self.restarts[w] += 1
        self._skipped_before[w] += self._skipped[w]
        self._skipped[w] = RecordCounts()

    def total_restarts(self) -> int:
        return sum(self.restarts)


@asynccontextmanager
async def supervised(pool: Any, lanes: list[int], workers: int, buffer: int) -> AsyncIterator[tuple[Any, ...]]:
    """Run `pool` (processes or Ray actors: `sends`, `supervise(w)`, `credit`, `sup`, `store_statistics`)
    for `lanes` over `workers` workers; yield what `backends.run_lanes` yields for them."""
    streams = {}
    for lane in lanes:
        pool.sends[lane], streams[lane] = anyio.create_memory_object_stream[list[Sample]](buffer + 1)
    async with anyio.create_task_group() as tg:
        for w in range(workers):
            tg.start_soon(pool.supervise, w)
        try:
            yield streams, pool.credit, pool.sup.skipped, pool.store_statistics, pool.sup.total_restarts
        finally:
            tg.cancel_scope.cancel()
            for lane in lanes:
                pool.sends[lane].close()
                streams[lane].close()
