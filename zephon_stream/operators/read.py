"""Read: list JSONL / JSONL.zst shards, cut them into splits, and stream a split's records.

A *split* owns the records that **start** inside its range. For `.jsonl` the range is bytes
`[start, end)` of the shard; for `.jsonl.zst` it is zstd frames `[start, end)`, found by
walking frame and block headers (no decompression). A split peeks one byte (one frame for
zstd) back to learn whether it begins at a record start, and reads past its end only to
finish its last record. So a single shard spreads over many lanes and no lane decodes data
that another lane uses, apart from that bounded peek.

```
shard bytes:  |rec0\\n|rec1....\\n|rec2\\n|rec3..\\n|
split 0:      [--------)                          owns rec0, rec1 (rec1 runs past its end)
split 1:               [---------)                owns rec2, rec3
```

Offsets inside a split are relative to its decoded start (byte `start`, or the first byte of
frame `start`); a document reference `(source, position, offset, length)` is enough to read
the document again on restore.
"""

from __future__ import annotations

import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import anyio
import msgspec
import zstandard

from .._exceptions import ConfigError, DataError
from ..connectors.base import ObjectInfo, Store

SUFFIXES = (".jsonl", ".jsonl.zst")
_ZSTD_MAGIC = 0xFD2FB528
_READ_PART = 1 << 20  # the largest ranged read of a split
_MIN_PART = 1 << 10  # the smallest, when a small split is cut into `read_ahead` parts


class ShardPlan(msgspec.Struct, frozen=True, array_like=True):
    key: str  # the full key in the store
    size: int
    etag: str
    frames: list[int] = []  # zstd only: compressed offset of every frame, then the shard size


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


def zstd_frames(data: bytes, key: str) -> list[int]:
    """Compressed offsets of every frame in `data`, then len(data). Raises DataError if truncated."""
    offsets, pos, n = [], 0, len(data)
    while pos < n:
        offsets.append(pos)
        pos = _frame_end(data, pos, key)
    return offsets + [n]


def _frame_end(data: bytes, pos: int, key: str) -> int:
    n = len(data)
    if pos + 4 > n:
        raise DataError(f"truncated zstd frame header in {key!r} at byte {pos}", key=key, offset=pos)
    magic = struct.unpack_from("<I", data, pos)[0]
    if 0x184D2A50 <= magic <= 0x184D2A5F:  # skippable frame
        if pos + 8 > n:
            raise DataError(f"truncated skippable frame in {key!r} at byte {pos}", key=key, offset=pos)
        end = pos + 8 + struct.unpack_from("<I", data, pos + 4)[0]
    elif magic == _ZSTD_MAGIC:
        end = _zstd_blocks_end(data, pos, key)
    else:
        raise DataError(f"{key!r} is not zstd: bad frame magic {magic:#x} at byte {pos}", key=key, offset=pos)
    if end > n:
        raise DataError(
            f"truncated .zst shard {key!r}: frame at byte {pos} needs {end - n} more bytes "
            f"(object is {n} bytes)", key=key, offset=pos)
    return end


