"""The processes backend's wire: messages written and read on the event loop (`engine.pipes`) match
multiprocessing's own framing both ways, credits are read whole, and a batch of image samples
comes back with the same bytes and shapes, its pixels viewing the message."""

from __future__ import annotations

import array
import fcntl
import multiprocessing
import os
import termios
import threading

import anyio
import numpy as np
import pytest

from zephon_stream.engine import pipes
from zephon_stream.loader import backends
from zephon_stream.loader.state import LaneState
from zephon_stream.operators.types import Sample


def _nonblocking_pipe():
    r, w = multiprocessing.Pipe(duplex=False)
    backends._widen(r)
    os.set_blocking(r.fileno(), False)
    os.set_blocking(w.fileno(), False)
    return r, w


@pytest.mark.parametrize("size", [0, 1, 4096, 65535, 65536, 3 << 20])
def test_a_message_read_on_the_loop_is_what_send_bytes_sent(size):
    r, w = multiprocessing.Pipe(duplex=False)
    backends._widen(r)
    os.set_blocking(r.fileno(), False)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    writer = threading.Thread(target=lambda: (w.send_bytes(data), w.send_bytes(b"next")))
    writer.start()

    async def main():
        got = await pipes.read_message(r.fileno())
        assert bytes(got) == data and isinstance(got, bytearray)
        assert bytes(await pipes.read_message(r.fileno())) == b"next"  # the framing of the next message is intact
        writer.join()
        w.close()
        with pytest.raises(EOFError, match="closed$"):
            await pipes.read_message(r.fileno())

    anyio.run(main)


@pytest.mark.parametrize("size", [0, 1, 65536, 3 << 20])
def test_a_message_written_on_the_loop_is_what_recv_bytes_reads(size):
    """Larger than the pipe's buffer too: the writer waits for room while the reader drains it."""
    r, w = _nonblocking_pipe()
    os.set_blocking(r.fileno(), True)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    got = []
    reader = threading.Thread(target=lambda: got.extend([r.recv_bytes(), r.recv_bytes()]))
    reader.start()

    async def main():
        await pipes.write_message(w.fileno(), data)
        await pipes.write_message(w.fileno(), memoryview(b"next"))

    anyio.run(main)
    reader.join()
    assert got == [data, b"next"]


def test_a_message_begun_is_finished_when_its_writer_is_cancelled():
    """Cancelled while it waits for room in the middle of a message, the writer still finishes that
    message, so what follows on the pipe (a worker's error report) is framed intact."""
    r, w = _nonblocking_pipe()
    os.set_blocking(r.fileno(), True)
    data = bytes(range(256)) * (3 << 12)  # 3 MiB: more than the pipe holds, so the writer must wait mid-message
    got, finished = [], []

    def read():
        try:
            got.extend([r.recv_bytes(), r.recv_bytes()])
        except EOFError:  # a message cut short swallowed what followed: the framing is garbled
            got.append("end of file")

    async def write():
        await pipes.write_message(w.fileno(), data)
        finished.append(True)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await anyio.wait_all_tasks_blocked()  # nobody reads yet: the writer filled the pipe and waits
            assert _buffered(r) > 0
            tg.cancel_scope.cancel()  # mid-message
            reader.start()  # now drain, so that it can finish

    reader = threading.Thread(target=read, daemon=True)
    anyio.run(main)
    os.set_blocking(w.fileno(), True)
    w.send_bytes(b"the error report")
    w.close()
    reader.join(10)
    assert finished and len(got) == 2 and got[0] == data and got[1] == b"the error report"


def _buffered(conn) -> int:
    """Bytes waiting in the pipe behind `conn`."""
    out = array.array("i", [0])
    fcntl.ioctl(conn.fileno(), termios.FIONREAD, out)
    return out[0]


def test_a_pipe_closed_mid_message_is_end_of_file():
    r, w = _nonblocking_pipe()
    os.set_blocking(w.fileno(), True)
    w._send((100).to_bytes(4, "big") + b"only ten b")  # a length header promising more than comes
    w.close()
    with pytest.raises(EOFError, match="mid-message"):
        anyio.run(pipes.read_message, r.fileno())


def test_credits_are_read_whole_however_the_bytes_arrive():
    """Lane numbers written one by one, in bursts and split across reads: each taken once, in order."""
    r, w = _nonblocking_pipe()
    os.set_blocking(w.fileno(), True)
    lanes = [0, 7, 3, 70000, 1, 1, 2]
    raw = b"".join(n.to_bytes(4, "little") for n in lanes)
    taken = []

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipes.Credits(r.fileno(), taken.append).run)
            for part in (raw[:3], raw[3:9], raw[9:20], raw[20:]):  # cuts inside numbers
                os.write(w.fileno(), part)
                await anyio.wait_all_tasks_blocked()  # the reader took these bytes and waits for more
            w.close()  # the reader returns at the end of the pipe

    anyio.run(main)
    assert taken == lanes


def _sample(lane: int, seed: int) -> Sample:
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, (n, 3, 196), dtype=np.uint8) for n in (4, 16)]
    ids = rng.integers(0, 1000, 32, dtype=np.uint32)
    return Sample(ids, ids.astype(np.int32), np.arange(32, dtype=np.int32), [12, 20], 32, lane, seed,
                  LaneState.initial(lane, 1), frames, [(1, 2, 2), (1, 4, 4)], np.zeros(32, np.uint8), [0, 0])


def test_image_samples_cross_the_wire_unchanged_and_their_pixels_are_not_copied():
    batch = [_sample(3, 1), _sample(3, 2)]
    raw = bytearray(backends._pack(3, batch))
    back = backends._unpack(backends._dec.decode(raw))
    for a, b in zip(batch, back):
        for x, y in zip(a.images, b.images):
            assert x.shape == y.shape and np.array_equal(x, y)
            assert y.base is not None and np.shares_memory(y, np.frombuffer(raw, np.uint8))
        assert np.array_equal(a.input_ids, b.input_ids) and a.grids == b.grids and a.index == b.index
