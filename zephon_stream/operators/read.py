"""Read: list JSONL / JSONL.zst shards, cut them into splits, and stream a split's records.

A *split* owns the records that **start** inside its range. For `.jsonl` the range is bytes
`[start, end)` of the shard; for `.jsonl.zst` it is zstd frames `[start, end)`, found from the
shard's seek table or by walking frame and block headers (no decompression). A split peeks one
byte (one frame for zstd) back to learn whether it begins at a record start, and reads past its
end only to finish its last record. So a single shard spreads over many lanes and no lane
decodes data that another lane uses, apart from that bounded peek.

```
shard bytes:  |rec0\\n|rec1....\\n|rec2\\n|rec3..\\n|
split 0:      [--------)                          owns rec0, rec1 (rec1 runs past its end)
split 1:               [---------)                owns rec2, rec3
```

Offsets inside a split are relative to its decoded start (byte `start`, or the first byte of
frame `start`); a document reference `(source, position, offset, length)` is enough to read
the document again on restore.

Memory is bounded by settings, never by the data: ranged reads of at most 1 MiB
(`read_ahead` of them per split), zstd decoded one block (<= 128 KiB) at a time into pieces of
about 1 MiB, whatever size a frame declares, and one record of at most `max_record_bytes`.
"""

from __future__ import annotations

import itertools
import math
import re
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal

import anyio
import msgspec
import numpy as np
import zstandard

from zephon_stream.errors import ConfigError, DataError
from zephon_stream.connectors.base import ObjectInfo, Store

SUFFIXES = (".jsonl", ".jsonl.zst")
_ZSTD_MAGIC = 0xFD2FB528
_READ_PART = 1 << 20  # the largest ranged read of a split
_MIN_PART = 1 << 10  # the smallest, when a small split is cut into `read_ahead` parts
_TAIL_PART = 1 << 16  # reads past a split's end, only to finish its last record
_WALK_PART = 8 << 20  # reads of a shard whose frames are walked at planning
_OUT_PIECE = 1 << 20  # decoded bytes per zstd step
_HOLD = 1 << 20  # a frame's output held back until its end (its checksum) up to this size
_BLOCK_MAX = 128 << 10  # a zstd block never holds or decodes to more (RFC 8878 Block_Maximum_Size)
_MAX_WINDOW = 1 << 27  # libzstd's default limit: a frame that asks for a larger window is refused
_MIN_FRAME = 8  # the smallest frame (an empty skippable frame); a zstd frame takes 9 bytes or more


class ShardPlan(msgspec.Struct, frozen=True, array_like=True):
    key: str  # the full key in the store
    size: int
    etag: str
    frames: list[int] = []  # zstd only: compressed offset of every frame, then the end of the frames


class Split(msgspec.Struct, frozen=True, array_like=True):
    shard: int
    start: int  # byte (jsonl) or frame index (zst)
    end: int


class SourcePlan(msgspec.Struct, frozen=True):
    name: str
    uri: str
    prefix: str
    text_field: str
    shards: list[ShardPlan]
    splits: list[Split]
    skipped_shards: list[str] = []


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


async def _read_seek_table(store: Store, key: str, size: int) -> list[int] | None:
    """Frame offsets from a seek table at the end of the shard, or None if it has none.

    The table is checked for what it can say alone (sizes that fit and add up); that each listed
    offset starts a frame is checked by `ZstdStream` as the frames are read.
    """
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
    sizes = [e[0] for e in struct.iter_unpack("<I" + "x" * (entry - 4), memoryview(table)[8:8 + n * entry])]
    small = next((i for i, c in enumerate(sizes) if c < _MIN_FRAME), None)
    if small is not None:
        raise DataError(f"corrupt seek table in {key!r}: entry {small} lists a frame of {sizes[small]} bytes, "
                        f"smaller than any zstd frame", key=key, offset=size - total)
    offsets = list(itertools.accumulate(sizes, initial=0))
    if offsets[-1] != size - total:
        raise DataError(f"corrupt seek table in {key!r}: frames add up to {offsets[-1]} bytes, the data is "
                        f"{size - total}", key=key, offset=size - total)
    return offsets


