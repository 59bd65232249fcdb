"""The loader inside a trainer's own event loop: the loop is never blocked while batches stream."""

from __future__ import annotations

import gc
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
import torch  # noqa: F401  (a trainer has torch loaded before it streams)

from zephon_stream.loader.config import Config
from zephon_stream.loader.loader import Loader
from zephon_stream.testing.determinism import batch_records


@contextmanager
def gc_pauses() -> Iterator[list[tuple[int, float]]]:
    """Freeze what earlier tests left on the heap, and record every collection while inside.

    A full (generation 2) collection stops every thread, the loop too, for as long as it walks
    the heap; in a pytest process that holds torch, botocore and moto that is 100-400 ms, which
    says nothing about the loader. Frozen objects are never walked, so what is left to collect is
    the loader's own garbage. Trainers do the same with `gc.freeze()` after start-up.
    """
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.collect()
    gc.freeze()
    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()


def loop_thread_clock() -> tuple[float, float, int]:
    """Seconds this thread has run on a core, seconds it has waited runnable for one, and its major
    page faults. Linux's schedstat; where it is missing the waits read as 0, so every gap counts."""
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_majflt if hasattr(resource, "RUSAGE_THREAD") else 0
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            ran, waited, _ = f.read().split()
    except OSError:
        return time.thread_time(), 0.0, faults
    return int(ran) / 1e9, int(waited) / 1e9, faults


@pytest.mark.alone
@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_event_loop_never_blocked_over_50ms(config, backend):
    """40 steps; a heartbeat every 2 ms on the loop is never held up 50 ms by the loader.

    It runs alone (`make test` runs it after the parallel part): on two workers on two cores the
    other worker's processes took the cores from the loop (gaps of 75 ms in CI). The time the
    loop's thread still waited runnable for a core is the machine's, not the loader's, and is not
    counted. What is left of a gap is time the loop ran or slept outside its selector (a callback
    that computes, a blocking call, the GIL held elsewhere), and that must stay under 50 ms. A
    run over the bound is run once more; a block of the loader's shows in every run."""
    cfg = config.replace(seq_len=256, tokenize_batch=16)
    worst, why = longest_block(cfg, backend)
    if worst >= 0.050:
        worst, why = longest_block(cfg, backend)
    assert worst < 0.050, why


def longest_block(cfg: Config, backend: str) -> tuple[float, str]:
    """The longest hold-up of a heartbeat on the loop while 40 steps stream, less the time the
    loop's thread waited for a core, and what that gap was made of."""
    gaps: list[tuple[float, float, float, int]] = []  # wall, ran, waited for a core, major faults

    async def heartbeat(stop: anyio.Event) -> None:
        last, (ran0, waited0, faults0) = time.perf_counter(), loop_thread_clock()
        while not stop.is_set():
            await anyio.sleep(0.002)
            now, (ran, waited, faults) = time.perf_counter(), loop_thread_clock()
            gaps.append((now - last, ran - ran0, waited - waited0, faults - faults0))
            last, ran0, waited0, faults0 = now, ran, waited, faults

    async def main() -> int:
        stop = anyio.Event()
        steps = 0
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeat, stop)
                async with Loader(cfg, backend=backend).open() as stream:
                    async for batch in stream:
                        assert batch["input_ids"].shape == (24, 256)
                        steps += 1
                        if steps == 40:
                            break
                stop.set()
        return steps

    with gc_pauses() as pauses:
        assert anyio.run(main) == 40
    assert len(gaps) > 20
    blocks = [wall - waited for wall, _, waited, _ in gaps]
    worst = max(blocks)
    i = blocks.index(worst)
    wall, ran, waited, faults = gaps[i]
    slowest_gc = max(pauses, key=lambda p: p[1], default=(None, 0.0))
    return worst, (f"event loop held up {worst * 1000:.1f} ms (heartbeat {i} of {len(gaps)}: a gap of "
                   f"{wall * 1000:.1f} ms, of which the loop's thread ran {ran * 1000:.1f} ms, waited for a "
                   f"core {waited * 1000:.1f} ms and slept {(wall - ran - waited) * 1000:.1f} ms, with "
                   f"{faults} major page faults); {len(pauses)} GC passes while streaming, the slowest "
                   f"generation {slowest_gc[0]} for {slowest_gc[1] * 1000:.1f} ms")


