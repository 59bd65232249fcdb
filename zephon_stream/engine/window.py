"""The read-ahead window: ranged reads of one object, in order, `ahead` of them in flight.

```
ranges:  [0,1M) [1M,2M) [2M,3M) [3M,4M) [4M,5M) ...
          taken  in flight ......... (ahead = 3)   not started
```

Both jobs read objects in parts this way: a loader lane its split, `S3Store.open_read` an
object. Memory is bounded by `ahead` parts, and the store's latency hides behind the reader's work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from zephon_stream.errors import ConnectorError

__all__ = ["Fetch", "ReadWindow", "Spawn", "read_ranges"]

Spawn = Callable[..., Any]  # a task group's start_soon
Fetch = Callable[[int, int], Awaitable[bytes]]  # the bytes [start, end) of the object


class _Part:
    __slots__ = ("data", "error", "done", "cancelled")

    def __init__(self) -> None:
        self.data, self.error, self.done, self.cancelled = b"", None, anyio.Event(), False


class ReadWindow:
    """Ranged reads (`fetch(start, end)`) of `ranges`, in order, with a sliding window of `ahead` requests.

    Taking a part starts the next request, so at most `ahead` parts are in flight or waiting:
    bounded memory, and the store's latency is hidden behind the lane's CPU work. Requests run
    as tasks of `spawn` (the lanes' task group), never inside the reader's generator, so a
    reader dropped half way leaves nothing to clean up but its finished requests.
    """

    def __init__(self, fetch: Fetch, ranges: list[tuple[int, int]], ahead: int, spawn: Spawn) -> None:
        if ahead < 1:
            raise ValueError(f"ReadWindow needs ahead >= 1, got {ahead}")
        self.fetch, self.ranges, self.ahead, self.spawn = fetch, ranges, ahead, spawn
        self._parts: dict[int, _Part] = {}
        self._started = self._taken = 0

    def _fill(self) -> None:
        while self._started < len(self.ranges) and self._started < self._taken + self.ahead:
            part = self._parts[self._started] = _Part()
            self.spawn(self._fetch, part, *self.ranges[self._started])
            self._started += 1

    async def _fetch(self, part: _Part, start: int, end: int) -> None:
        try:
            part.data = await self.fetch(start, end)
        except Exception as exc:  # raised where the part is taken, in the lane
            part.error = exc
        except BaseException:  # cancelled (the lanes are stopping): the reader must not take b"" for the data
            part.cancelled = True
            raise
        finally:
            part.done.set()

    def __aiter__(self) -> ReadWindow:
        return self

    async def __anext__(self) -> bytes:
        if self._taken >= len(self.ranges):
            raise StopAsyncIteration
        self._fill()
        part = self._parts.pop(self._taken)
        self._taken += 1
        self._fill()
        await part.done.wait()
        if part.error is not None:
            raise part.error
        if part.cancelled:  # the request's task was cancelled with the task group: so is this reader
            await anyio.lowlevel.checkpoint()
            raise ConnectorError(f"the read of bytes [{self.ranges[self._taken - 1][0]}, "
                                 f"{self.ranges[self._taken - 1][1]}) was cancelled")
        return part.data


class _OneByOne:
    """`fetch` of each of `ranges` in turn, when the caller asks: one request at a time. A plain
    async iterator, not an async generator: one left unfinished (a reader that stops at its
    split's end) is simply dropped, where a generator is finalized by the event loop's hook (a
    task and a wake-up of the loop each)."""

    def __init__(self, fetch: Fetch, ranges: list[tuple[int, int]]) -> None:
        self.fetch, self.ranges, self._next = fetch, ranges, 0

    def __aiter__(self) -> _OneByOne:
        return self

    async def __anext__(self) -> bytes:
        if self._next >= len(self.ranges):
            raise StopAsyncIteration
        start, end = self.ranges[self._next]
        self._next += 1
        return await self.fetch(start, end)


def read_ranges(fetch: Fetch, ranges: list[tuple[int, int]], ahead: int, spawn: Spawn | None) -> AsyncIterator[bytes]:
    """The bytes of `ranges` in order: through a `ReadWindow` of `ahead` requests when there is a
    task group to run them (`spawn`), more than one to overlap, and more than one range; else one
    request at a time."""
    if spawn is not None and ahead > 1 and len(ranges) > 1:
        return ReadWindow(fetch, ranges, ahead, spawn)
    return _OneByOne(fetch, ranges)