async def _walk_frames(store: Store, key: str, size: int) -> list[int]:
    """Frame offsets of a shard without a seek table: its frame and block headers, read in parts."""
    walk = ZstdStream(key, 0, decode=False)
    for start in range(0, size, _WALK_PART):
        data = await store.read(key, start, min(size, start + _WALK_PART))
        await anyio.to_thread.run_sync(walk.pull, _OUT_PIECE, data)
    walk.expect_end(size)
    return walk.starts + [size]


# ---- planning ------------------------------------------------------------------------------------

async def plan_source(store: Store, prefix: str, name: str, uri: str, text_field: str,
                      lanes: int, split_bytes: int, on_bad: str) -> SourcePlan:
    """List a source's shards (sorted by key) and cut them into splits."""
    objects = [o for o in await store.list(prefix) if o.key.endswith(SUFFIXES)]
    if not objects:
        raise ConfigError(f"source {name!r}: no *.jsonl or *.jsonl.zst objects under {uri}")
    for obj in objects:
        _check_key(name, obj.key)
    shards, skipped = [], []
    for obj in objects:
        try:
            shards.append(await _plan_shard(store, obj))
        except DataError:
            if on_bad != "skip":
                raise
            skipped.append(obj.key)
    if not shards:
        raise DataError(f"source {name!r}: every shard under {uri} is empty or corrupt: {skipped}")
    total = sum(s.size for s in shards)
    target = max(1024, min(split_bytes, math.ceil(total / lanes)))
    splits = [sp for i, s in enumerate(shards) for sp in _cut(i, s, target)]
    return SourcePlan(name=name, uri=uri, prefix=prefix, text_field=text_field,
                      shards=shards, splits=splits, skipped_shards=skipped)


def _check_key(source: str, key: str) -> None:
    """A shard name must be UTF-8: plans, checkpoints and S3 requests carry it as text."""
    try:
        key.encode()
    except UnicodeEncodeError as exc:
        raw = key.encode("utf-8", "surrogateescape")
        raise DataError(f"source {source!r}: shard name {raw!r} is not valid UTF-8 (byte {exc.start}): rename "
                        "the file", key=ascii(key)) from None


async def _plan_shard(store: Store, obj: ObjectInfo) -> ShardPlan:
    key = obj.key
    if obj.size == 0:
        raise DataError(f"empty shard {obj.key!r} (0 bytes): remove it or set on_bad_record = \"skip\"",
                        key=obj.key, offset=0)
    if not obj.key.endswith(".zst"):
        return ShardPlan(obj.key, obj.size, obj.etag)
    frames = await _read_seek_table(store, key, obj.size)
    if frames is None:  # no seek table: walk the frame headers once (reads the whole shard, in parts)
        frames = await _walk_frames(store, key, obj.size)
    return ShardPlan(obj.key, obj.size, obj.etag, frames)


