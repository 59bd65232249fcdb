"""Parquet shards: the footer, the byte ranges of the columns a reader needs, and decoding a row
group from just those bytes.

A Parquet file's footer lists every row group and, per column chunk, where its bytes lie. The
planner reads the footer (one or two ranged reads of the tail), checks the columns, and makes
the row groups the splits. A lane then fetches only the chunks of its row groups' needed
columns, through the Store's ranged reads (so S3 works, with the read-ahead window), and
pyarrow decodes them from a `_Sparse` file that holds only those ranges and refuses any other
read: nothing else of the file is ever fetched.

```
file:  |PAR1|rg0: id text meta|rg1: id text meta|...|footer|len|PAR1|
reads:             ^^^^              ^^^^           ^^^^^^^^^^^^^^^^  (text_field = "text")
```

A record's reference is (split, row within the split, 1): restore decodes one row group's
columns to find it. Memory per lane: one row group's needed columns, compressed and decoded.
"""

from __future__ import annotations

import struct
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from zephon_stream.connectors.base import Store
from zephon_stream.errors import DataError

__all__ = ["PARQUET_SUFFIXES", "Column", "ParquetFooter", "chunk_bytes", "column_ranges", "decode_row_group",
           "read_footer", "resolve_column"]

PARQUET_SUFFIXES = (".parquet",)
_MAGIC = b"PAR1"
_TAIL = 64 << 10  # the first read of a footer: most footers fit
_MAX_FOOTER = 256 << 20  # a footer that claims more is corrupt (a hostile length)
_CACHED = 64  # footers kept per store: readers of the same file reuse it
_STRING = ("string", "large_string", "string_view")
_BINARY = ("binary", "large_binary", "binary_view")


class Column:
    """A column a source reads: `path` as Parquet names it ("meta.text"), `kind` what it holds
    ("text", "messages", "image", "tools", "documents"; "record" for a whole row's columns)."""

    def __init__(self, name: str, path: list[str], kind: str) -> None:
        self.name, self.path, self.kind = name, path, kind
        self.dotted = ".".join(path)

    def __repr__(self) -> str:
        return f"Column({self.name!r}, {self.kind})"


class ParquetFooter:
    """A parsed footer: pyarrow's FileMetaData and the file's Arrow schema."""

    def __init__(self, key: str, size: int, metadata: Any) -> None:
        self.key, self.size, self.metadata = key, size, metadata
        self.schema = metadata.schema.to_arrow_schema()

    def row_counts(self) -> list[int]:
        return [self.metadata.row_group(g).num_rows for g in range(self.metadata.num_row_groups)]


class _Sparse:
    """A read-only file of `size` bytes of which only `parts` ({offset: bytes}) are known, for
    pyarrow: a read outside them is an error, so a reader never fetches more than it planned."""

    def __init__(self, key: str, size: int, parts: dict[int, bytes]) -> None:
        self.key, self.size, self.parts, self.pos, self.closed = key, size, parts, 0, False

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = (pos, self.pos + pos, self.size + pos)[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        for lo, data in self.parts.items():
            if lo <= self.pos and self.pos + n <= lo + len(data):
                self.pos += n
                return data[self.pos - n - lo:self.pos - lo]
        raise OSError(f"bytes {self.pos}..{self.pos + n} of {self.key!r} lie outside its column chunks: the "
                      "footer's chunk offsets are wrong")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def _open(key: str, size: int, parts: dict[int, bytes], metadata: Any = None) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.ParquetFile(pa.PythonFile(_Sparse(key, size, parts), mode="r"), metadata=metadata, pre_buffer=False)


_footers: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, int, str], ParquetFooter]] = \
    weakref.WeakKeyDictionary()


async def read_footer(store: Store, key: str, size: int, etag: str = "") -> ParquetFooter:
    """The footer of Parquet file `key` (cached per store, by key, size and etag); a DataError
    naming the file if it is not Parquet or its footer is corrupt."""
    cache = _footers.setdefault(store, OrderedDict())
    if (key, size, etag) in cache:
        cache.move_to_end((key, size, etag))
        return cache[key, size, etag]
    footer = await _read_footer(store, key, size)
    cache[key, size, etag] = footer
    while len(cache) > _CACHED:
        cache.popitem(last=False)
    return footer


async def _read_footer(store: Store, key: str, size: int) -> ParquetFooter:
    def bad(why: str) -> DataError:
        return DataError(f"corrupt Parquet file {key!r}: {why}; rewrite it (or set on_bad_record = \"skip\" to "
                         "leave it out)", key=key, offset=max(0, size - 8))

    if size < 12:
        raise bad(f"{size} bytes, fewer than a Parquet file's magic and footer length")
    tail = await store.read(key, max(0, size - _TAIL), size)
    if tail[-4:] != _MAGIC:
        raise bad(f"it ends with {tail[-4:].hex(' ')}, not the magic PAR1 (is it a Parquet file? an encrypted "
                  "footer, PARE, is not supported)")
    n = struct.unpack_from("<I", tail, len(tail) - 8)[0]
    if n + 12 > size or n > _MAX_FOOTER:
        raise bad(f"the footer length {n} does not fit in the file's {size} bytes")
    if n + 8 > len(tail):
        tail = await store.read(key, size - n - 8, size)
    try:
        metadata = _open(key, size, {size - len(tail): tail}).metadata
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise bad(f"the footer does not decode: {_one_line(exc)}") from exc
    return ParquetFooter(key, size, metadata)