def _zstd_blocks_end(data: bytes, pos: int, key: str) -> int:
    if pos + 5 > len(data):
        raise DataError(f"truncated zstd frame header in {key!r} at byte {pos}", key=key, offset=pos)
    fhd = data[pos + 4]
    single = (fhd >> 5) & 1
    fcs_size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    p = pos + 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs_size
    while True:
        if p + 3 > len(data):
            raise DataError(f"truncated .zst shard {key!r}: block header at byte {p} is cut off",
                            key=key, offset=p)
        header = data[p] | data[p + 1] << 8 | data[p + 2] << 16
        last, btype, bsize = header & 1, (header >> 1) & 3, header >> 3
        if btype == 3:
            raise DataError(f"corrupt .zst shard {key!r}: reserved block type at byte {p}", key=key, offset=p)
        p += 3 + (1 if btype == 1 else bsize)
        if last:
            return p + (4 if (fhd >> 2) & 1 else 0)


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
    """Frame offsets from a seek table at the end of the shard, or None if it has none."""
    if size < 17:
        return None
    tail = await store.read(key, size - 9, size)
    if len(tail) != 9 or struct.unpack_from("<I", tail, 5)[0] != _SEEK_MAGIC:
        return None
    n, desc = struct.unpack_from("<IB", tail)
    entry = 12 if desc & 0x80 else 8
    total = 8 + n * entry + 9
    if desc & 0x7C or total > size:
        raise DataError(f"corrupt seek table in {key!r}: {n} frames do not fit in {size} bytes", key=key,
                        offset=size - 9)
    table = await store.read(key, size - total, size)
    magic, length = struct.unpack_from("<II", table)
    if magic != _SEEK_FRAME_MAGIC or length != total - 8:
        raise DataError(f"corrupt seek table in {key!r} at byte {size - total}", key=key, offset=size - total)
    offsets = [0]
    for i in range(n):
        offsets.append(offsets[-1] + struct.unpack_from("<I", table, 8 + i * entry)[0])
    if offsets[-1] != size - total:
        raise DataError(f"corrupt seek table in {key!r}: frames add up to {offsets[-1]} bytes, the data is "
                        f"{size - total}", key=key, offset=size - total)
    return offsets


async def plan_source(store: Store, prefix: str, name: str, uri: str, text_field: str,
                      lanes: int, split_bytes: int, on_bad: str) -> SourcePlan:
    """List a source's shards (sorted by key) and cut them into splits."""
    objects = [o for o in await store.list(prefix) if o.key.endswith(SUFFIXES)]
    if not objects:
        raise ConfigError(f"source {name!r}: no *.jsonl or *.jsonl.zst objects under {uri}")
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


async def _plan_shard(store: Store, obj: ObjectInfo) -> ShardPlan:
    key = obj.key
    if obj.size == 0:
        raise DataError(f"empty shard {obj.key!r} (0 bytes): remove it or set on_bad_record = \"skip\"",
                        key=obj.key, offset=0)
    if not obj.key.endswith(".zst"):
        return ShardPlan(obj.key, obj.size, obj.etag)
    frames = await _read_seek_table(store, key, obj.size)
    if frames is None:  # no seek table: walk the frame headers once (reads the whole shard)
        frames = await anyio.to_thread.run_sync(zstd_frames, await store.read(key), key)
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


Spawn = Callable[..., Any]  # a task group's start_soon


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


