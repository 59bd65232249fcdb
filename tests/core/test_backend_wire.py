"""The processes backend's wire: messages read in place match multiprocessing's own framing, and a
batch of image samples comes back with the same bytes and shapes, its pixels viewing the message."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

from zephon_stream.loader import backends
from zephon_stream.loader.state import LaneState
from zephon_stream.operators.types import Sample


@pytest.mark.parametrize("size", [0, 1, 4096, 65535, 65536, 3 << 20])
def test_a_message_read_in_place_is_what_send_bytes_sent(size):
    r, w = multiprocessing.Pipe(duplex=False)
    backends._widen(r)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    writer = threading.Thread(target=lambda: (w.send_bytes(data), w.send_bytes(b"next")))
    writer.start()
    got = backends._recv_message(r)
    assert bytes(got) == data and isinstance(got, bytearray)
    assert bytes(backends._recv_message(r)) == b"next"  # the framing of the next message is intact
    writer.join()
    w.close()
    with pytest.raises(EOFError):
        backends._recv_message(r)


def test_a_pipe_closed_mid_message_is_end_of_file():
    r, w = multiprocessing.Pipe(duplex=False)
    w._send((100).to_bytes(4, "big") + b"only ten b")  # a length header promising more than comes
    w.close()
    with pytest.raises(EOFError, match="mid-message"):
        backends._recv_message(r)


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
