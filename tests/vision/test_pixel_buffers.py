"""The pooled memory behind `pixel_values` (`operators.collate.PixelBuffers`).

A buffer goes back to work only once nothing refers to the batch on it: never while a tensor,
a view, a `.numpy()` or a slice of the batch's pixels is alive. End to end, a loader's batches
kept alive keep their pixels while later batches are made (tests/core/test_vision.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zephon_stream.operators.collate import PixelBuffers


def _batch_on(pool: PixelBuffers, rows: int, width: int = 8) -> torch.Tensor:
    out = pool.take(rows, width)
    out[:] = rows % 251  # collate writes every row
    return torch.from_numpy(out)


@pytest.mark.parametrize("keep_alive", [
    lambda t: t,  # the tensor itself
    lambda t: t[1:3],  # a view of it
    lambda t: t.numpy(),  # an array on its storage
    lambda t: t.numpy()[::2],  # a view of that array
    lambda t: t.view(torch.int8).reshape(-1),  # a reinterpreting view
])
def test_a_buffer_is_not_reused_while_anything_refers_to_its_batch(keep_alive):
    pool = PixelBuffers(keep=2)
    held = keep_alive(_batch_on(pool, 10))
    before = bytes(np.asarray(held).tobytes())
    for rows in (4, 10, 12):
        other = pool.take(rows, 8)
        assert not np.shares_memory(other, np.asarray(held))
        other[:] = 255
    assert np.asarray(held).tobytes() == before


def test_a_released_buffer_is_reused_and_the_pool_stays_bounded():
    pool = PixelBuffers(keep=2)
    first = _batch_on(pool, 10)
    address = first.data_ptr()
    del first
    again = _batch_on(pool, 9)  # fits in the released one (it has room for a quarter more rows)
    assert again.data_ptr() == address
    alive = [again] + [_batch_on(pool, 10) for _ in range(4)]  # more batches alive than the pool keeps
    assert len(pool._pool) == 2
    assert len({t.data_ptr() for t in alive}) == len(alive)


def test_a_larger_batch_replaces_a_free_buffer_that_is_too_small():
    pool = PixelBuffers(keep=1)
    small = _batch_on(pool, 4)
    del small
    big = _batch_on(pool, 100)
    assert big.shape == (100, 8) and len(pool._pool[0]) >= 100 * 8
    del big
    assert _batch_on(pool, 30).shape == (30, 8)
    assert len(pool._pool) == 1


def test_keep_zero_pools_nothing():
    pool = PixelBuffers(keep=0)
    assert _batch_on(pool, 5).shape == (5, 8)
    assert pool._pool == []
    assert PixelBuffers(keep=2).take(0, 8).shape == (0, 8)  # a batch without images
    with pytest.raises(ValueError, match="keep"):
        PixelBuffers(keep=-1)

