"""Turns: at most `n` holders at once, and the waiter with the lowest key goes first.

```
turns = Turns(2)
async with turns.turn(key=17):    # waits while 2 hold a turn; then lowest key first, ties first come
    await cpu(tokenize, docs)
```

The loader's lanes take a turn before each tokenizer call, keyed by the global slot of the
sample the lane makes next: the CPU threads serve the lane furthest behind first. The sequencer
needs every lane's samples of a step, so the lane furthest behind is the one it waits for, and
a lane that has run ahead (its sample buffer not full yet) waits instead of taking the threads
from it. Only who runs first changes, never what anything yields.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

__all__ = ["Turns"]


class _Waiter:
    __slots__ = ("event", "granted", "gone")

    def __init__(self) -> None:
        self.event, self.granted, self.gone = anyio.Event(), False, False


class Turns:
    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"Turns needs n >= 1, got {n}")
        self.n, self._free = n, n
        self._waiting: list[tuple[int, int, _Waiter]] = []
        self._order = itertools.count()

    def __repr__(self) -> str:
        return f"Turns({self.n}, {self.n - self._free} held, {len(self._waiting)} waiting)"

    @asynccontextmanager
    async def turn(self, key: int) -> AsyncIterator[None]:
        if self._free and not self._waiting:
            self._free -= 1
        else:
            await self._wait(key)
        try:
            yield
        finally:
            self._release()

    async def _wait(self, key: int) -> None:
        waiter = _Waiter()
        heapq.heappush(self._waiting, (key, next(self._order), waiter))
        try:
            await waiter.event.wait()
        except BaseException:  # cancelled: give back a turn granted meanwhile, else leave the queue
            if waiter.granted:
                self._release()
            waiter.gone = True
            raise

    def _release(self) -> None:
        while self._waiting:
            _, _, waiter = heapq.heappop(self._waiting)
            if not waiter.gone:
                waiter.granted = True
                waiter.event.set()
                return
        self._free += 1
