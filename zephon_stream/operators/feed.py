"""Feed: one source's documents for one lane, read ahead by a producer task, handed out one by one.

```
producer task: read split -> parse -> tokenize --[buffer batches]--> Feed.next() -> one document
```

The producer starts at the feed's cursor when the lane calls `start`, after `restore`, and runs
ahead by at most `buffer` batches. The state is the cursor of the next document not handed out
yet, `(split position in the lane, decoded offset)`, so what the producer has read ahead is
never in a checkpoint: it is read again after a restore.

The read-ahead grows with what the lane takes: before each tokenizer call the producer asks
`send.room(most)`, which waits until fewer than `max(1, taken)` documents it sent are not taken
yet (`taken`: documents handed out since `start`), and says how many the call may take. So a
lane that has just started (or restored) reads one document ahead, then two, four, ... up to
`buffer` batches of `most`: its first documents do not wait behind every lane's full
read-ahead on the shared CPU threads. What the feed hands out does not depend on it.

```
taken    0  1  2  4  8 ...   the lane's pulls
room     1  1  2  4  8 ...   documents the next tokenizer call may take (at most `most`)
```
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from zephon_stream.engine.operator import Resolve, refuse
from zephon_stream.operators.types import Doc

__all__ = ["Feed", "FeedSender", "FeedState"]

Produce = Callable[[int, int, "FeedSender"], Awaitable[None]]  # (position, offset, where to send lists of Doc)


class FeedState(msgspec.Struct, frozen=True, array_like=True):
    position: int  # split position in the lane's sequence for the source
    offset: int  # decoded offset of the next document in that split


class FeedSender:
    """The producer's end of a feed: `room` before a tokenizer call, `send` its documents, close
    when done (`async with send:`)."""

    def __init__(self, feed: Feed, stream: anyio.abc.ObjectSendStream[list[Doc]]) -> None:
        self._feed, self._stream = feed, stream

    async def __aenter__(self) -> FeedSender:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stream.aclose()

    async def room(self, most: int) -> int:
        """Wait until the read-ahead may grow; the documents (1..most) the next call may take."""
        return await self._feed._room(most)

    async def send(self, docs: list[Doc]) -> None:
        self._feed._sent += len(docs)
        await self._stream.send(docs)


class Feed:
    def __init__(self, produce: Produce, buffer: int) -> None:
        self.produce, self.buffer = produce, buffer
        self.cursor = (0, 0)
        self._recv: anyio.abc.ObjectReceiveStream[list[Doc]] | None = None
        self._batch: list[Doc] = []
        self._i = 0
        self.taken = 0  # documents handed out since `start`
        self._sent = 0  # documents the producer sent since `start`
        self._took: anyio.Event | None = None  # set at the next take, while the producer waits for room

    def __repr__(self) -> str:
        return f"Feed(cursor={self.cursor}, buffer={self.buffer})"

    def start(self, spawn: Callable[..., Any]) -> anyio.abc.ObjectReceiveStream[list[Doc]]:
        """Start the producer at the cursor in `spawn` (a task group's start_soon); returns the
        receiving end, for the caller to close when the lane ends."""
        send, self._recv = anyio.create_memory_object_stream[list[Doc]](self.buffer)
        self.taken = self._sent = 0
        spawn(self.produce, *self.cursor, FeedSender(self, send))
        return self._recv

    async def _room(self, most: int) -> int:
        while (room := max(1, min(self.taken, self.buffer * most)) - (self._sent - self.taken)) < 1:
            self._took = anyio.Event()
            await self._took.wait()
        return min(most, room)

    async def next(self) -> Doc | None:
        while self._i >= len(self._batch):
            try:
                self._batch, self._i = await self._recv.receive(), 0
            except anyio.EndOfStream:
                return None
        doc = self._batch[self._i]
        self._i += 1
        self.taken += 1
        if self._took is not None:
            self._took.set()
            self._took = None
        _, position, offset, length = doc[0]
        self.cursor = (position, offset + length)
        return doc

    def state(self) -> FeedState:
        return FeedState(*self.cursor)

    def refs(self, state: FeedState) -> list[object]:
        return []

    def restore(self, state: FeedState, resolve: Resolve) -> None:
        if state.position < 0 or state.offset < 0:
            refuse("cursor", (state.position, state.offset), "a split position and offset must be >= 0")
        self.cursor = (state.position, state.offset)
