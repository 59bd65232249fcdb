"""Lane runs that can start again from other states: how `Loader.set_weights` rolls lanes back.

A backend's `run_lanes` is an async context manager: its lanes run while it is entered. `LaneRuns`
enters it in a task of its own (in the caller's task group), so the stream that consumes the
lanes' samples can stop that run and start another from the states it has consumed, without
leaving its own context. Lanes' outputs are pure functions of their states and the config, so a
run started again from the consumed states makes the same samples again, up to the step where
the config (its schedule) changed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio

from zephon_stream.loader.state import LaneState

__all__ = ["LaneRuns"]

Launch = Callable[[dict[int, LaneState]], AbstractAsyncContextManager[Any]]


class LaneRuns:
    """One run of a rank's lanes at a time, in `tg`: `start(states)`, `restart(states)`, `stop()`."""

    def __init__(self, tg: anyio.abc.TaskGroup, launch: Launch) -> None:
        self.tg, self.launch = tg, launch
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self._stopped.set()

    async def start(self, states: dict[int, LaneState]) -> Any:
        """Start a run from `states`; returns what `launch` yields (streams, credit, ...)."""
        self._stop, self._stopped = anyio.Event(), anyio.Event()
        return await self.tg.start(self._serve, states, self._stop, self._stopped)

    async def restart(self, states: dict[int, LaneState]) -> Any:
        """Stop the current run, wait until its lanes (and worker processes) are gone, start anew."""
        self.stop()
        await self._stopped.wait()
        return await self.start(states)

    def stop(self) -> None:
        self._stop.set()

    async def _serve(self, states: dict[int, LaneState], stop: anyio.Event, stopped: anyio.Event, *,
                     task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with self.launch(states) as run:
                task_status.started(run)
                await stop.wait()
        finally:
            stopped.set()
