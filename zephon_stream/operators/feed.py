"""Feed: one source's documents for one lane, read ahead by a producer task, handed out one by one.

```
producer task: read split -> parse -> tokenize --[buffer batches]--> Feed.next() -> one document
```

The producer starts at the feed's cursor when the lane calls `start`, after `restore`, and runs
ahead by at most `buffer` batches. The state is the cursor of the next document not handed out
yet, `(split position in the lane, decoded offset)`, so what the producer has read ahead is
never in a checkpoint: it is read again after a restore. With `piece_tokens` the producer hands
out a longer document as pieces (references of five ints, the fifth the piece's first token),
and a cursor inside such a document has a third element, the tokens of it already handed out.

The read-ahead grows with what the lane takes: before each tokenizer call the producer asks
`send.room(most)`, which waits until fewer than `max(1, taken)` documents it sent are not taken
yet (`taken`: documents handed out since `start`), and says how many the call may take. So a
lane that has just started (or restored) reads one document ahead, then two, four, ... up to
`buffer` batches of `most`: its first documents do not wait behind every lane's full
read-ahead on the shared CPU threads. A call waits until half the read-ahead's current size
(at most `most`) is free, so that once it has grown the calls are whole batches of `most`, not
top-ups of the few documents the lane took since the last one (per image: 2.3 documents a
decode call, and a CPU hand-off each, with a faster hand-off). What the feed hands out does not
depend on any of it.

```
taken    0  1  2  4  8 ...   the lane's pulls
room     1  1  2  4  8 ...   documents the next tokenizer call may take (at most `most`)
least    1  1  1  2  4 ...   the fewest it waits for: half the read-ahead, at most `most`
```

While `lean()` says so (`Feed.lean`: the loader's first step, see `loader.lane.FirstStep`), the
feed reads nothing ahead: the producer makes one document at a time, and only while the lane
waits in `next` for it. A lane's first batch then costs the CPU threads only the documents it
takes, and the documents other lanes still wait for are not queued behind read-ahead (after a
restore at step 10 on the bench data read-ahead had been half the tokens tokenized before the
first batch). Again, what the feed hands out does not change.

A producer that meets a DataError (a bad record in error mode) ends the feed with it, after the
documents before it (`FeedSender.fail`): `next` raises it once the lane has taken those, so the
error comes where the lane's order reaches the bad record, not when the read-ahead met it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from zephon_stream.engine.operator import Resolve, refuse
from zephon_stream.operators.types import ChatDoc, Doc, DocRef, ImageDoc

__all__ = ["Feed", "FeedSender", "FeedState", "cut", "piece_of"]

Produce = Callable[[int, int, int, "FeedSender"], Awaitable[None]]  # (position, offset, piece, where to send)


class FeedState(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    position: int  # split position in the lane's sequence for the source
    offset: int  # decoded offset of the next document in that split
    piece: int = 0  # its tokens already handed out as pieces (piece_tokens); absent when 0


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

    def room_now(self, most: int) -> int:
        """The documents (at most `most`) a call could take now without waiting; 0 or less: none."""
        room = self._feed._allowed(most)
        return min(most, room) if room >= self._feed._least(most) else min(0, room)

    async def send(self, docs: list[Doc]) -> None:
        self._feed._sent += len(docs)
        await self._stream.send(docs)

    async def fail(self, error: BaseException) -> None:
        """End the feed with `error`, after the documents sent so far: the lane's `next` raises it
        once it has taken them (see `TextLane._read_source`)."""
        await self._stream.send(error)  # type: ignore[arg-type]


class Feed:
    def __init__(self, produce: Produce, buffer: int, piece_tokens: int = 0) -> None:
        self.produce, self.buffer, self.piece_tokens = produce, buffer, piece_tokens
        self.cursor = (0, 0, 0)
        self._recv: anyio.abc.ObjectReceiveStream[list[Doc]] | None = None
        self._batch: list[Doc] = []
        self._i = 0
        self.taken = 0  # documents handed out since `start`
        self._sent = 0  # documents the producer sent since `start`
        self._took: anyio.Event | None = None  # set once a take makes room, while the producer waits for it
        self._most = 1  # what the waiting producer's call may take
        self._lean: Callable[[], bool] | None = None  # while it says so: no read-ahead (see the module docstring)
        self._wanted = False  # the lane waits in `next` for a document not sent yet
        self._failed: BaseException | None = None  # what the producer failed with, after its last document

    def __repr__(self) -> str:
        return f"Feed(cursor={self.cursor}, buffer={self.buffer})"

    def start(self, spawn: Callable[..., Any]) -> anyio.abc.ObjectReceiveStream[list[Doc]]:
        """Start the producer at the cursor in `spawn` (a task group's start_soon); returns the
        receiving end, for the caller to close when the lane ends."""
        send, self._recv = anyio.create_memory_object_stream[list[Doc]](self.buffer)
        self.taken = self._sent = 0
        spawn(self.produce, *self.cursor, FeedSender(self, send))
        return self._recv

    def lean(self, until: Callable[[], bool]) -> None:
        """Read nothing ahead while `until()` is true: make a document only when the lane waits for one."""
        self._lean = until

    def _target(self, most: int) -> int:
        """How many documents the read-ahead may hold now: grown with what the lane took (up to
        `buffer` calls of `most`), or, lean, the one the lane waits for (none while it does not)."""
        if self._lean is not None and self._lean():
            return int(self._wanted)
        return max(1, min(self.taken, self.buffer * most))

    def _allowed(self, most: int) -> int:
        return self._target(most) - (self._sent - self.taken)

    def _wake(self) -> None:
        # only once the waiting call may go: a producer woken at every take to wait again cost a
        # task switch a document (text: 10% of the loader's tokens per CPU-second)
        if self._took is not None and self._allowed(self._most) >= self._least(self._most):
            self._took.set()
            self._took = None

    def _least(self, most: int) -> int:
        """The fewest documents a call waits for: half the read-ahead's current size, at most `most`."""
        return max(1, min(most, self._target(most) // 2))

    async def _room(self, most: int) -> int:
        while (room := self._allowed(most)) < self._least(most):
            self._took, self._most = anyio.Event(), most
            await self._took.wait()
        return min(most, room)

    async def next(self) -> Doc | None:
        if self._failed is not None:
            raise self._failed
        while self._i >= len(self._batch):
            self._wanted = True
            self._wake()  # a lean producer makes a document now
            try:
                got = await self._recv.receive()
            except anyio.EndOfStream:
                return None
            finally:
                self._wanted = False
            if isinstance(got, BaseException):  # the producer failed here (`FeedSender.fail`)
                self._failed = got
                raise got
            self._batch, self._i = got, 0
        doc = self._batch[self._i]
        self._i += 1
        self.taken += 1
        self._wake()
        ref = doc[0]
        if len(ref) == 5 and len(doc[1]) == self.piece_tokens:  # a whole piece: the document may go on
            self.cursor = (ref[1], ref[2], ref[4] + len(doc[1]))
        else:
            self.cursor = (ref[1], ref[2] + ref[3], 0)
        return doc

    def state(self) -> FeedState:
        return FeedState(*self.cursor)

    def refs(self, state: FeedState) -> list[object]:
        return []

    def restore(self, state: FeedState, resolve: Resolve) -> None:
        if state.position < 0 or state.offset < 0 or state.piece < 0:
            refuse("cursor", (state.position, state.offset, state.piece), "a split position, offset and piece must "
                   "be >= 0")
        if state.piece and (not self.piece_tokens or state.piece % self.piece_tokens):
            refuse("cursor", (state.position, state.offset, state.piece), f"a piece starts at a multiple of "
                   f"piece_tokens = {self.piece_tokens} (and only when it is set)")
        self.cursor = (state.position, state.offset, state.piece)


def cut(docs: list[Doc], size: int, skip: int = 0) -> list[Doc]:
    """Each text document longer than `size` tokens as pieces of `size` tokens (the last one
    shorter), each with its reference plus its first token; shorter documents and image
    documents as they are. `skip`: tokens of the first document already handed out (a cursor
    inside it), refused unless they end at a piece boundary of a document that is cut."""
    out: list[Doc] = []
    for k, (ref, tokens) in enumerate(docs):
        start = skip if k == 0 else 0
        n = len(tokens)
        if n <= size or isinstance(tokens, ImageDoc):
            if start:
                refuse("piece", start, f"document {tuple(ref)} ({n} tokens) is not cut into pieces of {size}")
            out.append((ref, tokens))
            continue
        if start % size or start > n:
            refuse("piece", start, f"pieces of document {tuple(ref)} ({n} tokens) start at multiples of {size}")
        out += [((*ref, a), _slice(tokens, a, a + size)) for a in range(start, n, size)]
    return out


def piece_of(ref: DocRef, tokens: Any, size: int) -> Any:
    """The tokens of the piece `ref` names (five ints) of a document's `tokens`, as `cut` made it."""
    start, n = ref[4], len(tokens)
    if not size or n <= size or isinstance(tokens, ImageDoc) or start % size or not 0 <= start < n:
        refuse("piece", tuple(ref), f"no piece of document {tuple(ref[:4])} ({n} tokens) starts at token {start} "
               f"with piece_tokens = {size}")
    return _slice(tokens, start, start + size)


def _slice(tokens: Any, begin: int, end: int) -> Any:
    if isinstance(tokens, ChatDoc):
        return ChatDoc(tokens.ids[begin:end], tokens.trained[begin:end])
    return tokens[begin:end]
