"""Turns: at most n holders; the waiter with the lowest key first, ties first come; cancellation gives turns back."""

from __future__ import annotations

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.lowlevel import checkpoint

from zephon_stream.engine.turns import Turns


async def _scenario(keys: list[int], n: int) -> list[int]:
    turns, order, release = Turns(n), [], anyio.Event()

    async def holder() -> None:
        async with turns.turn(-1):
            await release.wait()

    async def waiter(key: int) -> None:
        async with turns.turn(key):
            order.append(key)
            await checkpoint()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(holder)
            await wait_all_tasks_blocked()
            for key in keys:
                tg.start_soon(waiter, key)
                await wait_all_tasks_blocked()
            release.set()
    return order


@pytest.mark.parametrize("n", [1, 2])
def test_the_lowest_key_goes_first_and_ties_in_arrival_order(n: int) -> None:
    assert anyio.run(_scenario, [5, 3, 9, 3, 1, 7], n) == [1, 3, 3, 5, 7, 9]


def test_never_more_than_n_at_once_and_a_cancelled_waiter_gives_its_turn_back() -> None:
    async def main() -> None:
        turns, inside, peak = Turns(2), [0], [0]

        async def work(key: int) -> None:
            async with turns.turn(key):
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                await checkpoint()
                await checkpoint()
                inside[0] -= 1

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as doomed:
                        async with turns.turn(0):
                            async with turns.turn(0):
                                doomed.start_soon(work, 1)  # waits: both turns held
                                await wait_all_tasks_blocked()
                                scope.cancel()
                for key in range(20):
                    tg.start_soon(work, key)
        assert peak[0] == 2 and inside[0] == 0
        assert repr(turns) == "Turns(2, 0 held, 0 waiting)"

    anyio.run(main)


def test_needs_one_turn_at_least() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        Turns(0)
