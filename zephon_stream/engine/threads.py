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

It costs the loop two wake-ups a call (the result arriving, the caller resuming), not four: a
free limiter token is taken without anyio's two scheduling points, and the future is awaited
as it is, not through `asyncio.shield` under a shielded cancel scope; only a caller cancelled
mid-call pays for waiting out the call. The loader makes thousands of calls a second (157 ->
~70 us of loop CPU a call, measured bare).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

__all__ = ["IDLE_SECONDS", "run_sync"]

T = TypeVar("T")
IDLE_SECONDS = 10.0

class _Call:
    """A call's future, which the loop may swap for a fresh one while a cancelled caller waits
    out the call, and whether the call has ended (both touched on the loop thread only)."""

    __slots__ = ("fut", "ended")

    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self.fut, self.ended = fut, False


_Job = tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, _Call]


def _settle(call: _Call, ok: bool, value: Any) -> None:
    call.ended = True
    if call.fut.done():  # abandoned: the caller was cancelled and left
        return
    if ok:
        call.fut.set_result(value)
    else:
        call.fut.set_exception(value)


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
                ctx, fn, args, loop, call = self._jobs.get(timeout=IDLE_SECONDS)
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
                loop.call_soon_threadsafe(_settle, call, ok, value)
            except RuntimeError:  # the loop closed while the call ran (it was abandoned)
                pass
            del ctx, fn, args, loop, call, value
            with self._lock:
                self._idle += 1


_POOL = _Pool()


def _new_pool_in_child() -> None:
    """A forked child has none of the parent's threads, spawner included: the pool it inherited would
    queue calls that nothing runs (a Loader opened in the child waited for ever). It starts its own."""
    global _POOL
    _POOL = _Pool()


os.register_at_fork(after_in_child=_new_pool_in_child)


async def run_sync(fn: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter | None = None,
                   abandon_on_cancel: bool = False) -> T:
    """`fn(*args)` in a worker thread; see the module docstring for how it differs from anyio's."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio)
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=abandon_on_cancel)
    limiter = limiter or anyio.to_thread.current_default_thread_limiter()
    await anyio.lowlevel.checkpoint_if_cancelled()  # a caller already cancelled starts no call
    try:
        limiter.acquire_nowait()  # a free token: no scheduling point (anyio's `acquire` adds two)
    except anyio.WouldBlock:
        await limiter.acquire()
    try:
        call = _Call(loop.create_future())
        _POOL.submit((contextvars.copy_context(), fn, args, loop, call))
        try:
            return await call.fut  # cancelling the caller cancels this future, not the call
        except asyncio.CancelledError:
            if not abandon_on_cancel:
                await _wait_out(call, loop)
            raise
    finally:
        limiter.release()


async def _wait_out(call: _Call, loop: asyncio.AbstractEventLoop) -> None:
    """Wait, shielded, for the end of a call whose caller was cancelled; the caller then goes on
    with its cancellation and the call's result is dropped."""
    with anyio.CancelScope(shield=True):
        while not call.ended:
            call.fut = loop.create_future()  # set by `_settle` when the call ends
            try:
                await call.fut
            except asyncio.CancelledError:  # cancelled outside anyio's scopes: keep waiting
                continue
            except BaseException:  # the call's own error, dropped with its result
                pass
