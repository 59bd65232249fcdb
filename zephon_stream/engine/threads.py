"""Run blocking calls in worker threads without ever starting a thread on the event loop.

`anyio.to_thread.run_sync` starts a new worker thread on the calling (event loop) thread when no
idle one is free, and `Thread.start()` waits until the new thread holds the GIL and says it is
running. When other threads keep the GIL busy (tokenizing, collating), that wait lasts a switch
interval or more per thread, and a loader opening 12 lanes starts a dozen threads at once: the
trainer's loop stood still for 60 ms at start-up. Here the loop only puts the call on a queue;
a spawner thread of its own starts the workers, so the loop never waits on a thread start.

`run_sync` keeps anyio's contract: the same default capacity limiter (40 calls per loop), the
caller's context variables, a call that is not abandoned runs to its end even when the caller
is cancelled (the cancellation is delivered after it), and `abandon_on_cancel=True` returns at
once on cancellation and lets the call finish unobserved. Workers exit after
`IDLE_SECONDS` without work. Outside asyncio (trio), it is anyio's own function.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

__all__ = ["IDLE_SECONDS", "run_sync"]

T = TypeVar("T")
IDLE_SECONDS = 10.0

_Job = tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # abandoned: the caller was cancelled and left
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class _Pool:
    """Worker threads fed from one queue. A spawner thread starts a worker whenever more calls
    wait than workers are idle; it re-checks every `_RECHECK` seconds while calls wait, as a
    second guard against a call stranded by a count taken while a worker changed state."""

    _RECHECK = 0.01

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards `_idle`; held for a few bytecodes, never by the loop
        self._idle = 0  # workers waiting for a call, and workers started but not yet waiting
        self._spawner: threading.Thread | None = None
        self._spawner_lock = threading.Lock()

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)
        if self._spawner is None:
            self._start_spawner()
        # Wake the spawner only when the idle workers may not cover the waiting calls: each wake
        # costs the spawner a GIL hand-off. `_idle` is read without the lock and can be stale high
        # (a worker that took a call and has not counted itself busy yet); such a worker checks
        # again once it has (see `_work`), so a call is never left without a worker.
        if self._idle <= self._jobs.qsize():
            self._wake.put(None)

    def _start_spawner(self) -> None:
        # once per process; from then on the loop never waits on a thread start
        with self._spawner_lock:
            if self._spawner is None:
                t = threading.Thread(target=self._spawn_forever, name="zephon-thread-spawner", daemon=True)
                t.start()
                self._spawner = t

    def _spawn_forever(self) -> None:
        while True:
            try:
                self._wake.get(timeout=None if self._jobs.empty() else self._RECHECK)
            except queue.Empty:
                pass
            with self._lock:
                if self._jobs.qsize() <= self._idle:
                    continue
                self._idle += 1
            threading.Thread(target=self._work, name="zephon-worker", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                ctx, fn, args, loop, fut = self._jobs.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                if not self._jobs.empty():  # a call came in as this worker gave up: make sure one takes it
                    self._wake.put(None)
                return
            with self._lock:
                self._idle -= 1
                short = self._idle < self._jobs.qsize()
            if short:
                self._wake.put(None)
            try:
                ok, value = True, ctx.run(fn, *args)
            except BaseException as exc:  # handed to the caller, as anyio does
                ok, value = False, exc
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, value)
            except RuntimeError:  # the loop closed while the call ran (it was abandoned)
                pass
            del ctx, fn, args, loop, fut, value
            with self._lock:
                self._idle += 1


_POOL = _Pool()


async def run_sync(fn: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter | None = None,
                   abandon_on_cancel: bool = False) -> T:
    """`fn(*args)` in a worker thread; see the module docstring for how it differs from anyio's."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio)
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=abandon_on_cancel)
    async with limiter or anyio.to_thread.current_default_thread_limiter():
        fut: asyncio.Future[T] = loop.create_future()
        _POOL.submit((contextvars.copy_context(), fn, args, loop, fut))
        if abandon_on_cancel:
            return await fut
        with anyio.CancelScope(shield=True):
            return await asyncio.shield(fut)
