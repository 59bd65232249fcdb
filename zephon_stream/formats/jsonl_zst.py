"""The seekable JSONL.zst format: its reader (frames, seek table, a bounded streaming decoder) and writer.

A shard is a run of independent zstd frames, each of whole JSON lines, followed by a zstd
*seekable format* seek table (a skippable frame, so any zstd reader ignores it):

```
| frame 0: lines 0..k | frame 1: lines k+1..m | ... | seek table: (compressed, decompressed) per frame |
```

Frames let the planner cut one shard into many splits, and the seek table lets it find every
frame with one small ranged read of the shard's tail (`read_seek_table`; `walk_frames` finds
them in a shard without one). `ZstdStream` decodes frames fed in pieces of any size, one block
at a time, in bounded memory. `write_jsonl_shards` writes such shards (or plain `.jsonl`).
"""

from __future__ import annotations

import bisect
import itertools
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zstandard

from zephon_stream.connectors.base import Store
from zephon_stream.engine import threads
from zephon_stream.engine.files import atomic_write
from zephon_stream.errors import DataError

__all__ = ["DECODE_PIECE", "ZstdStream", "read_seek_entries", "read_seek_table", "seek_table", "walk_frames",
           "write_jsonl_shards"]

_ZSTD_MAGIC = 0xFD2FB528
_WALK_PART = 8 << 20  # reads of a shard whose frames are walked at planning
_HOLD = 1 << 20  # a frame's output held back until its end (its checksum) up to this size
_BLOCK_MAX = 128 << 10  # a zstd block never holds or decodes to more (RFC 8878 Block_Maximum_Size)
_MAX_WINDOW = 1 << 27  # libzstd's default limit: a frame that asks for a larger window is refused
_MIN_FRAME = 8  # the smallest frame (an empty skippable frame); a zstd frame takes 9 bytes or more
DECODE_PIECE = 1 << 20  # decoded bytes per zstd step


# ---- zstd frames ---------------------------------------------------------------------------------

_FRAME, _BLOCK, _CHECKSUM, _SKIP, _RESYNC = range(5)


class _Corrupt(Exception):
    """A frame that does not decode: ZstdStream turns it into a DataError (or skips the frame)."""


