"""The loader inside a trainer's own event loop: the loop is never blocked while batches stream."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
import torch  # noqa: F401  (a trainer has torch loaded before it streams)

from zephon_stream.loader.loader import Loader


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


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_event_loop_never_blocked_over_50ms(config, backend):
    cfg = config.replace(seq_len=256, tokenize_batch=16)
    gaps: list[float] = []

    async def heartbeat(stop: anyio.Event) -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await anyio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

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
    worst = max(gaps)
    slowest_gc = max(pauses, key=lambda p: p[1], default=(None, 0.0))
    assert worst < 0.050, (f"event loop blocked for {worst * 1000:.1f} ms (heartbeat {gaps.index(worst)} of "
                           f"{len(gaps)}); {len(pauses)} GC passes while streaming, the slowest generation "
                           f"{slowest_gc[0]} for {slowest_gc[1] * 1000:.1f} ms")


def test_async_for_directly_on_loader(config):
    async def main() -> list[int]:
        steps = []
        async for batch in Loader(config, backend="threads"):
            steps.append(batch["step"])
            if len(steps) == 3:
                break
        return steps

    assert anyio.run(main) == [0, 1, 2]