def resolve_column(footer: ParquetFooter, name: str, kind: str) -> Column:
    """The column `name` names in the file (a top-level name, else a dotted path into structs),
    checked to hold what `kind` says: `"text"` a string (or binary: UTF-8 bytes), `"messages"` a
    list, `"image"` binary or HF's struct<bytes, path>, `"tools"` and `"documents"` a list or a string."""
    import pyarrow as pa

    schema, key = footer.schema, footer.key
    file = f"{getattr(footer, 'format', 'Parquet')} file {key!r}"
    parts = [name] if name in schema.names else name.split(".")
    fields: Any = schema
    for part in parts:
        if fields is None or part not in [f.name for f in fields]:
            raise DataError(f"{file} has no column {name!r} (its columns: {_names(schema)}): set {_SETTING[kind]} "
                            "to one of them (a dotted path reaches into struct columns)", key=key, offset=0)
        try:
            field = fields.field(part)
        except KeyError:  # the name is there more than once: no one column to read
            raise DataError(f"{kind} column {name!r} of {file} is ambiguous: {part!r} names more than one field "
                            f"(its columns: {_names(schema)})", key=key, offset=0) from None
        fields = field.type if pa.types.is_struct(field.type) else None
    _check_type(file, key, name, field.type, kind)
    return Column(name, parts, kind)


def _names(schema: Any) -> str:
    """A schema's column names for a one-line message (a name with a newline or other control
    character shown escaped)."""
    return ", ".join(n if n.isprintable() else repr(n) for n in schema.names)


def _check_type(file: str, key: str, name: str, dtype: Any, kind: str) -> None:
    import pyarrow as pa

    shown = dtype
    if pa.types.is_dictionary(dtype):  # dictionary-encoded (pandas' category): its values are what it holds
        dtype = dtype.value_type
    ok = str(dtype) in _STRING or (kind == "text" and str(dtype) in _BINARY)  # binary text: UTF-8, checked per value
    if kind == "messages":  # a chat source's conversations: a list (of structs {role, content}, as HF writes them)
        ok = str(dtype).startswith(("list<", "large_list<"))
    if kind in ("tools", "documents"):  # a list (of function specs, of documents), or a JSON string of one
        ok = ok or str(dtype).startswith(("list<", "large_list<"))
    if kind == "image":
        ok = str(dtype) in _BINARY or (str(dtype).startswith("struct") and "bytes" in [f.name for f in dtype]
                                       and str(dtype.field("bytes").type) in _BINARY)
    if not ok:
        want = {"text": "a string", "messages": "a list of messages (list<struct<role, content>>)",
                "tools": "a list of function specs, or a JSON string of one",
                "documents": "a list of documents, or a JSON string of one"}.get(
            kind, "binary, or a struct<bytes: binary, path: string> (HF Image)")
        shown = str(shown) if str(shown).isprintable() else repr(str(shown))
        if str(dtype) == "null":  # no value in the whole file: what pyarrow writes for a column made of []
            raise DataError(f"column {name!r} of {file} is of type null: it holds no value in the whole file (a "
                            f"table made from an empty list has no rows), so it can be no {kind} column; leave the "
                            "file out, or write it with a typed column", key=key, offset=0)
        raise DataError(f"column {name!r} of {file} is {shown}, not {want}: name a {kind} column ({_SETTING[kind]})",
                        key=key, offset=0)


_SETTING = {"text": "text_field", "messages": "messages_field", "image": "image_field", "tools": "tools_field",
            "documents": "documents_field"}


def column_ranges(footer: ParquetFooter, group: int, columns: Sequence[Column]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of the chunks of `columns` in row group `group`, in file order."""
    rg = footer.metadata.row_group(group)
    out: list[tuple[int, int]] = []
    if rg.num_rows == 0:  # nothing to read: its chunks may list no data page at all (offset 0, as pyarrow writes)
        return out
    for c in range(rg.num_columns):
        chunk = rg.column(c)
        try:
            path = chunk.path_in_schema
        except UnicodeDecodeError as exc:  # decoded from the footer only here
            raise DataError(f"corrupt Parquet file {footer.key!r}: row group {group} column {c} has a name that is "
                            f"not UTF-8 ({exc.reason})", key=footer.key, offset=0) from exc
        if not any(path == col.dotted or path.startswith(col.dotted + ".") for col in columns):
            continue
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset
        end = start + chunk.total_compressed_size
        if start < 4 or end > footer.size - 8:
            raise DataError(f"corrupt Parquet file {footer.key!r}: row group {group} column {path!r} lists bytes "
                            f"{start}..{end}, outside the file's data (it has {footer.size} bytes)",
                            key=footer.key, offset=start)
        out.append((start, end))
    return sorted(out)


def chunk_bytes(footer: ParquetFooter, columns: Sequence[Column]) -> list[int]:
    """The compressed bytes of `columns` in each row group: what a reader fetches for it."""
    return [sum(b - a for a, b in column_ranges(footer, g, columns)) for g in range(footer.metadata.num_row_groups)]


def decode_row_group(footer: ParquetFooter, group: int, columns: Sequence[Column], parts: dict[int, bytes]) -> Any:
    """Row group `group`'s `columns` as a pyarrow Table, decoded from `parts` (their chunks' bytes)."""
    try:
        return _open(footer.key, footer.size, parts, footer.metadata).read_row_group(
            group, columns=[c.dotted for c in columns], use_threads=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"corrupt Parquet file {footer.key!r}: row group {group} does not decode: {_one_line(exc)}",
                        key=footer.key, offset=group) from exc


def _one_line(exc: BaseException) -> str:
    """pyarrow's message for `exc` on one line (its thrift errors end in a newline)."""
    return " ".join(str(exc).split())
