"""Parquet sources: a split is a run of row groups, a record is a row.

`ParquetSplitReader.blocks` keeps the read path's contract: it yields `(offset, block)` where
`offset` is the row of the block's first record counted from the split's first row, and the
block is a pyarrow Table whose `len()` is its number of rows, so a record's reference is
`(source, position, row, 1)` and restore re-reads just the row group that holds the row.

```
row groups:   | rg 4: rows 0..99 | rg 5: rows 100..199 | rg 6 ...      split = rg [4, 6)
offsets:        0 ...         99   100 ...          199
```

`ParquetParser` turns a block into `(row, 1, text)` records, or `(row, 1, ImageRecord)` for an
image source (a binary or HF `Image` struct<bytes, path> column, its bytes passed on as they
are, never re-encoded). A null, an oversized value or a missing caption is a bad record: a
DataError naming the file, the column, the row group and the row, or a counted skip.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from zephon_stream.connectors.base import Store
from zephon_stream.engine import threads
from zephon_stream.engine.window import Spawn, read_ranges
from zephon_stream.errors import DataError, IncompatibleState
from zephon_stream.formats.parquet import (
    Column,
    ParquetFooter,
    column_ranges,
    decode_row_group,
    read_footer,
    resolve_column,
)
from zephon_stream.operators.images import ImageRecord
from zephon_stream.operators.read import BadRecords, ShardPlan, Split

if TYPE_CHECKING:
    from zephon_stream.operators.transforms import Records

__all__ = ["ParquetParser", "ParquetSplitReader"]

_READ_PART = 1 << 20  # the largest ranged read: a column chunk is fetched in parts of this size
_MIN_PART = 1 << 10  # the smallest, when a small split is cut into `read_ahead` parts
_BLOCK_BYTES = 1 << 20  # decoded bytes per block handed to the parser


class ParquetSplitReader:
    """Streams the rows of a split's row groups, fetching only the chunks of `columns`
    ([(name, "text" | "image")]), through a `ReadWindow` of `read_ahead` requests with `spawn`."""

    kind = "Parquet"  # what a bad row's error calls the file (zephon shard's Arrow and CSV rows say theirs)

    def __init__(self, store: Store, shard: ShardPlan, split: Split, max_record: int,
                 run_cpu: Callable[..., Awaitable[Any]] | None = None, *, columns: list[tuple[str, str]],
                 spawn: Spawn | None = None, read_ahead: int = 1, bad: BadRecords | None = None) -> None:

        self.store, self.key, self.shard, self.split = store, shard.key, shard, split
        self.max_record, self.columns = max_record, columns
        self.run_cpu = run_cpu or threads.run_sync
        self.spawn, self.read_ahead = spawn, read_ahead
        self.bad = bad or BadRecords()
        self.base = shard.rows[split.start]  # the split's first row, counted in the file

    def __repr__(self) -> str:
        return f"ParquetSplitReader({self.key!r}, {self.split})"

    def locate(self, pos: int) -> tuple[int, int]:
        """(row group, row within it) of the record at offset `pos` of the split."""
        row = self.base + pos
        group = bisect.bisect_right(self.shard.rows, row) - 1
        return group, row - self.shard.rows[group]

    def where(self, pos: int) -> str:
        group, row = self.locate(pos)
        return f"row {row} of row group {group}"

    async def blocks(self, offset: int = 0) -> AsyncIterator[tuple[int, Any]]:
        """(offset, Table) blocks of the split's rows from row `offset` on."""
        rows, split = self.shard.rows, self.split
        target = self.base + offset
        if not rows[split.start] <= target <= rows[split.end]:
            raise IncompatibleState(f"row {offset} of {self.key!r} is not in split {split} "
                                    f"({rows[split.end] - self.base} rows)")
        first = bisect.bisect_right(rows, target, split.start, split.end) - 1
        footer = await read_footer(self.store, self.key, self.shard.size, self.shard.etag)
        columns = _resolve(footer, self.columns)
        groups = [g for g in range(first, split.end) if rows[g + 1] > max(rows[g], target)]  # rows left
        async for group, parts in self._chunks(footer, groups, columns):
            table = await self.run_cpu(decode_row_group, footer, group, columns, parts)
            if len(table) != rows[group + 1] - rows[group]:
                raise DataError(f"Parquet file {self.key!r}: row group {group} decodes to {len(table)} rows, its "
                                f"footer says {rows[group + 1] - rows[group]}", key=self.key, offset=group)
            skip = max(0, target - rows[group])
            step = max(1, len(table) * _BLOCK_BYTES // max(1, table.nbytes))
            for lo in range(skip, len(table), step):
                yield rows[group] + lo - self.base, table.slice(lo, step)

    async def _chunks(self, footer: ParquetFooter, groups: list[int],
                      columns: list[Column]) -> AsyncIterator[tuple[int, dict[int, bytes]]]:
        """(row group, {chunk start: chunk bytes}) for `groups`, the chunks fetched in parts."""
        chunks = [(g, column_ranges(footer, g, columns)) for g in groups]
        part = self._part(sum(hi - lo for _, ranges in chunks for lo, hi in ranges))
        plan = [(g, [(lo, a, min(hi, a + part)) for lo, hi in ranges for a in range(lo, hi, part)])
                for g, ranges in chunks]
        ranges = [(a, b) for _, pieces in plan for _, a, b in pieces]
        data = read_ranges(functools.partial(self.store.read, self.key), ranges, self.read_ahead, self.spawn)
        for g, pieces in plan:
            parts: dict[int, list[bytes]] = {}
            for chunk, a, b in pieces:
                got = await data.__anext__()
                if len(got) != b - a:
                    raise DataError(f"Parquet file {self.key!r} changed or was cut while reading: bytes [{a}, {b}) "
                                    f"gave {len(got)} bytes", key=self.key, offset=a)
                parts.setdefault(chunk, []).append(got)
            yield g, {lo: b"".join(p) for lo, p in parts.items()}

    def _part(self, owned: int) -> int:
        """Request size for `owned` bytes: up to _READ_PART, small enough that the window has
        `read_ahead` requests to overlap (when there is a window)."""
        if self.spawn is None or self.read_ahead <= 1:
            return _READ_PART
        return min(_READ_PART, max(_MIN_PART, -(-owned // self.read_ahead)))


def _resolve(footer: ParquetFooter, specs: list[tuple[str, str]]) -> list[Column]:
    """The columns to fetch: those named, their types checked; with `("*", "record")` among them
    (a source with transforms, whose records hold whole rows) every top-level column."""
    named = [resolve_column(footer, name, kind) for name, kind in specs if name != "*"]
    if ("*", "record") not in specs:
        return named
    return [Column(name, [name], "record") for name in footer.schema.names]


class ParquetParser:
    """Decodes blocks of Parquet rows into `(offset, 1, text)` records, or `(offset, 1, ImageRecord)`
    with `image_field` (then `text_field` is the caption column).

    With `records` (a source's transforms, or a chat source's field) each row is a dict of the
    columns read (every column, for a source with transforms: its reader fetches them all), and
    `records.payload` makes the payload (a text longer than `max_record` after the transforms is
    still a bad record)."""

    def __init__(self, text_field: str, image_field: str | None, on_bad: Literal["error", "skip"],
                 max_record: int, records: Records | None = None) -> None:
        self.text_field, self.image_field, self.max_record = text_field, image_field, max_record
        self.on_bad = on_bad
        self.bad = BadRecords(on_bad)
        self.records = records if records is not None and not records.plain else None

    @property
    def skipped(self) -> int:
        return self.bad.count

    @property
    def columns(self) -> list[tuple[str, str]]:
        """The columns a reader fetches: [(name, kind)]."""
        return [(self.text_field, "text")] + ([(self.image_field, "image")] if self.image_field else [])

    def __repr__(self) -> str:
        return (f"ParquetParser(text_field={self.text_field!r}, image_field={self.image_field!r}, "
                f"on_bad={self.on_bad!r})")

    def parse(self, reader: ParquetSplitReader, block_pos: int, block: Any) -> list[tuple[int, int, Any]]:
        try:
            return self._parse(reader, block_pos, block)
        except UnicodeDecodeError as exc:  # pyarrow reads string pages without checking them: a corrupt page
            row = _first_bad_row(block)  # named, and the rows before it still go out (in error mode)
            if row:  # the rows before it under the reader's policy: an earlier bad row raises (or counts) first
                self._parse(reader, block_pos, block.slice(0, row))
            raise DataError(f"corrupt Parquet file {reader.key!r}: {reader.where(block_pos + row)} holds a string "
                            f"that is not UTF-8 ({exc.reason})", key=reader.key, offset=block_pos + row) from exc

    def _parse(self, reader: ParquetSplitReader, block_pos: int, block: Any) -> list[tuple[int, int, Any]]:
        if self.records is not None:
            return self._parse_records(reader, block_pos, block, self.records)
        texts = _values(block, self.text_field)
        images, names = _image_values(block, self.image_field) if self.image_field else (None, None)
        out = []
        for i, text in enumerate(texts):
            pos = block_pos + i
            try:
                if images is None:
                    out.append((pos, 1, self._text(reader, pos, text)))
                else:
                    out.append((pos, 1, self._image(reader, pos, text, images[i], names[i] if names else None)))
            except DataError as err:
                reader.bad(err)  # the reader's policy: it counts into the epoch of its split
        return out

    def _parse_records(self, reader: ParquetSplitReader, block_pos: int, block: Any,
                       records: Records) -> list[tuple[int, int, Any]]:
        """Rows as dicts of the columns read (a dotted field also under its dotted name), through `records`."""
        rows = block.to_pylist()
        for field in (records.field, records.tools, records.documents):
            if field is not None and field not in block.column_names:
                for row, value in zip(rows, _values(block, field)):
                    row[field] = value
        out = []
        for i, row in enumerate(rows):
            pos = block_pos + i
            if not records.chat and isinstance(text := row.get(records.field), bytes):
                try:
                    row[records.field] = self._utf8(reader, pos, text)  # transforms see the text as a str
                except DataError as err:
                    reader.bad(err)
                    continue
            payload = records.payload(row, reader, pos)  # a transform's error is raised whatever on_bad says
            if payload is None:
                continue
            try:
                out.append((pos, 1, payload if records.chat else self._text(reader, pos, payload)))
            except DataError as err:
                reader.bad(err)
        return out

    def _error(self, reader: ParquetSplitReader, pos: int, column: str, what: str) -> DataError:
        hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such rows)'
        return DataError(f"bad row in {reader.kind} file {reader.key!r}, column {column!r}, {reader.where(pos)}: "
                         f"{what}{hint}", key=reader.key, offset=pos)

    def _text(self, reader: ParquetSplitReader, pos: int, text: str | bytes | None) -> str:
        if text is None:
            raise self._error(reader, pos, self.text_field, "the value is null")
        if isinstance(text, bytes):  # a binary column: its bytes are the text's UTF-8
            text = self._utf8(reader, pos, text)
        if len(text) > self.max_record and len(text.encode()) > self.max_record:
            raise self._error(reader, pos, self.text_field, f"the text is longer than max_record_bytes = "
                                                             f"{self.max_record}: raise the limit or fix the data")
        return text

    def _utf8(self, reader: ParquetSplitReader, pos: int, data: bytes) -> str:
        try:
            return data.decode()
        except UnicodeDecodeError as exc:
            raise self._error(reader, pos, self.text_field, f"the binary value is not UTF-8 text ({exc.reason} at "
                                                             f"byte {exc.start})") from None

    def _image(self, reader: ParquetSplitReader, pos: int, text: str | None, image: bytes | None,
               name: str | None) -> ImageRecord:
        caption = self._text(reader, pos, text)
        if not caption.strip():
            raise self._error(reader, pos, self.text_field, "the caption is empty")
        assert self.image_field is not None
        if image is None:
            raise self._error(reader, pos, self.image_field, "the image is null" if not name else
                              f"the image's bytes are null and it names only a path, {name!r}: images are read "
                              "from their bytes, not from paths; write the files with the images' bytes in them")
        if len(image) > self.max_record:
            raise self._error(reader, pos, self.image_field, f"the image takes {len(image)} bytes, more than "
                                                              f"max_record_bytes = {self.max_record}")
        group, row = reader.locate(pos)
        return ImageRecord(caption, image, name or f"row {row} of row group {group}")


def _column(block: Any, name: str) -> Any:
    """Column `name` of `block` (a top-level name, else a dotted path into structs) as one array;
    a null struct makes its fields null."""
    import pyarrow.compute as pc

    if name in block.column_names:
        return block.column(name).combine_chunks()
    head, *rest = name.split(".")
    arr = block.column(head).combine_chunks()
    for part in rest:
        arr = pc.struct_field(arr, [part])
    return arr


def _values(block: Any, name: str) -> list[Any]:
    return _column(block, name).to_pylist()


def _image_values(block: Any, name: str) -> tuple[list[bytes | None], list[str | None] | None]:
    """An image column's bytes and, for HF's struct<bytes, path>, its paths (for messages)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = _column(block, name)
    if not pa.types.is_struct(arr.type):
        return arr.to_pylist(), None
    names = [f.name for f in arr.type]
    paths = pc.struct_field(arr, ["path"]).to_pylist() if "path" in names else None
    return pc.struct_field(arr, ["bytes"]).to_pylist(), paths


def _first_bad_row(block: Any) -> int:
    """The first row of `block` (a table of the columns read) whose strings are not all UTF-8, by
    halving (a row is found in log2(rows) conversions of at most half the table each)."""
    lo, hi = 0, block.num_rows  # the first bad row is in [lo, hi): halve, converting the first half
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            block.slice(lo, mid - lo).to_pylist()
        except UnicodeDecodeError:
            hi = mid
        else:
            lo = mid
    return lo