class SplitReader:
    """Streams the records a split owns, as blocks of whole lines, with bounded memory.

    With `spawn` (a task group's `start_soon`), the owned range is read through a `ReadWindow`
    of `read_ahead` requests; without, one request at a time.
    """

    def __init__(self, store: Store, shard: ShardPlan, split: Split, max_record: int,
                 run_cpu: Callable[..., Awaitable[Any]] | None = None, *, spawn: Spawn | None = None,
                 read_ahead: int = 1) -> None:
        self.store, self.key, self.shard, self.split = store, shard.key, shard, split
        self.max_record = max_record
        self.run_cpu = run_cpu or anyio.to_thread.run_sync
        self.spawn, self.read_ahead = spawn, read_ahead
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

        `offset` > 0 must be a record start (a checkpoint cursor always is one).
        """
        skip_partial: bool | None = None if offset == 0 and self.split.start > 0 else False
        pos, pending, owned_end = 0, b"", None
        async for piece_pos, piece, inside in self._pieces(offset):
            if skip_partial is None:  # after the first piece: for JSONL it carries the byte before the split
                skip_partial = not await self._starts_at_record()
            if not inside and owned_end is None:
                owned_end = piece_pos
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
            if len(pending) > self.max_record:
                raise DataError(
                    f"record at {self.where(pos)} of {self.key!r} is longer than max_record_bytes="
                    f"{self.max_record}: raise the limit or fix the shard", key=self.key, offset=pos)
        if pending.strip() and not skip_partial and (owned_end is None or pos < owned_end):
            yield pos, pending

    def where(self, pos: int) -> str:
        """Human location of decoded offset `pos`, for error messages."""
        if self.shard.frames:
            return f"decompressed byte {pos} after the frame at compressed byte {self.shard.frames[self.split.start]}"
        return f"byte {self.split.start + pos}"

    async def _starts_at_record(self) -> bool:
        """Whether the split begins at a record start: the byte (frame) before it ends a line."""
        if not self.shard.frames:
            return self._byte_before == b"\n"
        f = self.split.start - 1
        data = await self.store.read(self.key, self.shard.frames[f], self.shard.frames[f + 1])
        return (await self.run_cpu(self._decompress, data, f)).endswith(b"\n")

    async def _pieces(self, offset: int) -> AsyncIterator[tuple[int, bytes, bool]]:
        """(decoded offset, bytes, inside the owned range) pieces from the split's start onwards."""
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
            stop = min(size, pos + (1 << 16))
            yield pos - start, await self.store.read(self.key, pos, stop), False
            pos = stop

    async def _frame_pieces(self) -> AsyncIterator[tuple[int, bytes, bool]]:
        """Decompressed frames from the split's first: its own in requests of up to _READ_PART
        compressed bytes, then (only to finish a record) the following frames one at a time."""
        frames, f, pos = self.shard.frames, self.split.start, 0
        part = self._part(frames[self.split.end] - frames[f])
        groups = []  # the owned frames, in requests of about `part` compressed bytes (whole frames)
        while f < self.split.end:
            g = f + 1
            while g < self.split.end and frames[g + 1] - frames[f] <= part:
                g += 1
            groups.append((f, g))
            f = g
        ranges = [(frames[a], frames[b]) for a, b in groups]
        k = 0
        async for data in self._ranges(ranges):
            a, b = groups[k]
            k += 1
            for piece in await self.run_cpu(self._decompress_range, data, a, b):
                yield pos, piece, True
                pos += len(piece)
        while f < len(frames) - 1:  # the following frames, one at a time
            data = await self.store.read(self.key, frames[f], frames[f + 1])
            for piece in await self.run_cpu(self._decompress_range, data, f, f + 1):
                yield pos, piece, False
                pos += len(piece)
            f += 1

    def _decompress_range(self, data: bytes, first: int, last: int) -> list[bytes]:
        base = self.shard.frames[first]
        return [self._decompress(data[self.shard.frames[i] - base:self.shard.frames[i + 1] - base], i)
                for i in range(first, last)]

    def _decompress(self, data: bytes, frame: int) -> bytes:
        where = self.shard.frames[frame]
        try:
            return zstandard.ZstdDecompressor().decompress(data, max_output_size=self.max_record + (64 << 20))
        except zstandard.ZstdError as exc:
            raise DataError(f"corrupt zstd frame in {self.key!r} at compressed byte {where}: {exc}",
                            key=self.key, offset=where) from exc


class Parser:
    """Decodes blocks of JSON lines into (offset, length, text) records, strictly."""

    def __init__(self, text_field: str, on_bad: Literal["error", "skip"]) -> None:
        self.text_field, self.on_bad = text_field, on_bad
        record = msgspec.defstruct("Record", [(text_field, str)])
        self._decoder = msgspec.json.Decoder(record)
        self.skipped = 0

    def __repr__(self) -> str:
        return f"Parser(text_field={self.text_field!r}, on_bad={self.on_bad!r})"

    def parse(self, reader: SplitReader, block_pos: int, block: bytes) -> list[tuple[int, int, str]]:
        """Records of `block` as (decoded offset, length incl. newline, text)."""
        out, pos, decode, field = [], block_pos, self._decoder.decode, self.text_field
        for line in block.split(b"\n"):
            n = len(line) + 1
            if line.strip():
                try:
                    out.append((pos, n, getattr(decode(line), field)))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    if self.on_bad != "skip":
                        raise DataError(
                            f"bad record in {reader.key!r} at {reader.where(pos)}: {exc} "
                            f"(set on_bad_record = \"skip\" to skip such records)",
                            key=reader.key, offset=pos) from exc
                    self.skipped += 1
            pos += n
        return out
