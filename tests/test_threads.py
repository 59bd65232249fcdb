"""engine.threads: blocking calls in worker threads that the event loop never waits to start."""

from __future__ import annotations

import contextvars
import os
import select
import signal
import threading

import anyio
import pytest

from zephon_stream.engine import threads

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def test_result_exception_and_context_reach_the_caller():
    def read_var(suffix: str) -> str:
        return VAR.get() + suffix

    def fail() -> None:
        raise KeyError("boom")

    async def main() -> str:
        VAR.set("caller")
        with pytest.raises(KeyError, match="boom"):
            await threads.run_sync(fail)
        return await threads.run_sync(read_var, "!")

    assert anyio.run(main) == "caller!"


def test_the_loop_thread_never_starts_a_thread(monkeypatch):
    anyio.run(threads.run_sync, int)  # the spawner exists from the first call on
    starters: list[int] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        starters.append(threading.get_ident())
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    gate = threading.Barrier(24, timeout=20)

    async def main() -> int:
        loop_thread = threading.get_ident()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(24):  # 24 calls that can only finish together: 24 workers at once
                    tg.start_soon(threads.run_sync, gate.wait)
        return loop_thread

    loop_thread = anyio.run(main)
    assert loop_thread not in starters
    assert gate.n_waiting == 0 and not gate.broken


def test_a_call_in_flight_is_never_stranded():
    """Bursts of calls that can only finish together, so each needs a worker of its own at once,
    of changing sizes (the pool has more idle workers than calls, then fewer): a call left without
    a worker would hang its burst until fail_after."""

    async def burst(n: int) -> None:
        gate = threading.Barrier(n, timeout=20)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(threads.run_sync, gate.wait)
        assert not gate.broken

    async def main() -> None:
        for n in (30, 5, 17, 3, 31, 1, 9, 24, 2, 33):
            await burst(n)

    for _ in range(3):
        anyio.run(main)


def test_the_limiter_bounds_concurrent_calls():
    """12 calls under a limiter of 3: the first three wait for one another (the third lets them
    go), so three run at once, and never more."""
    limiter = anyio.CapacityLimiter(3)
    running, peak = [0], [0]
    lock, three = threading.Lock(), threading.Event()

    def work() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            if running[0] == 3:
                three.set()
        assert three.wait(10)
        with lock:
            running[0] -= 1

    async def main() -> None:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(12):
                    tg.start_soon(lambda: threads.run_sync(work, limiter=limiter))

    anyio.run(main)
    assert peak[0] == 3


def test_cancelled_caller_waits_for_the_call_unless_it_abandons_it():
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        release.wait(10)
        finished.set()

    async def cancel_after_start(abandon: bool) -> bool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: threads.run_sync(work, abandon_on_cancel=abandon))
            await threads.run_sync(started.wait, 10)
            tg.cancel_scope.cancel()
            if not abandon:
                release.set()  # the task group waits for the call to end, after this
        done = finished.is_set()  # abandoned: the caller left at once, the call goes on unobserved
        release.set()
        return done

    assert anyio.run(cancel_after_start, False) is True
    started.clear(), release.clear(), finished.clear()
    assert anyio.run(cancel_after_start, True) is False
    assert finished.wait(10)


def test_a_forked_child_runs_calls_on_threads_of_its_own() -> None:
    """The child of a fork has none of the parent's threads: calls in it ran nowhere, and a Loader
    opened in it waited for ever (multiprocessing's default start method on Linux, after the
    parent had streamed)."""
    assert anyio.run(threads.run_sync, sum, [1, 2]) == 3  # the parent's spawner and a worker are running
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = anyio.run(threads.run_sync, sum, [3, 4]) == 7
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    answered, _, _ = select.select([read], [], [], 30)  # the child's answer, or a hang that never gives one
    answer = os.read(read, 1) if answered else b""
    os.close(read)
    if not answer:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert anyio.run(threads.run_sync, sum, [5, 6]) == 11  # the parent's pool is as it was
