"""`patchify(image, spec, out)`: the rows written into a slice of a batch's buffer, as collate does.

The rows must be the bytes `patchify(image, spec)` returns (which tests/vision/test_image.py
checks against Hugging Face's processor), for every spec shape (temporal 1, 2 and 3, merge 1
and 2), next to other images in the same buffer and touching nothing outside their slice.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream.vision import ImageSpec, patchify

SPECS = [
    ImageSpec(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=4096),
    ImageSpec(patch_size=2, merge_size=1, temporal_patch_size=1, min_pixels=4, max_pixels=4096),
    ImageSpec(patch_size=3, merge_size=2, temporal_patch_size=3, min_pixels=36, max_pixels=4096),
    ImageSpec(),
]


def _image(rng: np.random.Generator, spec: ImageSpec, blocks_h: int, blocks_w: int) -> np.ndarray:
    return rng.integers(0, 256, (blocks_h * spec.factor, blocks_w * spec.factor, 3), dtype=np.uint8)


def _reference(image: np.ndarray, spec: ImageSpec) -> np.ndarray:
    """The rows by the definition (gather every frame from the image), independent of patchify."""
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = image.shape[0] // p, image.shape[1] // p
    blocks = image.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return frames.reshape(gh * gw, 3 * t * p * p)


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(SPECS), sizes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1,
                                                   max_size=5), seed=st.integers(0, 2**32 - 1))
def test_rows_written_into_a_batch_buffer_equal_patchify(spec: ImageSpec, sizes: list[tuple[int, int]],
                                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    images = [_image(rng, spec, h, w) for h, w in sizes]
    expected = [_reference(im, spec) for im in images]
    buffer = np.full((sum(len(e) for e in expected) + 2, spec.row_size), 7, np.uint8)  # a guard row each side
    at = 1
    for image, rows in zip(images, expected):
        got = patchify(image, spec, buffer[at:at + len(rows)])
        assert got.base is not None and np.shares_memory(got, buffer)  # written in place, not copied
        at += len(rows)
    np.testing.assert_array_equal(buffer[1:-1], np.concatenate(expected))
    assert (buffer[0] == 7).all() and (buffer[-1] == 7).all()
    for image, rows in zip(images, expected):
        np.testing.assert_array_equal(patchify(image, spec), rows)


def test_patchify_refuses_an_out_it_cannot_fill() -> None:
    spec = ImageSpec()
    image = np.zeros((28, 56, 3), np.uint8)  # 2 x 4 patches: 8 rows
    for bad in (np.empty((7, spec.row_size), np.uint8), np.empty((8, spec.row_size), np.int16),
                np.empty((8, 2 * spec.row_size), np.uint8)[:, ::2]):
        with pytest.raises(ValueError, match="writable C-contiguous uint8"):
            patchify(image, spec, bad)
    frozen = np.empty((8, spec.row_size), np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        patchify(image, spec, frozen)