def test_async_for_directly_on_loader(config):
    async def main() -> list[int]:
        steps = []
        async for batch in Loader(config, backend="threads"):
            steps.append(batch["step"])
            if len(steps) == 3:
                break
        return steps

    assert anyio.run(main) == [0, 1, 2]


@pytest.mark.parametrize("cut", ["cancel-scope", "wait_for"])
@pytest.mark.parametrize("path", ["open", "async-for"])
@pytest.mark.parametrize("backend", ["threads", "processes", "inline"])
def test_a_cancelled_wait_for_a_batch_loses_nothing(config, backend, path, cut):
    """A timeout around `__anext__` cancels the wait, not the batch: the next call hands out the
    same batch, so the batches and the checkpoint are those of a run without timeouts. Before, the
    batch a cancelled `async for` call was fetching was dropped (steps 2, 4, 5, 6, 8, 10 came out
    for the first six), and a cancelled `open()` stream raised an internal error: the samples
    taken for the batch were lost to the sequencer. And `async for` directly on the loader moved
    the state past the batch it held for the next call: a checkpoint then skipped it."""
    import asyncio

    steps = 5
    with Loader(config, backend=backend) as loader:
        expected = [r for _, b in zip(range(steps), loader) for r in batch_records(b)]

    async def main() -> tuple[list, int, int]:
        got, cut_short, ahead = [], 0, []

        async def take(stream) -> None:
            nonlocal cut_short
            while len(got) < steps:
                if cut == "wait_for":
                    try:
                        got.append(await asyncio.wait_for(stream.__anext__(), 0.001))
                    except asyncio.TimeoutError:
                        cut_short += 1
                else:
                    with anyio.move_on_after(0.001) as scope:  # shorter than a batch: most waits are cut
                        got.append(await stream.__anext__())
                    cut_short += scope.cancelled_caught
                if loader.step != len(got):  # a checkpoint now must name the batch not handed out yet
                    ahead.append((len(got), loader.step))

        with Loader(config, backend=backend) as loader:
            if path == "open":
                async with loader.open() as stream:
                    await take(stream)
            else:
                await take(loader.__aiter__())
            return [r for b in got for r in batch_records(b)], cut_short, loader.step, ahead

    records, cut_short, step, ahead = anyio.run(main)
    assert cut_short > 0 and step == steps
    assert records == expected
    assert ahead == [], "the state moved past a batch the caller had not received (it was lost on resume)"


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_set_weights_after_a_cancelled_wait_gives_the_batches_of_a_run_without(config, backend):
    """A cancelled wait may leave samples taken for the open step; `set_weights` for a later step
    keeps them, in their place before the lanes' other samples, which are made again from the
    change on (without that, a lane's sample for the open step was gone: an internal error)."""
    import asyncio

    weights, steps = {"a": 0.1, "b": 1.0}, 6

    async def cut_then_set() -> tuple[list, int]:
        with Loader(config, backend=backend) as loader:
            async with loader.open() as stream:
                got = [await stream.__anext__() for _ in range(2)]
                while not stream.taken:  # cut waits until one is cut after taking samples of its step
                    try:
                        got.append(await asyncio.wait_for(stream.__anext__(), 0.0005))
                    except asyncio.TimeoutError:
                        pass
                at = loader.step
                loader.set_weights(weights, at_step=at + 1)
                while len(got) < steps:
                    got.append(await stream.__anext__())
            return [r for b in got for r in batch_records(b)], at

    records, at = anyio.run(cut_then_set)
    with Loader(config, backend=backend) as loader:
        expected = []
        for batch in loader:
            expected += batch_records(batch)
            if loader.step == at:
                loader.set_weights(weights, at_step=at + 1)
            if loader.step == steps:
                break
    assert records == expected