class ZstdStream:
    """Walks a run of zstd frames fed in pieces of any size, and decodes it one block at a time.

    Memory stays bounded whatever a frame declares: a block holds and decodes to at most 128 KiB,
    `pull` stops once it has about `limit` bytes, the buffer keeps at most one block beyond the
    piece fed, and the window is what the frame header asks, refused past `_MAX_WINDOW` (128 MiB).
    A declared content size is never used to allocate; zstd only checks it at the frame's end.

    `frames` (the plan's frame offsets, from a seek table or a walk) is checked as the walk goes:
    every frame must end exactly where the plan says the next one begins, so a wrong seek table
    is an error, never a silent loss. Without `frames` (`decode=False`, planning) the walk
    records each frame start in `starts`.

    A frame's output is held back until the frame ends (checksum checked) or `_HOLD` bytes are
    held, so a frame of up to 1 MiB is all or nothing. With `skip_corrupt`, `pull` returns a
    corrupt frame's error in place of its held output, and drops the rest of the frame (up to the
    next planned frame). What comes out before the error depends only on the frame's bytes
    (one block per zstd call, holds by decoded size), never on how the input was cut, so a
    corrupt frame is skipped the same way every time.
    """

    def __init__(self, key: str, start: int, frames: Sequence[int] | None = None, first: int = 0, *,
                 decode: bool = True, skip_corrupt: bool = False) -> None:
        self.key, self.frames, self.frame, self.skip_corrupt = key, frames, first, skip_corrupt
        self.offset = self.frame_start = start  # compressed offset of the next unconsumed byte / of the frame
        self.starts: list[int] = []
        self._buf, self._at = bytearray(), 0  # unconsumed bytes: self._buf[self._at:]
        self._state, self._left, self._check_bytes = _FRAME, 0, 0
        self._dctx = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW) if decode else None
        self._dobj: Any = None
        self._held: list[bytes] = []  # the current frame's output, not yet released
        self._held_size = 0

    def pull(self, limit: int, data: bytes = b"") -> tuple[bytes, DataError | None]:
        """Feed `data`, then decode whole units until about `limit` bytes are out or none is whole.

        Returns (decoded bytes, None); fewer than `limit` bytes means: feed more. With
        `skip_corrupt`, a corrupt frame returns (the bytes decoded before it, its DataError).
        """
        self._buf += data
        out: list[bytes] = []
        size = 0
        try:
            while size < limit and (piece := self._unit()) is not None:
                if piece:
                    self._held.append(piece)
                    self._held_size += len(piece)
                if self._held and (self._held_size >= _HOLD or self._state == _FRAME):  # big, or the frame ended
                    out += self._held
                    size += self._held_size
                    self._held, self._held_size = [], 0
        except (zstandard.ZstdError, _Corrupt) as exc:
            self._held, self._held_size = [], 0
            return b"".join(out), self._corrupt(exc)
        finally:
            del self._buf[:self._at]
            self._at = 0
        return b"".join(out), None

    def expect_end(self, end: int) -> None:
        """Check that the bytes fed so far end at compressed byte `end`, exactly between two frames."""
        left = len(self._buf) - self._at
        fed = self.offset + left
        if self._state == _FRAME and not left and fed == end:
            return
        if fed < end:
            raise DataError(f"{self.key!r} ends at byte {fed}, before byte {end} that its plan needs: the object "
                            "changed while being read; restart the loader", key=self.key, offset=fed)
        start = self.offset if self._state == _FRAME else self.frame_start
        if self.frames is None or end == self.frames[-1]:
            raise DataError(f"truncated .zst shard {self.key!r}: frame at byte {start} is cut off at byte {end}, "
                            "the end of its data: rewrite the shard", key=self.key, offset=start)
        raise self._mismatch(f"at byte {start} runs past byte {end}")

    # -- one unit at a time: a frame header, a block, a checksum, or skipped bytes

    def _unit(self) -> bytes | None:
        """Consume the next unit if the buffer holds all of it; what it decodes to. None: feed more."""
        avail = len(self._buf) - self._at
        if self._state in (_SKIP, _RESYNC):
            n = min(avail, self._left)
            if not n and self._left:
                return None
            self._at, self.offset, self._left = self._at + n, self.offset + n, self._left - n
            if not self._left:
                self._end_frame(check=self._state == _SKIP)
            return b""
        if self._state == _FRAME:
            return self._header(avail)
        if self._state == _BLOCK:
            return self._block(avail)
        return self._checksum(avail)

    def _header(self, avail: int) -> bytes | None:
        if avail < 4:
            return None
        buf, at = self._buf, self._at
        magic = struct.unpack_from("<I", buf, at)[0]
        self.frame_start = self.offset
        if 0x184D2A50 <= magic <= 0x184D2A5F:  # skippable frame: its size, then bytes nobody decodes
            if avail < 8:
                return None
            size = struct.unpack_from("<I", buf, at + 4)[0]
            self._within(8 + size)
            self._begin()
            self._take(8)
            self._state, self._left = _SKIP, size
            return b""
        if magic != _ZSTD_MAGIC:
            raise _Corrupt(f"bad frame magic {magic:#x}: not a zstd frame")
        if avail < 5:
            return None
        fhd = buf[at + 4]
        single = fhd >> 5 & 1
        n = 5 + (1 - single) + (0, 1, 2, 4)[fhd & 3] + (single, 2, 4, 8)[fhd >> 6]
        self._within(n)
        if avail < n:
            return None
        self._begin()
        header = self._take(n)
        self._state, self._check_bytes = _BLOCK, 4 if fhd & 4 else 0
        if self._dctx is None:
            return b""
        self._dobj = self._dctx.decompressobj()
        return self._dobj.decompress(header)

    def _block(self, avail: int) -> bytes | None:
        if avail < 3:
            return None
        buf, at = self._buf, self._at
        header = buf[at] | buf[at + 1] << 8 | buf[at + 2] << 16
        last, kind, size = header & 1, header >> 1 & 3, header >> 3
        if kind == 3:
            raise _Corrupt(f"reserved block type at byte {self.offset}")
        if size > _BLOCK_MAX:
            raise _Corrupt(f"the block at byte {self.offset} declares {size} bytes, more than zstd's 128 KiB")
        n = 3 + (1 if kind == 1 else size)
        self._within(n + (self._check_bytes if last else 0))
        if avail < n:
            return None
        data = self._take(n)
        if last:
            self._state = _CHECKSUM
        return self._dobj.decompress(data) if self._dobj is not None else b""

    def _checksum(self, avail: int) -> bytes | None:
        n = self._check_bytes
        if avail < n:
            return None
        data = self._take(n)
        out = self._dobj.decompress(data) if data and self._dobj is not None else b""
        if self._dobj is not None and not self._dobj.eof:
            raise _Corrupt("the frame does not end after its last block")
        self._end_frame()
        return out

    # -- bookkeeping

    def _take(self, n: int) -> bytearray:
        data = self._buf[self._at:self._at + n]
        self._at, self.offset = self._at + n, self.offset + n
        return data

    def _begin(self) -> None:
        if self.frames is None:
            self.starts.append(self.offset)

    def _within(self, n: int) -> None:
        """The next `n` bytes belong to the current frame: they must end by the planned next frame."""
        if self.frames is not None and self.offset + n > self.frames[self.frame + 1]:
            raise self._mismatch(f"at byte {self.frame_start} runs past byte {self.frames[self.frame + 1]}")

    def _end_frame(self, check: bool = True) -> None:
        if self.frames is not None:
            if check and self.offset != self.frames[self.frame + 1]:
                raise self._mismatch(f"at byte {self.frame_start} ends at byte {self.offset}")
            self.frame += 1
        self._state, self._dobj = _FRAME, None

    def _mismatch(self, what: str) -> DataError:
        f, frames = self.frame, self.frames or []
        return DataError(
            f"the frame index of {self.key!r} does not match its frames: the frame {what}, but the index "
            f"(its seek table) has frame {f} at bytes {frames[f]}..{frames[f + 1]}: rewrite the seek table, or "
            "remove it and the loader walks the frames (a shard without one changed after planning)",
            key=self.key, offset=self.frame_start)

    def _corrupt(self, exc: Exception) -> DataError:
        hint = (f" (a frame may ask for a window of at most {_MAX_WINDOW >> 20} MiB)"
                if "too much memory" in str(exc) else "")
        err = DataError(f"corrupt zstd frame in {self.key!r} at compressed byte {self.frame_start}: {exc}{hint}",
                        key=self.key, offset=self.frame_start)
        if not self.skip_corrupt or self.frames is None:
            raise err from exc
        self._state, self._dobj = _RESYNC, None
        self._left = self.frames[self.frame + 1] - self.offset
        return err


