"""The ordered map of publish, pull and relay: workers, a bounded window, an in-order sequencer.

    feeder --(bounded)--> worker 0..W-1: stage(item) --(bounded)--> sequencer: commit(item, result)

At most `window` items are between the feeder and their commit, so memory is bounded by
`window` results whatever the model size. Stages run concurrently (their CPU work goes through
the caller's `CpuPolicy`); commits run one at a time, in item order.

The concurrency here is `workers`: it changes nothing but speed. `lanes` means the loader's
order-defining lanes only; `lanes=` as a name for workers is deprecated (`resolve_workers`).
"""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from zephon_stream.errors import ConfigError, unwrap_groups

__all__ = ["PipelineStatistics", "resolve_workers", "run_ordered"]

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
    workers: int | None = None,
    window: int,
    defer_errors: bool = False,
    lanes: int | None = None,
) -> PipelineStatistics:
    """Run `stage` over items on `workers` concurrent workers and `commit` each result in order.

    With `defer_errors`, a stage error is raised only when the sequencer reaches its item, so
    every item before it is still committed (a relay commits the good versions before a bad one).
    `lanes` is the deprecated name of `workers`.
    """
    workers = resolve_workers(workers, lanes, default=None, owner="run_ordered")
    window = max(window, workers, 1)
    slots = anyio.Semaphore(window)
    todo_send, todo_recv = anyio.create_memory_object_stream[int](workers)
    done_send, done_recv = anyio.create_memory_object_stream[tuple[int, R]](window)
    peak = 0

    async def feed() -> None:
        async with todo_send:
            for i in range(len(items)):
                await slots.acquire()
                await todo_send.send(i)

    async def worker(todo: anyio.abc.ObjectReceiveStream[int], done: anyio.abc.ObjectSendStream[tuple[int, R]]) -> None:
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
                for _ in range(max(workers, 1)):
                    tg.start_soon(worker, todo_recv.clone(), done_send.clone())
    return PipelineStatistics(committed=len(items), peak_pending=peak)


def resolve_workers(workers: int | None, lanes: int | None, *, default: int | None, owner: str) -> int:
    """`workers`, else the deprecated spelling `lanes=` (with a DeprecationWarning), else `default`.

    `owner` names the call in the messages; a call that passes both is refused (ConfigError).
    """
    if lanes is not None:
        if workers is not None:
            raise ConfigError(f"{owner}: pass workers={workers} alone (lanes={lanes} is its deprecated name)")
        warnings.warn(f"{owner}(lanes=...) is deprecated: use workers=... (lanes are the loader's "
                      "order-defining lanes; this is plain concurrency)", DeprecationWarning, stacklevel=3)
        return lanes
    if workers is None:
        if default is None:
            raise TypeError(f"{owner}() needs the keyword argument workers=")
        return default
    return workers


class _Failed:
    """A stage error held until the sequencer reaches its item."""

    def __init__(self, error: Exception) -> None:
        self.error = error
