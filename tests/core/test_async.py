"""The loader inside a trainer's own event loop: the loop is never blocked while batches stream."""

from __future__ import annotations

import time

import anyio
import pytest

from zephon_stream._loader import Loader


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

    assert anyio.run(main) == 40
    assert len(gaps) > 20
    assert max(gaps) < 0.050, f"event loop blocked for {max(gaps) * 1000:.1f} ms"


def test_async_for_directly_on_loader(config):
    async def main() -> list[int]:
        steps = []
        async for batch in Loader(config, backend="threads"):
            steps.append(batch["step"])
            if len(steps) == 3:
                break
        return steps

    assert anyio.run(main) == [0, 1, 2]