def _cut(index: int, shard: ShardPlan, target: int) -> list[Split]:
    if not shard.frames:
        n = math.ceil(shard.size / target)
        bounds = [shard.size * k // n for k in range(n + 1)]
        return [Split(index, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    out, first = [], 0
    for f in range(1, len(shard.frames)):
        if shard.frames[f] - shard.frames[first] >= target or f == len(shard.frames) - 1:
            out.append(Split(index, first, f))
            first = f
    return out


# ---- reading -------------------------------------------------------------------------------------

Spawn = Callable[..., Any]  # a task group's start_soon


class BadRecords:
    """A source's bad-record policy: raise the DataError (`on_bad_record = "error"`) or count it."""

    def __init__(self, on_bad: Literal["error", "skip"] = "error") -> None:
        self.skipping = on_bad == "skip"
        self.count = 0
        self.first: str | None = None  # the first skipped record's error, for a later message

    def __call__(self, err: DataError) -> None:
        if not self.skipping:
            raise err
        self.count += 1
        if self.first is None:
            self.first = str(err)


class _Part:
    __slots__ = ("data", "error", "done")

    def __init__(self) -> None:
        self.data, self.error, self.done = b"", None, anyio.Event()


class ReadWindow:
    """Ranged reads of one object, in order, with a sliding window of `ahead` requests.

    Taking a part starts the next request, so at most `ahead` parts are in flight or waiting:
    bounded memory, and the store's latency is hidden behind the lane's CPU work. Requests run
    as tasks of `spawn` (the lanes' task group), never inside the reader's generator, so a
    reader dropped half way leaves nothing to clean up but its finished requests.
    """

    def __init__(self, store: Store, key: str, ranges: list[tuple[int, int]], ahead: int, spawn: Spawn) -> None:
        self.store, self.key, self.ranges, self.ahead, self.spawn = store, key, ranges, ahead, spawn
        self._parts: dict[int, _Part] = {}
        self._started = self._taken = 0

    def _fill(self) -> None:
        while self._started < len(self.ranges) and self._started < self._taken + self.ahead:
            part = self._parts[self._started] = _Part()
            self.spawn(self._fetch, part, *self.ranges[self._started])
            self._started += 1

    async def _fetch(self, part: _Part, start: int, end: int) -> None:
        try:
            part.data = await self.store.read(self.key, start, end)
        except Exception as exc:  # raised where the part is taken, in the lane
            part.error = exc
        finally:
            part.done.set()

    def __aiter__(self) -> ReadWindow:
        return self

    async def __anext__(self) -> bytes:
        if self._taken >= len(self.ranges):
            raise StopAsyncIteration
        self._fill()
        part = self._parts.pop(self._taken)
        self._taken += 1
        self._fill()
        await part.done.wait()
        if part.error is not None:
            raise part.error
        return part.data


Piece = bytes | DataError  # decoded bytes, or a corrupt frame skipped at that point (skip mode)


class SplitReader:
    """Streams the records a split owns, as blocks of whole lines, with bounded memory.

    With `spawn` (a task group's `start_soon`), the owned range is read through a `ReadWindow`
    of `read_ahead` requests; without, one request at a time. `bad` is the source's bad-record
    policy: with it skipping, a record over `max_record` and a corrupt zstd frame are skipped and
    counted, the same way whatever the read sizes.
    """

    def __init__(self, store: Store, shard: ShardPlan, split: Split, max_record: int,
                 run_cpu: Callable[..., Awaitable[Any]] | None = None, *, spawn: Spawn | None = None,
                 read_ahead: int = 1, bad: BadRecords | None = None) -> None:
        self.store, self.key, self.shard, self.split = store, shard.key, shard, split
        self.max_record = max_record
        self.run_cpu = run_cpu or anyio.to_thread.run_sync
        self.spawn, self.read_ahead = spawn, read_ahead
        self.bad = bad or BadRecords()
        self._byte_before = b""

    def _part(self, owned: int) -> int:
        """Request size for `owned` bytes: up to _READ_PART, small enough that the window has
        `read_ahead` requests to overlap (when there is a window)."""
        if self.spawn is None or self.read_ahead <= 1:
            return _READ_PART
        return min(_READ_PART, max(_MIN_PART, -(-owned // self.read_ahead)))

    async def _ranges(self, ranges: list[tuple[int, int]]) -> AsyncIterator[bytes]:
        """The bytes of `ranges` in order: through a window when there is one, else one by one."""
        if self.spawn is not None and self.read_ahead > 1 and len(ranges) > 1:
            async for data in ReadWindow(self.store, self.key, ranges, self.read_ahead, self.spawn):
                yield data
            return
        for start, end in ranges:
            yield await self.store.read(self.key, start, end)

    def __repr__(self) -> str:
        return f"SplitReader({self.key!r}, {self.split})"

    async def blocks(self, offset: int = 0) -> AsyncIterator[tuple[int, bytes]]:
        """Yield (decoded offset, bytes) blocks of whole lines owned by the split, from `offset`.

        `offset` > 0 must be a record start (a checkpoint cursor always is one). In skip mode a
        record longer than `max_record` is dropped up to its newline, and one cut by a corrupt
        frame is dropped; what follows that frame is read as a record start (a cut-off tail of a
        record then fails to decode: a bad record of its own).
        """
        skip_partial: bool | None = None if offset == 0 and self.split.start > 0 else False
        pos, pending, owned_end = 0, b"", None
        async for piece_pos, piece, inside in self._pieces(offset):
            if skip_partial is None:  # after the first piece: for JSONL it carries the byte before the split
                skip_partial = not await self._starts_at_record()
            if not inside and owned_end is None:
                owned_end = piece_pos
            if isinstance(piece, DataError):  # a skipped corrupt frame: the record it cuts is lost with it
                if piece_pos < offset:  # skipped (and counted) by the run that wrote the checkpoint
                    continue
                if not inside:  # another split's frame: that split counts it
                    return
                self.bad(piece)  # what follows is read as a record start: a cut-off tail is a bad record
                pos, pending, skip_partial = piece_pos, b"", False
                continue
            if skip_partial and not inside:  # a record starting from here on is the next split's
                return
            if not pending:
                pos = piece_pos
            pending += piece
            if pos < offset:
                drop = min(len(pending), offset - pos)
                pending, pos = pending[drop:], pos + drop
                if not pending:
                    continue
            if skip_partial:
                nl = pending.find(b"\n")
                if nl < 0:
                    pos, pending = pos + len(pending), b""
                    continue
                pos, pending, skip_partial = pos + nl + 1, pending[nl + 1:], False
            if owned_end is not None:
                if pos >= owned_end:
                    return
                nl = pending.find(b"\n", owned_end - 1 - pos)
                if nl >= 0:
                    yield pos, pending[:nl + 1]
                    return
            else:
                cut = pending.rfind(b"\n")
                if cut >= 0:
                    yield pos, pending[:cut + 1]
                    pos, pending = pos + cut + 1, pending[cut + 1:]
            if len(pending) > self.max_record:  # bounded memory: a record never grows past the limit
                self.bad(self.too_long(pos, pending))
                pos, pending, skip_partial = pos + len(pending), b"", True
        if pending.strip() and not skip_partial and (owned_end is None or pos < owned_end):
            yield pos, pending

    def too_long(self, pos: int, record: bytes) -> DataError:
        """The error for a record (or the start of one) longer than `max_record`."""
        crs = record.count(b"\r")
        why = (f"; it holds {crs} carriage returns (\\r) and no newline (\\n): the shard seems to use CR-only "
               "line endings, convert them to \\n" if crs else ": raise the limit or fix the shard")
        return DataError(f"record at {self.where(pos)} of {self.key!r} is longer than max_record_bytes="
                         f"{self.max_record}{why}", key=self.key, offset=pos)

    def where(self, pos: int) -> str:
        """Human location of decoded offset `pos`, for error messages."""
        if self.shard.frames:
            return f"decompressed byte {pos} after the frame at compressed byte {self.shard.frames[self.split.start]}"
        return f"byte {self.split.start + pos}"

    async def _starts_at_record(self) -> bool:
        """Whether the split begins at a record start: the byte (frame) before it ends a line.

        For zstd, the last byte of the nearest earlier frame that decodes to something; after a
        corrupt frame (skip mode), a record start, as the split that owns that frame reads it.
        """
        if not self.shard.frames:
            return self._byte_before == b"\n"
        for f in range(self.split.start - 1, -1, -1):
            last = await self._last_byte(f)
            if last is None:
                return True
            if last:
                return last == b"\n"
        return True

    async def _last_byte(self, f: int) -> bytes | None:
        """The last decoded byte of frame `f`: b"" if it decodes to nothing, None if it is corrupt."""
        frames, last = self.shard.frames, b""
        stream = ZstdStream(self.key, frames[f], frames, f, skip_corrupt=self.bad.skipping)
        for start in range(frames[f], frames[f + 1], _READ_PART):
            data = await self.store.read(self.key, start, min(frames[f + 1], start + _READ_PART))
            async for piece in self._decode(stream, data):
                if isinstance(piece, DataError):
                    return None
                last = piece[-1:]
        stream.expect_end(frames[f + 1])
        return last

    async def _pieces(self, offset: int) -> AsyncIterator[tuple[int, Piece, bool]]:
        """(decoded offset, piece, inside the owned range) from the split's start onwards."""
        if self.shard.frames:
            async for piece in self._frame_pieces():
                yield piece
            return
        start, end, size = self.split.start, self.split.end, self.shard.size
        pos = start + offset
        if pos < end:  # the owned bytes; the first request also takes the byte before the split
            lo = start - 1 if pos == start and start > 0 else pos
            bounds = [*range(lo, end, self._part(end - lo)), end]
            async for data in self._ranges(list(zip(bounds, bounds[1:]))):
                if lo < start:
                    self._byte_before, data, lo = data[:1], data[1:], start
                yield pos - start, data, True
                pos += len(data)
        while pos < size:  # past the end only to finish the last record
            stop = min(size, pos + _TAIL_PART)
            yield pos - start, await self.store.read(self.key, pos, stop), False
            pos = stop

    async def _frame_pieces(self) -> AsyncIterator[tuple[int, Piece, bool]]:
        """The split's frames decoded as a stream: its own compressed bytes in requests of up to
        _READ_PART (cut anywhere, a frame may span many), then the following frames, in small
        requests, only as far as the reader pulls (to finish a record)."""
        frames, split = self.shard.frames, self.split
        lo, hi, end = frames[split.start], frames[split.end], frames[-1]
        stream = ZstdStream(self.key, lo, frames, split.start, skip_corrupt=self.bad.skipping)
        pos = 0
        bounds = [*range(lo, hi, self._part(hi - lo)), hi]
        async for data in self._ranges(list(itertools.pairwise(bounds))):
            async for piece in self._decode(stream, data):
                yield pos, piece, True
                pos += len(piece) if isinstance(piece, bytes) else 0
        stream.expect_end(hi)
        for f in range(split.end, len(frames) - 1):  # one frame at a time, a large one in parts
            for start in range(frames[f], frames[f + 1], _TAIL_PART):
                data = await self.store.read(self.key, start, min(frames[f + 1], start + _TAIL_PART))
                async for piece in self._decode(stream, data):
                    yield pos, piece, False
                    pos += len(piece) if isinstance(piece, bytes) else 0
        stream.expect_end(end)

    async def _decode(self, stream: ZstdStream, data: bytes) -> AsyncIterator[Piece]:
        """Feed `data` to `stream`; its output in pieces of about _OUT_PIECE, and any corrupt frame."""
        while True:
            out, err = await self.run_cpu(stream.pull, _OUT_PIECE, data)
            data = b""
            if out:
                yield out
            if err is not None:
                yield err
            elif len(out) < _OUT_PIECE:  # the stream needs more input
                return


# ---- records -------------------------------------------------------------------------------------

_MAX_DEPTH = 512  # JSON nesting a record may have: a fixed limit, not wherever the stack runs out
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, np.int64)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|"  # a high one alone, or
                        rb"(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")  # a low one


class _TooDeep(Exception):
    pass


def _nesting(line: bytes) -> int:
    """How deep `line` nests JSON arrays and objects (brackets inside strings do not count)."""
    bare = np.frombuffer(_JSON_STRING.sub(b"", line), np.uint8)
    depth = peak = 0
    for i in range(0, len(bare), 1 << 20):  # in pieces: the running sums stay small
        sums = np.cumsum(_DEPTH_STEP[bare[i:i + (1 << 20)]]) + depth
        peak, depth = max(peak, int(sums.max())), int(sums[-1])
    return peak


class Parser:
    """Decodes blocks of JSON lines into (offset, length, text) records, strictly.

    `text_field` may be any JSON key. A record nesting deeper than 512 levels is a bad record
    (whatever the caller's stack depth, so the same records are skipped on every backend).
    """

    def __init__(self, text_field: str, on_bad: Literal["error", "skip"]) -> None:
        self.text_field, self.on_bad = text_field, on_bad
        self.bad = BadRecords(on_bad)
        try:
            record = msgspec.defstruct("Record", [("text", str)], rename={"text": text_field})
            self._record = msgspec.json.Decoder(record)
            self._text = self._text_field
        except ValueError:  # a key msgspec cannot rename to (a quote, backslash or control character)
            self._fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
            self._text = self._text_any_key

    @property
    def skipped(self) -> int:
        return self.bad.count

    def __repr__(self) -> str:
        return f"Parser(text_field={self.text_field!r}, on_bad={self.on_bad!r})"

    def _text_field(self, line: bytes) -> str:
        return self._record.decode(line).text

    def _text_any_key(self, line: bytes) -> str:
        raw = self._fields.decode(line).get(self.text_field)
        if raw is None:
            raise msgspec.ValidationError(f"Object missing required field `{self.text_field}`")
        return msgspec.json.decode(raw, type=str)

    def parse(self, reader: SplitReader, block_pos: int, block: bytes) -> list[tuple[int, int, str]]:
        """Records of `block` as (decoded offset, length incl. newline, text)."""
        out, pos = [], block_pos
        for line in block.split(b"\n"):
            n = len(line) + 1
            if line.strip():
                if n > reader.max_record + 1:
                    self.bad(reader.too_long(pos, line))
                elif (text := self._decode(reader, pos, line)) is not None:
                    out.append((pos, n, text))
            pos += n
        return out

    def _decode(self, reader: SplitReader, pos: int, line: bytes) -> str | None:
        """The text of one record, or None if it is bad and skipped."""
        try:
            if line.count(b"[") + line.count(b"{") > _MAX_DEPTH and _nesting(line) > _MAX_DEPTH:
                raise _TooDeep
            return self._text(line)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, _TooDeep) as exc:
            hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such records)'
            err = DataError(f"bad record in {reader.key!r} at {reader.where(pos)}: {_why(exc, line)}{hint}",
                            key=reader.key, offset=pos)
            err.__cause__ = exc
            self.bad(err)
            return None


def _why(exc: Exception, line: bytes) -> str:
    """What is wrong with a record that does not decode, in words that name the likely cause."""
    if isinstance(exc, (RecursionError, _TooDeep)):
        return f"it nests JSON arrays or objects more than {_MAX_DEPTH} deep, the most a record may"
    msg = str(exc)
    if line.startswith(b"\xef\xbb\xbf"):
        return f"{msg}: the line starts with a UTF-8 byte order mark (EF BB BF); remove it"
    if isinstance(exc, msgspec.ValidationError):
        return msg
    if "UTF-8" in msg:
        try:
            line.decode()
        except UnicodeDecodeError as bad:
            surrogate = line[bad.start] == 0xED and bad.start + 1 < len(line) and line[bad.start + 1] >= 0xA0
            what = line[bad.start:max(bad.end, bad.start + 3 if surrogate else 0)].hex(" ")
            return (f"{msg}: bytes {what} at byte {bad.start} of the record"
                    f"{' encode a UTF-16 surrogate, which UTF-8 forbids' if surrogate else ''}")
    if m := _SURROGATE.search(line):
        return (f"{msg}: the record holds a lone UTF-16 surrogate escape {m.group().decode()} at byte {m.start()}, "
                "which is not a character: fix the writer")
    if b"\r" in line.rstrip(b"\r"):
        return (f"{msg}: the line holds carriage returns (\\r) not followed by \\n: the shard seems to use CR-only "
                "line endings; convert them to \\n")
    return msg
