"""The streaming engine of publish and pull: lanes, a bounded window, an in-order sequencer.

    feeder --(bounded)--> lane 0..L-1: stage(item) --(bounded)--> sequencer: commit(item, result)

At most `window` items are between the feeder and their commit, so memory is bounded by
`window` results whatever the model size. Stages run concurrently (their CPU work goes to
worker threads under one CapacityLimiter); commits run one at a time, in item order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from zephon_stream.errors import unwrap_groups

__all__ = ["PipelineStatistics", "run_ordered"]

T = TypeVar("T")
R = TypeVar("R")


class PipelineStatistics(msgspec.Struct, frozen=True):
    """Items committed, and the peak number of results held waiting for their turn."""

    committed: int = 0
    peak_pending: int = 0


async def run_ordered(
    items: Sequence[T],
    stage: Callable[[T], Awaitable[R]],
    commit: Callable[[T, R], Awaitable[None]],
    *,
    lanes: int,
    window: int,
    defer_errors: bool = False,
) -> PipelineStatistics:
    """Run `stage` over items on `lanes` concurrent lanes and `commit` each result in order.

    With `defer_errors`, a stage error is raised only when the sequencer reaches its item, so
    every item before it is still committed (a relay commits the good versions before a bad one).
    """
    window = max(window, lanes, 1)
    slots = anyio.Semaphore(window)
    todo_send, todo_recv = anyio.create_memory_object_stream[int](lanes)
    done_send, done_recv = anyio.create_memory_object_stream[tuple[int, R]](window)
    peak = 0

    async def feed() -> None:
        async with todo_send:
            for i in range(len(items)):
                await slots.acquire()
                await todo_send.send(i)

    async def lane(todo: anyio.abc.ObjectReceiveStream[int], done: anyio.abc.ObjectSendStream[tuple[int, R]]) -> None:
        async with todo, done:
            async for i in todo:
                try:
                    result: Any = await stage(items[i])
                except Exception as exc:
                    if not defer_errors:
                        raise
                    result = _Failed(exc)
                await done.send((i, result))

    async def sequence() -> None:
        nonlocal peak
        pending: dict[int, R] = {}
        nxt = 0
        async with done_recv:
            async for i, result in done_recv:
                pending[i] = result
                peak = max(peak, len(pending))
                while nxt in pending:
                    result = pending.pop(nxt)
                    if isinstance(result, _Failed):
                        raise result.error
                    await commit(items[nxt], result)
                    nxt += 1
                    slots.release()

    with unwrap_groups():
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            tg.start_soon(sequence)
            async with todo_recv, done_send:
                for _ in range(max(lanes, 1)):
                    tg.start_soon(lane, todo_recv.clone(), done_send.clone())
    return PipelineStatistics(committed=len(items), peak_pending=peak)


class _Failed:
    """A stage error held until the sequencer reaches its item."""

    def __init__(self, error: Exception) -> None:
        self.error = error
