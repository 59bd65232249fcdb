"""Fuzz `codec._raw_blocks`, the reader of zstd frames stored as raw blocks (a keyframe's low
byte planes are read in place through it, not decompressed): whatever the bytes, it gives either
None (the frame then goes through zstd, which checks it) or exactly `size` bytes, and those are
the bytes zstd decodes from the same frame whenever zstd accepts it."""

from __future__ import annotations

import os

import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream.refit import codec


def _raw_frame(content: bytes) -> bytes:
    """A frame of raw blocks (noise does not compress: zstd stores it raw)."""
    return zstandard.ZstdCompressor(level=1, write_checksum=False).compress(content)


SIZES = [1, 300, 5000, (1 << 17) + 7]  # the last spans two blocks
FRAMES = {n: (content := os.urandom(n), _raw_frame(content)) for n in SIZES}


def _zstd(frame: bytes, size: int) -> bytes | None:
    try:
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError:
        return None


def test_raw_frames_are_read_in_place():
    for n, (content, frame) in FRAMES.items():
        got = codec._raw_blocks(memoryview(frame), n)
        assert got is not None and b"".join(got) == content, n


@settings(max_examples=300, deadline=None)
@given(size=st.sampled_from(SIZES), edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                                   max_size=4),
       cut=st.integers(0, 8), extra=st.binary(max_size=3))
def test_a_damaged_raw_frame_gives_none_or_what_zstd_gives(size, edits, cut, extra):
    _, frame = FRAMES[size]
    damaged = bytearray(frame)
    for at, value in edits:
        damaged[at % len(damaged)] = value
    damaged = bytes(damaged[: len(damaged) - cut]) + extra
    got = codec._raw_blocks(memoryview(damaged), size)
    if got is None:
        return
    content = b"".join(got)
    assert len(content) == size
    decoded = _zstd(damaged, size)
    if decoded is not None:
        assert decoded == content


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=600), size=st.integers(0, 600), magic=st.booleans())
def test_any_bytes_give_none_or_the_declared_size(data, size, magic):
    data = codec._ZSTD_MAGIC + data if magic else data  # past the magic, into the header and blocks
    got = codec._raw_blocks(memoryview(data), size)
    if got is not None:
        assert sum(map(len, got)) == size
        decoded = _zstd(data, size)
        assert decoded is None or decoded == b"".join(got)
