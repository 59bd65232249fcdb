"""Feed: one source's documents for one lane, read ahead by a producer task, handed out one by one.

```
producer task: read split -> parse -> tokenize --[buffer batches]--> Feed.next() -> one document
```

The producer starts at the feed's cursor when the lane calls `start`, after `restore`, and runs
ahead by at most `buffer` batches. The state is the cursor of the next document not handed out
yet, `(split position in the lane, decoded offset)`, so what the producer has read ahead is
never in a checkpoint: it is read again after a restore.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from zephon_stream.engine.operator import Resolve, refuse
from zephon_stream.operators.types import Doc

__all__ = ["Feed", "FeedState"]

Produce = Callable[[int, int, Any], Awaitable[None]]  # (position, offset, send stream of list[Doc])


class FeedState(msgspec.Struct, frozen=True, array_like=True):
    position: int  # split position in the lane's sequence for the source
    offset: int  # decoded offset of the next document in that split


class Feed:
    def __init__(self, produce: Produce, buffer: int) -> None:
        self.produce, self.buffer = produce, buffer
        self.cursor = (0, 0)
        self._recv: anyio.abc.ObjectReceiveStream[list[Doc]] | None = None
        self._batch: list[Doc] = []
        self._i = 0

    def __repr__(self) -> str:
        return f"Feed(cursor={self.cursor}, buffer={self.buffer})"

    def start(self, spawn: Callable[..., Any]) -> anyio.abc.ObjectReceiveStream[list[Doc]]:
        """Start the producer at the cursor in `spawn` (a task group's start_soon); returns the
        receiving end, for the caller to close when the lane ends."""
        send, self._recv = anyio.create_memory_object_stream[list[Doc]](self.buffer)
        spawn(self.produce, *self.cursor, send)
        return self._recv

    async def next(self) -> Doc | None:
        while self._i >= len(self._batch):
            try:
                self._batch, self._i = await self._recv.receive(), 0
            except anyio.EndOfStream:
                return None
        doc = self._batch[self._i]
        self._i += 1
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
