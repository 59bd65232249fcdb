"""`patch_frame` then `patch_rows`: the loader's two steps (gather where the image is decoded,
temporal copies in collate) give the bytes of `patchify`, which tests/vision/test_image.py
checks against Hugging Face's processor, for every spec shape, into a batch buffer too."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream.vision import ImageSpec, patch_frame, patch_rows, patchify

SPECS = [
    ImageSpec(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=4096),
    ImageSpec(patch_size=2, merge_size=1, temporal_patch_size=1, min_pixels=4, max_pixels=4096),
    ImageSpec(patch_size=3, merge_size=2, temporal_patch_size=3, min_pixels=36, max_pixels=4096),
    ImageSpec(),
]


@settings(max_examples=80, deadline=None)
@given(spec=st.sampled_from(SPECS), blocks=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       seed=st.integers(0, 2**32 - 1))
def test_frame_then_rows_equal_patchify(spec: ImageSpec, blocks: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (blocks[0] * spec.factor, blocks[1] * spec.factor, 3), dtype=np.uint8)
    frame = patch_frame(image, spec)
    assert frame.shape == (len(patchify(image, spec)), 3, spec.patch_size ** 2)
    assert frame.nbytes == image.nbytes  # one frame: the image's bytes, reordered
    np.testing.assert_array_equal(patch_rows(frame, spec), patchify(image, spec))
    buffer = np.full((len(frame) + 2, spec.row_size), 7, np.uint8)  # a guard row each side
    got = patch_rows(frame, spec, buffer[1:-1])
    assert np.shares_memory(got, buffer)
    np.testing.assert_array_equal(buffer[1:-1], patchify(image, spec))
    assert (buffer[0] == 7).all() and (buffer[-1] == 7).all()


def test_patch_rows_refuses_what_is_not_a_frame() -> None:
    spec = ImageSpec()
    frame = patch_frame(np.zeros((28, 56, 3), np.uint8), spec)
    for bad in (frame.reshape(len(frame), -1), frame.astype(np.int16), frame[:, :2]):
        with pytest.raises(ValueError, match="patch_frame"):
            patch_rows(bad, spec)
    with pytest.raises(ValueError, match="uint8"):
        patch_rows(frame, spec, np.empty((len(frame) - 1, spec.row_size), np.uint8))
    with pytest.raises(ValueError, match="multiples"):
        patch_frame(np.zeros((27, 56, 3), np.uint8), spec)