_SEEK_MAGIC = 0x8F92EAB1
_SEEK_FRAME_MAGIC = 0x184D2A5E


def seek_table(frames: list[tuple[int, int]]) -> bytes:
    """The zstd *seekable format* seek table for frames of (compressed, decompressed) sizes.

    Appended to a .zst shard (it is a skippable frame, so any zstd reader ignores it), it lets the
    planner find every frame with one small ranged read of the shard's tail: the shard's index,
    written once, by its writer.
    """
    body = b"".join(struct.pack("<II", c, d) for c, d in frames) + struct.pack("<IBI", len(frames), 0, _SEEK_MAGIC)
    return struct.pack("<II", _SEEK_FRAME_MAGIC, len(body)) + body


async def read_seek_table(store: Store, key: str, size: int) -> list[int] | None:
    """Frame offsets from a seek table at the end of the shard, or None if it has none.

    The table is checked for what it can say alone (sizes that fit and add up); that each listed
    offset starts a frame is checked by `ZstdStream` as the frames are read.
    """
    entries = await read_seek_entries(store, key, size)
    return None if entries is None else entries[0]


async def read_seek_entries(store: Store, key: str, size: int) -> tuple[list[int], list[int]] | None:
    """(frame offsets, running total of the frames' decompressed sizes) from the shard's seek table,
    or None if it has none. The decompressed sizes are as the writer declared them: a planning
    estimate of each frame's content (splits are balanced by it), never trusted for reading."""
    if size < 17:
        return None
    tail = await store.read(key, size - 9, size)
    if len(tail) != 9 or struct.unpack_from("<I", tail, 5)[0] != _SEEK_MAGIC:
        return None
    n, desc = struct.unpack_from("<IB", tail)
    entry = 12 if desc & 0x80 else 8
    total = 8 + n * entry + 9
    if desc & 0x7C or total + n * _MIN_FRAME > size:  # checked before anything is read for the n entries
        raise DataError(f"corrupt seek table in {key!r}: {n} frames do not fit in {size} bytes", key=key,
                        offset=size - 9)
    table = await store.read(key, size - total, size)
    if len(table) != total or struct.unpack_from("<II", table) != (_SEEK_FRAME_MAGIC, total - 8):
        raise DataError(f"corrupt seek table in {key!r} at byte {size - total}", key=key, offset=size - total)
    pairs = list(struct.iter_unpack("<II" + "x" * (entry - 8), memoryview(table)[8:8 + n * entry]))
    sizes = [c for c, _ in pairs]
    small = next((i for i, c in enumerate(sizes) if c < _MIN_FRAME), None)
    if small is not None:
        raise DataError(f"corrupt seek table in {key!r}: entry {small} lists a frame of {sizes[small]} bytes, "
                        f"smaller than any zstd frame", key=key, offset=size - total)
    offsets = list(itertools.accumulate(sizes, initial=0))
    if offsets[-1] != size - total:
        raise DataError(f"corrupt seek table in {key!r}: frames add up to {offsets[-1]} bytes, the data is "
                        f"{size - total}", key=key, offset=size - total)
    return offsets, list(itertools.accumulate((d for _, d in pairs), initial=0))


async def walk_frames(store: Store, key: str, size: int) -> list[int]:
    """Frame offsets of a shard without a seek table: its frame and block headers, read in parts."""
    walk = ZstdStream(key, 0, decode=False)
    for start in range(0, size, _WALK_PART):
        data = await store.read(key, start, min(size, start + _WALK_PART))
        await threads.run_sync(walk.pull, DECODE_PIECE, data)
    walk.expect_end(size)
    return walk.starts + [size]


# ---- writing -------------------------------------------------------------------------------------


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
