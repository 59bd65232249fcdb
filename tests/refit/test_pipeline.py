"""The refit engine commits in order, keeps at most `window` results, and surfaces lane errors."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from zephon_stream import DigestMismatch
from zephon_stream.engine.ordered import run_ordered


@pytest.mark.parametrize(("workers", "window"), [(1, 1), (3, 4), (8, 8)])
def test_commits_in_order_with_bounded_window(workers: int, window: int) -> None:
    committed: list[int] = []
    running = peak = 0

    async def stage(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        for _ in range((7 * i) % 5):  # finish out of order
            await anyio.lowlevel.checkpoint()
        running -= 1
        return i * i

    async def commit(i: int, r: int) -> None:
        assert r == i * i
        committed.append(i)

    async def main() -> None:
        with anyio.fail_after(10):
            stats = await run_ordered(range(40), stage, commit, workers=workers, window=window)
        assert stats.committed == 40 and stats.peak_pending <= max(window, workers)

    anyio.run(main)
    assert committed == list(range(40))
    assert peak <= workers


def test_lane_error_is_raised_plainly() -> None:
    async def stage(i: int) -> int:
        if i == 5:
            raise ValueError("chunk 5 is bad")
        return i

    async def commit(i: int, r: int) -> None:
        pass

    async def main() -> None:
        with anyio.fail_after(10):
            await run_ordered(range(20), stage, commit, workers=4, window=8)

    with pytest.raises(ValueError, match="chunk 5 is bad"):
        anyio.run(main)


def test_deferred_error_commits_every_item_before_it() -> None:
    committed: list[int] = []

    async def main() -> None:
        failed = anyio.Event()

        async def stage(i: int) -> int:
            if i == 2:
                failed.set()
                raise DigestMismatch("item 2 is corrupt")
            await failed.wait()  # items 0 and 1 finish only after item 2 has failed
            return i

        async def commit(i: int, _: int) -> None:
            committed.append(i)

        with anyio.fail_after(10), pytest.raises(DigestMismatch, match="item 2"):
            await run_ordered(list(range(5)), stage, commit, workers=3, window=3, defer_errors=True)

    anyio.run(main)
    assert committed == [0, 1]
