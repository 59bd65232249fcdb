"""Messages over pipes, read and written on the event loop: no thread hand-off per message.

A worker process sends a lane's batch in one message and gets a credit back for it: on the bench
text (one epoch, 12 lanes, two workers) about 800 of each per worker, 84% of its thread hand-offs.
Sent or read by a blocking call in a worker thread, each cost a hand-off on both sides (a wake-up
of the loop, the GIL passed back and forth). Here the loop waits until the pipe is readable or
writable (`anyio.wait_readable`, `wait_writable`) and moves what it can without blocking. In
`perf` samples of whole epochs, alternating, the loader's Python-side CPU fell from 0.199 and
0.202 of the tokenizer threads' to 0.185 and 0.189 (the threads backend: 0.11).

The framing is `multiprocessing.Connection.send_bytes`': a 4-byte big-endian length (-1, then 8
bytes, for 2 GiB and more), then the bytes; so either side may also use a Connection's own calls,
as a worker does to report an error after its loop has ended. Where pipes are not file
descriptors (`ON_LOOP` False: Windows), the callers keep their blocking calls in threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import anyio

__all__ = ["ON_LOOP", "Credits", "read_message", "write_message"]

#: Whether pipes can be waited on by the event loop here (POSIX file descriptors).
ON_LOOP = os.name == "posix"

_LONG = 0x7FFFFFFF  # longer messages carry -1 and an 8-byte length


async def write_message(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write one framed message to the non-blocking pipe `fd`, waiting for room as the reader drains it.

    A message once begun is finished even if the caller is cancelled meanwhile (the wait for room
    is shielded from then on): a message cut short would garble the framing of whatever follows
    it on the pipe, such as a worker's report of the error that cancelled it. The reader either
    drains the pipe or closes it, which ends the wait with BrokenPipeError. Raises what the write
    raises."""
    body = memoryview(data).cast("B")
    size = body.nbytes
    header = size.to_bytes(4, "big") if size <= _LONG else b"\xff\xff\xff\xff" + size.to_bytes(8, "big")
    parts = [memoryview(header), body]
    begun = False
    while parts:
        try:
            n = os.writev(fd, parts)
        except BlockingIOError:
            with anyio.CancelScope(shield=begun):
                await anyio.wait_writable(fd)
            continue
        begun = True
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


async def read_message(fd: int) -> bytearray:
    """Read one framed message from the non-blocking pipe `fd` into one buffer, read in place.

    Raises EOFError when the writer closes the pipe before or inside a message."""
    size = int.from_bytes(await _read_exactly(fd, 4, first=True), "big", signed=True)
    if size == -1:
        size = int.from_bytes(await _read_exactly(fd, 8), "big")
    return await _read_exactly(fd, size)


async def _read_exactly(fd: int, size: int, first: bool = False) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        try:
            n = os.readv(fd, [view[got:]])
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if n == 0:
            raise EOFError("the pipe closed" if first and not got else "the pipe closed mid-message")
        got += n
    return buf


class Credits:
    """Reads the 4-byte little-endian numbers (lanes) that the other end writes to the non-blocking
    pipe `fd` as they come, all that are waiting at once, and calls `take(number)` for each, in order."""

    def __init__(self, fd: int, take: Callable[[int], None]) -> None:
        self.fd, self.take = fd, take
        self._rest = b""

    async def run(self) -> None:
        """Until the other end closes the pipe (returns) or this task is cancelled."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                await anyio.wait_readable(self.fd)
                continue
            if not chunk:
                return
            data = self._rest + chunk
            whole = len(data) - len(data) % 4
            for at in range(0, whole, 4):
                self.take(int.from_bytes(data[at:at + 4], "little"))
            self._rest = data[whole:]
