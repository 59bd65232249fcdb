"""The writer half of the seekable JSONL.zst format that the loader reads.

A shard is a run of independent zstd frames, each of whole JSON lines, followed by a zstd
*seekable format* seek table (a skippable frame, so any zstd reader ignores it):

```
| frame 0: lines 0..k | frame 1: lines k+1..m | ... | seek table: (compressed, decompressed) per frame |
```

Frames let the planner cut one shard into many splits, and the seek table lets it find every
frame with one small ranged read of the shard's tail. `write_jsonl_shards` writes such shards
(or plain `.jsonl`) from documents.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import msgspec
import zstandard

from zephon_stream.operators.read import seek_table

__all__ = ["write_jsonl_shards"]


def write_jsonl_shards(
    docs: Sequence[tuple[str, str]],
    out_dir: str | os.PathLike[str],
    *,
    name: str,
    shards: int,
    compress: str = "none",
    frame_bytes: int = 256 * 1024,
    text_field: str = "text",
) -> list[Path]:
    """Write `docs` (pairs of id and text) as `{name}-{i:05d}.jsonl` (or `.jsonl.zst`) shards and
    return their paths.

    One JSON object per line, `{"id": doc_id, text_field: text}`. Shards hold contiguous runs of
    `docs` of about equal bytes (in order, so reading the shards in order gives `docs` back).
    `compress="zst"` writes multi-frame zstd: a new independent frame starts every ~`frame_bytes`
    of uncompressed input, always at a line boundary, so each frame decodes to whole lines; a
    seek table closes the shard. Each shard is written to a temporary name and renamed.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if compress not in ("none", "zst"):
        raise ValueError(f"compress must be 'none' or 'zst', got {compress!r}")
    if frame_bytes < 1:
        raise ValueError(f"frame_bytes must be >= 1, got {frame_bytes}")
    if text_field == "id":
        raise ValueError("text_field must differ from 'id'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    enc = msgspec.json.Encoder()
    lines = [enc.encode({"id": doc_id, text_field: text}) + b"\n" for doc_id, text in docs]
    suffix = ".jsonl.zst" if compress == "zst" else ".jsonl"
    paths: list[Path] = []
    for i, (start, stop) in enumerate(_blocks([len(b) for b in lines], shards)):
        path = out / f"{name}-{i:05d}{suffix}"
        block = lines[start:stop]
        atomic_write(path, _zst_frames(block, frame_bytes) if compress == "zst" else block)
        paths.append(path)
    return paths


def atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to `path` through a temporary file in the same directory and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.writelines(chunks)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _blocks(sizes: Sequence[int], shards: int) -> list[tuple[int, int]]:
    """Cut `len(sizes)` items into `shards` contiguous `[start, stop)` blocks of about equal bytes.

    No block is empty unless there are fewer items than shards.
    """
    n = len(sizes)
    cum = list(itertools.accumulate(sizes, initial=0))
    bounds = [0]
    for k in range(1, shards):
        target = cum[-1] * k / shards
        i = bisect.bisect_left(cum, target)
        if i > 0 and target - cum[i - 1] < cum[min(i, n)] - target:
            i -= 1
        lo, hi = (bounds[-1] + 1, n - (shards - k)) if n >= shards else (bounds[-1], n)
        bounds.append(min(max(i, lo), hi))
    bounds.append(n)
    return list(itertools.pairwise(bounds))


def _zst_frames(lines: Iterable[bytes], frame_bytes: int) -> Iterator[bytes]:
    """Independent zstd frames (level 3, content size in the header), each of whole lines and about
    `frame_bytes` of input (a line longer than that gets a frame of its own), then a seek table."""
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True)
    buf: list[bytes] = []
    size = 0
    wrote = False
    sizes: list[tuple[int, int]] = []

    def frame(raw: bytes) -> bytes:
        out = cctx.compress(raw)
        sizes.append((len(out), len(raw)))
        return out

    for line in lines:
        if buf and size + len(line) > frame_bytes:
            yield frame(b"".join(buf))
            wrote = True
            buf, size = [], 0
        buf.append(line)
        size += len(line)
    if buf or not wrote:  # an empty shard is one empty frame: still a valid zstd stream
        yield frame(b"".join(buf))
    yield seek_table(sizes)  # the shard's frame index, so a reader plans it with one ranged read
