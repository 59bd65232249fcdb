"""`shard`: turn what users have into shards that split well: seekable multi-frame JSONL.zst, or
WebDataset tar shards for images.

    from zephon_stream.shard import shard
    shard("s3://corpus/raw/", "s3://corpus/shards/", target_bytes=128 << 20)

Inputs, by key suffix under `src` (a URI or a local path; a file or a folder):

- JSON lines: `*.jsonl`, `*.jsonl.zst`, `*.jsonl.gz`, `*.json.gz`; each line is kept as it is
  (so `text_field` stays valid), after a check that it is a JSON object whose `text_field` is a
  string;
- JSON files: `*.json` (when there are no files of the above, as a folder's `dataset_info.json`
  is not data): JSON lines, or one JSON array of records (Alpaca style, pretty-printed or not,
  read whole), each record written as one compact line after the same check;
- Arrow IPC: `*.arrow` (Hugging Face datasets' `save_to_disk` output, streams or files, read
  whole), rows read as Parquet's; the `dataset_info.json` and `state.json` beside them are not
  input, and a DatasetDict's top folder (`dataset_dict.json`) is refused: name one split;
- Parquet: `*.parquet`; each row becomes `{"text": ...}` from column `text_field` (a dotted path
  reaches into structs);
- chat data, with `messages_field` (and `tools_field`, `documents_field`): JSON lines and `.json`
  records kept as they are, Parquet rows written as `{messages_field: ..., tools_field: ...}`; each
  conversation is checked as a chat source reads it (roles, contents, tools, documents), so a bad
  one is a bad record here;
- CSV: `*.csv`, `*.tsv` (tab-separated), gzipped or not (`.csv.gz`), a header line naming the
  columns; each row becomes `{"text": ...}` from column `text_field`, read as a string whatever it
  looks like (a quoted value may hold newlines and delimiters; a row with too few or too many
  values is a bad record); streamed through a temporary file in TMPDIR (inflated and checked for
  UTF-8 first: a file that is not UTF-8 is refused whole), so memory stays bounded (pyarrow reads
  three blocks of `max_record_bytes` + 1 MiB ahead); not for chat data or images;
- text files: `*.txt`, `*.md` (when there are no files of the above); each file becomes
  `{"id": its name, "text": its content}`;
- with `image_field`: an image folder (image files, extensions `image_field`, with a caption file
  of extension `text_field` beside each) or Parquet with an image column named `image_field`
  (binary, or HF's `Image` struct<bytes, path>), written as tar shards of samples
  `{n:09d}.{png|jpg|...}` + `{n:09d}.txt`, the image bytes as they were; beside each shard, its
  name map `_{name}-{i:05d}.names.jsonl` says which input each sample was.

Outputs go to `dst` as `{name}-{i:05d}.jsonl.zst` (or `.tar`), each about `target_bytes`
(compressed), in input order (inputs sorted by key). A JSONL.zst shard is a run of independent
zstd frames of whole lines, each about `frame_bytes` of input, closed by a seek table: the
loader plans it with one ranged read and cuts it into splits at frames, so many lanes share
it. Reads and writes go through the Store API (file://, s3://); a shard is put whole, so memory
is about one shard.
"""

from __future__ import annotations

import codecs
import functools
import io
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

import anyio
import msgspec
import zstandard

from zephon_stream.connectors import missing_locally, open_store, parse_uri
from zephon_stream.connectors.base import ObjectInfo, Store
from zephon_stream.engine import threads
from zephon_stream.errors import ConfigError, DataError, ZephonError
from zephon_stream.formats.jsonl_zst import seek_table, write_jsonl_shards
from zephon_stream.formats.parquet import PARQUET_SUFFIXES
from zephon_stream.loader.config import SourceConfig
from zephon_stream.operators.read import (
    MAX_DEPTH,
    NAME_MAP_SUFFIX,
    SUFFIXES,
    BadRecords,
    Parser,
    Split,
    SplitReader,
    is_object,
    nesting,
    plan_parquet,
    plan_shard,
    visible,
)
from zephon_stream.operators.transforms import Records
from zephon_stream.operators.types import Conversation, field

__all__ = ["ShardReport", "shard", "write_jsonl_shards"]

TEXT_SUFFIXES = (".txt", ".md")
ARROW_SUFFIXES = (".arrow",)  # Arrow IPC: Hugging Face datasets' save_to_disk output, as Parquet is read
# what Hugging Face datasets' save_to_disk writes beside its .arrow files: metadata, never input
_HF_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")
JSON_SUFFIXES = (".json",)  # JSON lines or one JSON array of records: read when there are no JSONL or Parquet files
CSV_SUFFIXES = (".csv", ".tsv", ".csv.gz", ".tsv.gz")  # a header, then a row a line (quoted values hold newlines too)
_ARRAY_MAX = 4 << 30  # the largest JSON array file read whole
# a gzipped CSV may inflate to this many times its size, or to _ARRAY_MAX if more (text: 3-10 times)
_INFLATE_RATIO = 100
_CSV_PART = 8 << 20  # bytes of a CSV file read from the store at a time
_CSV_BLOCK_MAX = 1 << 30  # pyarrow's CSV block is an int32; a row over it ends the file, as it says
_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpg"), (b"GIF8", "gif"), (b"BM", "bmp"))
_enc = msgspec.json.Encoder()


class ShardReport(msgspec.Struct, frozen=True):
    """What `shard` did: inputs read, documents (samples) written, bad records skipped, the output keys."""

    inputs: int
    documents: int
    skipped: int
    bytes_in: int
    bytes_out: int
    shards: list[str]


def shard(src: str, dst: str, *, target_bytes: int = 128 << 20, frame_bytes: int = 256 << 10,
          text_field: str | None = None, image_field: str | None = None, name: str = "shard",
          on_bad: Literal["error", "skip"] = "error", max_record_bytes: int = 16 << 20,
          progress: bool | None = None, messages_field: str | None = None, tools_field: str | None = None,
          documents_field: str | None = None, delimiter: str | None = None, **store_options: Any) -> ShardReport:
    """Convert the inputs under `src` into shards under `dst` (see the module docstring).

    `text_field` defaults to `"txt"` (the caption files' extension) for an image folder, else `"text"`.
    `messages_field` (and `tools_field`, `documents_field`) make it chat data, checked as a chat
    source reads it.
    `delimiter`: the one character between CSV values (None: `,` for `.csv`, a tab for `.tsv`;
    the two characters `\\t` are a tab too).
    `progress`: a tqdm bar on stderr (None: when stderr is a terminal), else a plain line every 5 s.
    `store_options` go to both stores (`endpoint_url=`, `region=`, `addressing_style=` for S3).
    Bad records raise a DataError naming the object and offset, or with `on_bad="skip"` are
    counted in the report.
    """
    for what, value in (("target_bytes", target_bytes), ("frame_bytes", frame_bytes),
                        ("max_record_bytes", max_record_bytes)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{what} is a number of bytes (an int, e.g. 128 << 20), not {value!r}")
        if value < 1:
            raise ConfigError(f"{what} must be >= 1, got {value}")
    if not name or "/" in name:
        raise ConfigError(f"name {name!r} must be a non-empty file name without '/'")
    if messages_field is not None and (text_field is not None or image_field is not None):
        raise ConfigError("messages_field makes it chat data, whose records have no text_field or image_field: "
                          "give messages_field alone (and tools_field, documents_field)")
    for what, value in (("tools_field", tools_field), ("documents_field", documents_field)):
        if value is not None and messages_field is None:
            raise ConfigError(f"{what} is for chat data: give messages_field too")
    delimiter = "\t" if delimiter == "\\t" else delimiter  # `--delimiter '\t'`, as a shell passes it
    if delimiter is not None and (len(delimiter) != 1 or delimiter in "\"\r\n"):
        raise ConfigError(f"delimiter {delimiter!r} must be one character, not a quote or a line break")
    job = _Job(target_bytes, frame_bytes, text_field, image_field, name, on_bad, max_record_bytes)
    job.delimiter = delimiter
    if messages_field is not None:
        job.chat = _CheckedChat(job, SourceConfig(name="shard", uri="file:///", messages_field=messages_field,
                                                  tools_field=tools_field, documents_field=documents_field))
    return anyio.run(job.run, src, dst, progress, store_options)


class _ArrowFile(NamedTuple):
    """What `resolve_column` reads of a Parquet footer, for an Arrow file."""

    key: str
    schema: Any
    format: str = "Arrow"


class _ArrowRows:
    """What a table row parser asks of its reader, for the rows of an Arrow file."""

    def __init__(self, key: str, bad: BadRecords, kind: str) -> None:
        self.key, self.bad, self.kind = key, bad, kind  # kind: "Arrow", "CSV" (a row's errors name it)

    def where(self, pos: int) -> str:
        return f"row {pos}"


class _CheckedChat(Records):
    """Chat records whose conversations (and tools, documents) are also checked as a chat source reads them,
    so a conversation the loader would refuse is a bad record here, in file order."""

    def __init__(self, job: _Job, src: SourceConfig) -> None:
        super().__init__(src)
        self.job = job

    def payload(self, record: Any, reader: Any, pos: int) -> Any:
        value = super().payload(record, reader, pos)
        if value is None or self.job.conversation(value, reader.key, reader.where(pos), pos):
            return value
        return None


class _Gunzip:
    """Every member of a gzip stream, inflated as its bytes come (`feed`, then `close`), in pieces of
    at most `piece` bytes and at most `most` bytes in all: a bomb is a ValueError, a damaged member
    a zlib.error, a stream cut short an EOFError (from `close`). Zeros after a member are padding,
    as gzip allows."""

    def __init__(self, most: int, piece: int = 16 << 20) -> None:
        self.most, self.piece, self.out = most, piece, 0
        self._member: Any = None  # the member being inflated
        self._members = 0  # members that ended
        self._padding = False  # zeros came after the last one

    def feed(self, data: bytes) -> Iterator[bytes]:
        while data:
            if self._member is None:
                if self._members and not data.strip(b"\0"):
                    self._padding = True
                    return
                if self._padding:
                    raise zlib.error("bytes after the zeros that pad its last member")
                self._member = zlib.decompressobj(31)
            chunk = self._member.decompress(data, min(self.piece, self.most + 1 - self.out))
            self.out += len(chunk)
            if self.out > self.most:
                raise ValueError(f"it inflates to more than {self.most} bytes (4 GiB, or {_INFLATE_RATIO} times its "
                                 "size if more): a decompression bomb? If not, gunzip it first")
            yield chunk
            if self._member.eof:
                data, self._member, self._members = self._member.unused_data, None, self._members + 1
            else:
                data = self._member.unconsumed_tail

    def close(self) -> None:
        if self._member is not None:
            raise EOFError("it is cut short: its last gzip member does not end")


class _Utf8Check:
    """Checks a stream of bytes for UTF-8 a piece at a time and keeps none of the text (a whole
    `decode` holds the bytes again as a str, up to four times their size). `feed` gives the
    offset and the value of the first byte that is not UTF-8, or None."""

    def __init__(self) -> None:
        self._decoder, self.seen = codecs.getincrementaldecoder("utf-8")(), 0

    def feed(self, piece: bytes | memoryview, final: bool = False) -> tuple[int, int] | None:
        pending = len(self._decoder.getstate()[0])  # the bytes of a character cut at the last piece's end
        try:
            self._decoder.decode(piece, final)
        except UnicodeDecodeError as exc:
            return self.seen - pending + exc.start, exc.object[exc.start]
        self.seen += len(piece)
        return None


class _PacedFile(io.RawIOBase):
    """A file that pyarrow's CSV reader reads only `ahead` blocks beyond the batches taken from it.
    The reader reads on a thread of its own, up to 32 blocks ahead of the batches (its read-ahead
    cannot be set), and a block holds `max_record_bytes` + 1 MiB. Each batch taken (`wait`) lets
    it read one block more. A read is held at most `patience` seconds while the batches' side
    waits for the reader (a row that spans blocks may need one more), so the two never wait on
    each other for good. `close` ends a reader that waits.

    `spool` is a file that two readers share, one after the other (the header's, then the rows'):
    each reads from its own position (`_SPOOL_LOCK` keeps a seek and its read together), and
    neither closes it."""

    def __init__(self, spool: Any, block: int, ahead: int = 3, patience: float = 0.2) -> None:
        super().__init__()
        self._file, self._block, self._ahead, self._patience = spool, block, ahead, patience
        self._read = self._batches = 0
        self._since: float | None = None  # when the batches' side began to wait for the reader
        self._done = False
        self._turn = threading.Condition()

    def readable(self) -> bool:
        return True

    @property
    def bytes_read(self) -> int:
        with self._turn:
            return self._read

    def _may_read(self) -> bool:
        return (self._done or self._read < (self._batches + self._ahead) * self._block
                or (self._since is not None and time.monotonic() - self._since >= self._patience))

    def readinto(self, buffer: Any) -> int:
        with self._turn:
            while not self._may_read():
                self._turn.wait(None if self._since is None else self._patience / 4)
            if self._done:  # closed while the reader waited: it ends
                return 0
        with _SPOOL_LOCK:  # a closed reader's last read may still be running on pyarrow's thread
            self._file.seek(self._read)
            n = self._file.readinto(buffer)
        with self._turn:
            self._read += n
        return n

    def wait(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`call(*args, **kwargs)`: a pyarrow call that waits for the reader (the open, which
        reads the first batch, and each next batch)."""
        with self._turn:
            self._since = time.monotonic()
            self._turn.notify_all()
        try:
            return call(*args, **kwargs)
        finally:
            with self._turn:
                self._since, self._batches = None, self._batches + 1
                self._turn.notify_all()

    def close(self) -> None:
        with self._turn:
            self._done = True
            self._turn.notify_all()
        super().close()


_SPOOL_LOCK = threading.Lock()  # see _PacedFile


def _header_past(spool: Any, block: int) -> bool:
    """Whether the first line of CSV file `spool` that is not blank is longer than `block` bytes
    (pyarrow then finds no row in its first block: "Empty CSV file or block")."""
    with _SPOOL_LOCK:
        spool.seek(0)
        while (piece := spool.read(1 << 20)) and not piece.strip(b"\r\n"):
            pass
        line = piece.lstrip(b"\r\n")
        line += spool.read(max(0, block + 1 - len(line)))
    return len(line) > block and b"\n" not in line[:block + 1]


def _other_delimiter(header: str, used: str) -> str | None:
    """The delimiter a CSV header of one column name seems to use instead of `used`, if any."""
    return next((c for c in (";", "\t", "|", ",") if c != used and c in header), None)


def _one_line(exc: BaseException, most: int = 300) -> str:
    """pyarrow's message as one line: a CSV error quotes the row, newlines and all."""
    text = " ".join(str(exc).split())
    return text if len(text) <= most else text[:most - 3] + "..."


def _place(uri: str) -> str:
    """Where `uri` (a URI or a local path) points, comparable between two: `file:///abs/path` or
    `s3://bucket/key`, a folder ending in '/'."""
    if "://" not in uri:
        path = Path(uri).resolve()
        return path.as_uri() + ("/" if path.is_dir() or uri.endswith("/") else "")
    scheme, location, prefix = parse_uri(uri)
    if scheme == "file":
        path = Path(location) / prefix
        return path.resolve().as_uri() + ("/" if path.is_dir() or uri.endswith("/") else "")
    return f"{scheme}://{location.strip('/')}/{prefix}"


def _refuse_overlap(src: str, dst: str) -> None:
    """A ConfigError if the output folder `dst` is the input, inside it, or holds it: a loader
    source reads every data file under its folder, so one would read every document twice (the
    shards and the file they came from)."""
    a, b = _place(src), _place(dst.rstrip("/") + "/")
    if a == b.rstrip("/") or b.startswith(a if a.endswith("/") else a + "/"):
        where = "is the input" if a.rstrip("/") == b.rstrip("/") else "is inside the input"
        raise ConfigError(f"shard: the output {dst} {where} {src}: a source at {src} (or the next shard of it) would "
                          "read the shards too, and every document twice; write them to a folder of their own")
    if a.startswith(b):
        raise ConfigError(f"shard: the output {dst} holds the input {src}: a source at {dst} would read the input too, "
                          "and every document twice; write the shards to a folder of their own")


def _store_for(uri: str, options: dict[str, Any]) -> tuple[Store, str]:
    """(store, key prefix) for a URI or a local path; a local path is file:// (a folder)."""
    if "://" not in uri:
        uri = Path(uri).resolve().as_uri()
    scheme, location, prefix = parse_uri(uri)
    if scheme == "file" and Path(location).is_file():  # one file: its folder, the file's name as the prefix
        return open_store(Path(location).parent.as_uri() + "/")[0], Path(location).name
    if scheme != "file" and prefix and not uri.endswith("/"):  # maybe one object: list without the '/'
        prefix = prefix.rstrip("/")
    return open_store(uri, **({} if scheme == "file" else options))[0], prefix


class _Job:
    def __init__(self, target: int, frame: int, text_field: str | None, image_field: str | None, name: str,
                 on_bad: Literal["error", "skip"], max_record: int) -> None:
        self.target, self.frame, self.image_field = target, frame, image_field
        self.field = text_field
        self.name, self.on_bad, self.max_record = name, on_bad, max_record
        self.bad = BadRecords(on_bad)
        self.documents = 0
        self.listed: set[str] = set()  # every key under the input prefix (captions beside images)
        self.base = ""  # the input folder's prefix: an image sample's name map gives its input's key below it
        self.single = False  # the input is one file (its caption is not in `listed`)
        self.hidden = 0  # the input folder's files that `visible` left out (names starting with "." or "_")
        self.text_field = "text"  # `field`, or its default for the inputs found
        self.chat: _CheckedChat | None = None  # chat data: its messages (and tools) field
        self.delimiter: str | None = None  # CSV: the one between values (None: by suffix)
        self.meter = _Progress(0, False, io.StringIO())  # `run`'s

    async def run(self, src: str, dst: str, progress: bool | None, options: dict[str, Any]) -> ShardReport:
        _refuse_overlap(src, dst)
        store_in, prefix_in = _store_for(src, options)
        store_out, prefix_out = _store_for(dst if dst.endswith("/") or "://" not in dst else dst + "/", options)
        async with store_in, store_out:
            objects = await self._inputs(store_in, prefix_in, src)
            await self._refuse_existing(store_out, prefix_out, dst)
            out = _TarOut(self, store_out, prefix_out) if self.image_field else _ZstOut(self, store_out, prefix_out)
            self.meter = meter = _Progress(sum(o.size for o in objects), progress,
                                           counts=lambda: (self.documents, len(out.keys)))
            metered = _Metered(store_in, meter)
            try:
                for obj in objects:
                    meter.start_object(obj)
                    async for item in self._items(metered, obj):
                        await out.add(item)
                        meter.tick()
                    meter.done_object()
                await out.close()
            except BaseException:
                meter.close(done=False)  # the error is the last line, not a progress line
                raise
            meter.close()
        return ShardReport(len(objects), self.documents, self.bad.count, sum(o.size for o in objects), out.bytes_out,
                           out.keys)

    async def _inputs(self, store: Store, prefix: str, src: str) -> list[ObjectInfo]:
        """The input objects, sorted by key: the one object `prefix` names, else those under it."""
        objects = sorted(await store.list(prefix), key=lambda o: o.key)
        self.listed = {o.key for o in objects}
        exact = [o for o in objects if o.key == prefix] if prefix and not prefix.endswith("/") else []
        self.single = bool(exact)
        if not exact:  # a folder: what is hidden in it is not input (a file named by itself is)
            under = prefix + "/" if prefix and not prefix.endswith("/") else prefix
            inside = [o for o in objects if o.key.startswith(under)]  # not a sibling's ("data-old/" beside "data")
            objects = visible(inside, under, "zephon shard", src, JSON_SUFFIXES + CSV_SUFFIXES + TEXT_SUFFIXES)
            self.hidden = len(inside) - len(objects)
            self.base = under
        else:
            self.base = prefix.rpartition("/")[0] + "/" if "/" in prefix else ""
        if not exact and any(o.key == under + "dataset_dict.json" for o in objects):
            splits = sorted({o.key[len(under):].split("/")[0] for o in objects if "/" in o.key[len(under):]})
            raise ConfigError(f"shard: {src} is a Hugging Face DatasetDict (dataset_dict.json): shard one split's "
                              f"folder ({', '.join(splits) or 'train/'}), not all of them together")
        objects = exact or [o for o in objects if o.key.rsplit("/", 1)[-1] not in _HF_METADATA]
        suffixes = self._suffixes(objects)
        folder = self.image_field is not None and suffixes != PARQUET_SUFFIXES
        self.text_field = self.field if self.field is not None else "txt" if folder else "text"
        if self.chat is not None:
            self.text_field = self.chat.field
            if suffixes in (TEXT_SUFFIXES, CSV_SUFFIXES) and any(o.key.lower().endswith(suffixes) for o in objects):
                why = " (a CSV value is a string, not a list of messages)" if suffixes == CSV_SUFFIXES else ""
                raise ConfigError(f"shard: {src} holds {' '.join('*' + x for x in suffixes)} files, which hold no "
                                  f"conversations{why}: chat data is read from JSON lines, .json, Parquet or Arrow "
                                  "files")
        found = [o for o in objects if o.key.lower().endswith(suffixes)] if suffixes else []
        if not found:
            raise ConfigError(self._no_input(src, objects))
        return found

    def _no_input(self, src: str, objects: list[ObjectInfo]) -> str:
        """What is wrong with an input that gave no object to read: there is nothing, or nothing of a kind read."""
        if not objects and self.hidden:  # all left out by `visible` (it warned of those with a data suffix)
            return (f"shard: {src} holds no files to read: its {self.hidden} files are all under names that start "
                    "with '.' or '_' (hidden, or a job's temporary output), which zephon shard leaves out: rename them")
        if not objects:
            return f"shard: {src} {'does not exist' if missing_locally(src) else 'holds no files'}"
        kinds = ((*PARQUET_SUFFIXES, *ARROW_SUFFIXES, *(f".{e.strip().lower()}" for e in self.image_field.split(";")
                                                          if e.strip())) if self.image_field else
                 (*SUFFIXES, *JSON_SUFFIXES, *PARQUET_SUFFIXES, *ARROW_SUFFIXES, *CSV_SUFFIXES, *TEXT_SUFFIXES))
        some = ", ".join(o.key.rsplit("/", 1)[-1] for o in objects[:3]) + (", ..." if len(objects) > 3 else "")
        return (f"shard: no input under {src}: it holds {len(objects)} files ({some}), none of a kind zephon shard "
                f"reads: {' '.join('*' + k for k in kinds)}")

    def _suffixes(self, objects: list[ObjectInfo]) -> tuple[str, ...]:
        """The input family: JSON lines or Parquet if there are any, else text files (or images)."""
        if self.image_field:
            if any(o.key.endswith(PARQUET_SUFFIXES) for o in objects):
                return PARQUET_SUFFIXES
            if any(o.key.endswith(ARROW_SUFFIXES) for o in objects):
                return ARROW_SUFFIXES
            return tuple(f".{e.strip().lower()}" for e in self.image_field.split(";") if e.strip())
        if any(o.key.endswith(PARQUET_SUFFIXES) for o in objects):
            return PARQUET_SUFFIXES
        if any(o.key.endswith(SUFFIXES) for o in objects):
            return SUFFIXES
        if any(o.key.endswith(ARROW_SUFFIXES) for o in objects):
            return ARROW_SUFFIXES
        if any(o.key.lower().endswith(JSON_SUFFIXES) for o in objects):
            return JSON_SUFFIXES
        if any(o.key.lower().endswith(CSV_SUFFIXES) for o in objects):
            return CSV_SUFFIXES
        return TEXT_SUFFIXES

    async def _refuse_existing(self, store: Store, prefix: str, dst: str) -> None:
        taken = [o.key for o in await store.list(prefix + self.name + "-")]
        maps = [o.key for o in await store.list(prefix + "_" + self.name + "-")]  # image shards' name maps
        if taken or maps:
            named = f"{self.name}-*" + (f" and _{self.name}-*" if maps else "")
            raise ConfigError(f"shard: {dst} already holds {(taken or maps)[0]!r} ({len(taken) + len(maps)} objects "
                              f"named {named}): remove them to shard again, or write to another folder (another "
                              "name adds a second set of shards beside these, and a source over the folder reads "
                              "both)")

    def _items(self, store: Store, obj: ObjectInfo) -> AsyncIterator[Any]:
        if obj.key.endswith(PARQUET_SUFFIXES):
            return self._parquet(store, obj)
        if obj.key.endswith(ARROW_SUFFIXES):
            return self._arrow(store, obj)
        if self.image_field:
            return self._image_file(store, obj)
        if obj.key.endswith(SUFFIXES):
            return self._lines(store, obj)
        if obj.key.lower().endswith(JSON_SUFFIXES):
            return self._json_file(store, obj)
        if obj.key.lower().endswith(CSV_SUFFIXES):
            return self._csv(store, obj)
        return self._text_file(store, obj)

    async def _json_file(self, store: Store, obj: ObjectInfo) -> AsyncIterator[bytes]:
        """A `.json` file: JSON lines (as `_lines` reads them), or one array of records."""
        head = await store.read(obj.key, 0, min(obj.size, 64 << 10)) if obj.size else b""
        if not head.lstrip(b" \t\r\n\xef\xbb\xbf").startswith(b"["):
            async for line in self._lines(store, obj):
                yield line
            return
        async for line in self._json_array(store, obj):
            yield line

    async def _json_array(self, store: Store, obj: ObjectInfo) -> AsyncIterator[bytes]:
        """The records of a file that holds one JSON array, each as a compact line."""
        if obj.size > _ARRAY_MAX:
            self.bad(DataError(f"{obj.key!r} is a JSON array of {obj.size} bytes, more than the {_ARRAY_MAX} read "
                               "whole: write it as JSON lines", key=obj.key, offset=0))
            return
        data = (await store.read(obj.key)).removeprefix(b"\xef\xbb\xbf")
        if data.count(b"[") + data.count(b"{") > MAX_DEPTH and await threads.run_sync(nesting, data) > MAX_DEPTH + 1:
            self.bad(DataError(f"{obj.key!r} holds a record that nests JSON arrays or objects more than {MAX_DEPTH} "
                               "deep, the most a record may: the file is not read (as JSON lines, only that record "
                               "would be a bad record)", key=obj.key, offset=0))
            return
        try:
            items = await threads.run_sync(functools.partial(msgspec.json.decode, type=list[msgspec.Raw]), data)
        except msgspec.DecodeError as exc:
            self.bad(DataError(f"{obj.key!r} starts as a JSON array but is not one: {exc}", key=obj.key, offset=0))
            return
        for i, raw in enumerate(items):
            if len(raw) > self.max_record:
                hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such records)'
                self.bad(DataError(f"record {i} of the JSON array in {obj.key!r} takes {len(raw)} bytes, more than "
                                   f"max_record_bytes = {self.max_record}{hint}", key=obj.key, offset=i))
                continue
            record = msgspec.json.decode(raw)  # valid: the whole array decoded
            value = field(record, self.text_field)
            if self.chat is not None and value is not None:  # a conversation: checked as a chat source reads it
                if self.conversation(self.chat.conversation(record, value), obj.key, f"record {i} of its JSON array",
                                     i):
                    self.documents += 1
                    yield msgspec.json.format(bytes(raw), indent=-1) + b"\n"
                continue
            if not isinstance(value, str):
                what = ("is not an object" if not isinstance(record, dict) else f"has no field {self.text_field!r}"
                        if value is None else f"has {type(value).__name__} in field {self.text_field!r}, not a string")
                hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such records)'
                if isinstance(record, dict) and value is None:  # likely the setting: name the fields there are
                    shown = ", ".join(repr(f) for f in list(record)[:8]) + (", ..." if len(record) > 8 else "")
                    hint = f"; its fields are {shown or 'none'}: set text_field to one of them"
                self.bad(DataError(f"bad record in {obj.key!r}: record {i} of its JSON array {what}{hint}",
                                   key=obj.key, offset=i))
                continue
            self.documents += 1
            yield msgspec.json.format(bytes(raw), indent=-1) + b"\n"

    async def _lines(self, store: Store, obj: ObjectInfo) -> AsyncIterator[bytes]:
        """The lines of a JSONL(.zst/.gz) file, as they are, each checked as the loader reads it."""
        try:
            plan = await plan_shard(store, obj)
        except DataError as err:  # an empty or corrupt file
            self.bad(err)
            return
        split = Split(0, 0, len(plan.frames) - 1 if plan.frames else plan.size)
        reader = SplitReader(store, plan, split, self.max_record, bad=self.bad)
        parser = Parser(self.text_field, self.on_bad, self.chat)
        parser.bad = self.bad
        async for pos, block in reader.blocks():
            for off, n, _ in parser.parse(reader, pos, block):
                line = block[off - pos:off - pos + n]
                self.documents += 1
                yield line if line.endswith(b"\n") else line + b"\n"

    def conversation(self, payload: Any, key: str, where: str, offset: int) -> bool:
        """Whether a chat record's conversation (and tools, documents) is one a chat source takes; if
        not, it is a bad record, raised or counted."""
        from zephon_stream.chat import check_documents, check_messages, check_tools

        messages, tools, documents = payload if isinstance(payload, Conversation) else (payload, None, None)
        try:
            check_messages(messages)
            check_tools(tools)
            check_documents(documents)
        except DataError as exc:
            hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such records)'
            self.bad(DataError(f"bad conversation in {key!r} at {where}: {exc}{hint}", key=key, offset=offset))
            return False
        return True

    async def _parquet(self, store: Store, obj: ObjectInfo) -> AsyncIterator[Any]:
        """The rows of a Parquet file: `{"text": ...}` lines, or image samples."""
        from zephon_stream.operators.parquet import ParquetParser, ParquetSplitReader

        parser, columns = self._table_parser(ParquetParser)
        try:
            plan = await plan_parquet(store, obj, columns)
        except DataError as err:
            self.bad(err)
            return
        reader = ParquetSplitReader(store, plan, Split(0, 0, len(plan.rows) - 1), self.max_record,
                                    columns=columns, bad=self.bad)
        async for pos, block in reader.blocks():
            for _, _, record in parser.parse(reader, pos, block):
                if (row := self._row(obj.key, record)) is not None:
                    yield row

    def _table_parser(self, kind: type) -> tuple[Any, list[tuple[str, str]]]:
        """A parser of table rows (Parquet's, for Arrow too) and the columns it needs: [(name, kind)]."""
        parser = kind(self.text_field, self.image_field, self.on_bad, self.max_record, self.chat)
        parser.bad = self.bad
        if self.chat is not None:
            return parser, [(self.chat.field, "messages")] + [
                (name, what) for name, what in ((self.chat.tools, "tools"), (self.chat.documents, "documents")) if name]
        return parser, parser.columns

    def _row(self, key: str, record: Any) -> Any:
        """A parsed table row as output: a JSON line, or an image sample (None: a bad one, skipped)."""
        if self.image_field:
            return self._sample(key, record.member, record.image, record.text)
        self.documents += 1
        if self.chat is not None:
            return self._chat_line(record)
        return _enc.encode({"text": record}) + b"\n"

    async def _arrow(self, store: Store, obj: ObjectInfo) -> AsyncIterator[Any]:
        """The rows of an Arrow IPC file (a stream, as Hugging Face datasets' save_to_disk writes,
        or the file format), read whole, as Parquet rows are."""
        import pyarrow as pa

        if obj.size > _ARRAY_MAX:
            self.bad(DataError(f"{obj.key!r} is an Arrow file of {obj.size} bytes, more than the {_ARRAY_MAX} read "
                               "whole: write it as Parquet", key=obj.key, offset=0))
            return
        data = await store.read(obj.key)
        try:
            try:
                stream = pa.ipc.open_stream(data)
                schema, batches = stream.schema, iter(stream)
            except (pa.ArrowException, OSError):
                file = pa.ipc.open_file(data)
                schema, batches = file.schema, (file.get_batch(i) for i in range(file.num_record_batches))
        except (pa.ArrowException, OSError) as exc:
            self.bad(DataError(f"{obj.key!r} is not an Arrow IPC stream or file: {str(exc).strip()}", key=obj.key,
                               offset=0))
            return
        async for row in self._table_rows(obj, schema, batches, "Arrow"):
            yield row

    async def _table_rows(self, obj: ObjectInfo, schema: Any, batches: Any, kind: str) -> AsyncIterator[Any]:
        """The rows of a file read as Arrow record batches (Arrow IPC, CSV), through Parquet's row
        parser; a batch that fails to read or validate ends the file (the rows before it stand)."""
        import pyarrow as pa

        from zephon_stream.formats.parquet import resolve_column
        from zephon_stream.operators.parquet import ParquetParser

        parser, columns = self._table_parser(ParquetParser)
        try:
            for name, what in columns:
                resolve_column(_ArrowFile(obj.key, schema, kind), name, what)
        except UnicodeDecodeError as exc:  # pyarrow decodes names only when asked
            self.bad(DataError(f"{obj.key!r} is damaged: a column name is not UTF-8 ({exc.reason})", key=obj.key,
                               offset=0))
            return
        except DataError as err:
            self.bad(err)
            return
        rows, pos = _ArrowRows(obj.key, self.bad, kind), 0
        while True:
            try:
                batch = next(batches, None)
                if batch is not None:  # offsets and lengths checked before any value is read: unchecked, a
                    batch.validate(full=True)  # damaged one reads out of bounds (a crash, not an error)
            except (pa.ArrowException, OSError) as exc:  # cut short, or a damaged batch: its rows before it stand
                self.bad(DataError(f"{obj.key!r} is damaged after row {pos}: {_one_line(exc)}", key=obj.key,
                                   offset=pos))
                return
            if batch is None:
                return
            for _, _, record in parser.parse(rows, pos, pa.Table.from_batches([batch])):
                if (row := self._row(obj.key, record)) is not None:
                    yield row
            pos += batch.num_rows

    async def _csv(self, store: Store, obj: ObjectInfo) -> AsyncIterator[Any]:
        """The rows of a CSV (or TSV) file: the text column a string, as written. The file is read
        in parts, inflated if gzipped and checked for UTF-8 into a temporary file (in TMPDIR), which
        pyarrow then reads a block at a time: memory stays bounded whatever the file's size. The
        temporary file has no name (it is unlinked as it is made, where the system allows it): a
        `zephon shard` that is killed leaves nothing behind in TMPDIR."""
        import pyarrow as pa
        import pyarrow.csv as csv

        try:
            spool = tempfile.TemporaryFile(buffering=0, prefix="zephon-shard-csv-")
        except OSError as exc:
            raise self._spool_error(obj, exc) from exc
        with spool:
            self.meter.share = 0.5  # the copy reads the file: half its bytes on the meter
            try:
                if not await self._spool_csv(store, obj, spool):
                    return
                self.meter.share = 0.5 * obj.size / max(1, spool.seek(0, io.SEEK_END))  # and the rows, the copy's
                async for row in self._csv_rows(obj, spool, pa, csv):
                    yield row
            finally:
                self.meter.share = 1.0

    @staticmethod
    def _spool_error(obj: ObjectInfo, exc: OSError) -> ZephonError:
        return ZephonError(f"zephon shard copies CSV file {obj.key!r} into a temporary file in {tempfile.gettempdir()} "
                           f"to parse it, and that failed: {exc.strerror or exc}; set TMPDIR to a disk with room for "
                           "the file (inflated)")

    async def _spool_csv(self, store: Store, obj: ObjectInfo, spool: Any) -> bool:
        """Copy CSV file `obj` into the open file `spool`, inflated and checked; False (after `bad`) if
        it is not gzip or not UTF-8: such a file is refused whole, before any of its rows is read."""
        most = max(_ARRAY_MAX, _INFLATE_RATIO * obj.size)  # a bomb; gunzip a real file of such a ratio first
        gunzip = _Gunzip(most) if obj.key.lower().endswith(".gz") else None
        check = _Utf8Check()

        def write(part: bytes, last: bool, out: Any) -> tuple[int, int] | None:
            for piece in gunzip.feed(part) if gunzip is not None else (part,):
                if (bad := check.feed(piece)) is not None:
                    return bad
                out.write(piece)
            if last and gunzip is not None:
                gunzip.close()
            return check.feed(b"", final=True) if last else None

        for start in range(0, max(obj.size, 1), _CSV_PART):
            part = await store.read(obj.key, start, min(obj.size, start + _CSV_PART)) if obj.size else b""
            try:
                bad = await threads.run_sync(write, part, start + _CSV_PART >= obj.size, spool)
                if bad is None and start + _CSV_PART >= obj.size:
                    await threads.run_sync(spool.flush)
            except OSError as exc:  # the temporary file's disk, full or gone
                raise self._spool_error(obj, exc) from exc
            except (zlib.error, EOFError, ValueError) as exc:
                self.bad(DataError(f"{obj.key!r} does not decompress: {exc}", key=obj.key, offset=0))
                return False
            if bad is not None:  # before pyarrow: it cannot show a row that is not UTF-8 (its handler call fails)
                at, byte = bad
                self.bad(DataError(f"CSV file {obj.key!r} is not UTF-8: byte {at} is {byte:#04x}; the file is "
                                   "not read (convert it first, e.g. iconv -f latin1 -t utf-8)", key=obj.key,
                                   offset=at))
                return False
        return True

    async def _csv_rows(self, obj: ObjectInfo, spool: Any, pa: Any, csv: Any) -> AsyncIterator[Any]:
        """The rows of the checked CSV file `spool` (open), read a block at a time. A block holds
        `max_record_bytes` and 1 MiB more, so a row over the bound is a bad record, not the end of
        the file (1 MiB blocks ended it at a row over 1-2 MiB); pyarrow reads three blocks ahead of
        the batches taken (`_PacedFile`)."""
        block = min(self.max_record + (1 << 20), _CSV_BLOCK_MAX)
        rejected: list[DataError] = []  # rows with too few or too many values, in the order pyarrow met them

        def bad_row(row: Any) -> str:
            hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such rows)'
            rejected.append(DataError(f"bad record in {obj.key!r}: row {row.number} (the header is row 1) has "
                                      f"{row.actual_columns} values, the header {row.expected_columns}{hint}",
                                      key=obj.key, offset=row.number or 0))
            return "skip"  # counted, or raised, below: never from inside pyarrow

        def checked(reader: Any) -> Any:
            batches, counted = iter(reader), 0
            while True:
                try:
                    batch = paced[-1].wait(next, batches, None)
                    self.meter.read(obj.key, paced[-1].bytes_read - counted)  # the copy's bytes parsed so far
                    counted = paced[-1].bytes_read
                except pa.ArrowInvalid as exc:
                    if "straddl" not in str(exc):
                        raise
                    raise pa.ArrowInvalid(f"a row holds more than {block} bytes (max_record_bytes and 1 MiB, at most "
                                          "1 GiB)") from exc
                while rejected:
                    self.bad(rejected.pop(0))  # raises unless skipping
                if batch is None:
                    return
                yield batch

        delimiter = self.delimiter or ("\t" if obj.key.lower().removesuffix(".gz").endswith(".tsv") else ",")

        def reader(only_text: bool) -> Any:
            """A pyarrow reader of the spool, paced; `only_text` converts the text column alone
            (another column's type, guessed from the first block, could not hold a later value:
            that ended the file)."""
            paced.append(_PacedFile(spool, block))
            return paced[-1].wait(
                csv.open_csv, paced[-1], read_options=csv.ReadOptions(use_threads=False, block_size=block),
                parse_options=csv.ParseOptions(delimiter=delimiter, newlines_in_values=True,
                                               invalid_row_handler=bad_row),
                convert_options=csv.ConvertOptions(column_types={self.text_field: pa.string()},
                                                   include_columns=[self.text_field] if only_text else None))

        paced: list[_PacedFile] = []  # the header's reader's file, then the rows' reader's (the last)
        try:
            try:
                head = reader(False)  # the header's names
                names = head.schema.names
                if self.text_field in names:
                    paced[-1].close()  # first: its reader may wait for a read
                    head.close()
                    rejected.clear()  # the first block's bad rows come again
                    head = reader(True)
            except (pa.ArrowException, OSError) as exc:
                why = _one_line(exc)
                if "Empty CSV file or block" in why and _header_past(spool, block):
                    why = (f"its header line is longer than {block} bytes (a block: max_record_bytes and 1 MiB, at "
                           "most 1 GiB); raise max_record_bytes if the header is right")
                self.bad(DataError(f"{obj.key!r} does not read as CSV with a header line: {why}", key=obj.key,
                                   offset=0))
                return
            if len(names) == 1 and self.text_field not in names and (other := _other_delimiter(names[0], delimiter)):
                self.bad(DataError(f"CSV file {obj.key!r} has one column, {names[0]!r}, and no {self.text_field!r}: "
                                   f"its header seems separated by {other!r}; pass delimiter={other!r}", key=obj.key,
                                   offset=0))
                return
            async for row in self._table_rows(obj, head.schema, checked(head), "CSV"):
                yield row
        finally:
            for file in paced:
                file.close()

    def _chat_line(self, payload: Any) -> bytes:
        """A Parquet row's conversation (and tools, documents) as a JSON line, under the fields' own names."""
        assert self.chat is not None
        if isinstance(payload, Conversation):
            row = {self.chat.field: payload.messages}
            row.update((name, value) for name, value in ((self.chat.tools, payload.tools),
                                                         (self.chat.documents, payload.documents)) if name is not None)
            return _enc.encode(row) + b"\n"
        return _enc.encode({self.chat.field: payload}) + b"\n"

    async def _text_file(self, store: Store, obj: ObjectInfo) -> AsyncIterator[bytes]:
        """One text file as one document."""
        data = await self._whole(store, obj)
        if data is None:
            return
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            self.bad(DataError(f"text file {obj.key!r} is not UTF-8: byte {exc.start} is {data[exc.start]:#04x}",
                               key=obj.key, offset=exc.start))
            return
        self.documents += 1
        yield _enc.encode({"id": obj.key, "text": text}) + b"\n"

    async def _image_file(self, store: Store, obj: ObjectInfo) -> AsyncIterator[tuple[str, dict]]:
        """An image file and the caption beside it (same name, extension `text_field`) as one sample."""
        caption_key = obj.key.rsplit(".", 1)[0] + "." + self.text_field.lstrip(".")
        if caption_key not in self.listed and not (self.single and await is_object(store, caption_key)):
            self.bad(DataError(f"image {obj.key!r} has no caption {caption_key!r} beside it", key=obj.key, offset=0))
            return
        image, caption = await self._whole(store, obj), await store.read(caption_key)
        try:
            text = caption.decode().strip()
        except UnicodeDecodeError:
            text = ""
        if image is None or not text:
            if image is not None:
                self.bad(DataError(f"caption {caption_key!r} is empty or not UTF-8", key=caption_key, offset=0))
            return
        if (sample := self._sample(obj.key, obj.key, image, text)) is not None:
            yield sample

    async def _whole(self, store: Store, obj: ObjectInfo) -> bytes | None:
        if obj.size > self.max_record:
            hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such files)'
            self.bad(DataError(f"{obj.key!r} takes {obj.size} bytes, more than max_record_bytes = {self.max_record}"
                               f"{hint}", key=obj.key, offset=0))
            return None
        return await store.read(obj.key)

    def _sample(self, key: str, member: str, image: bytes, text: str) -> tuple[str, dict[str, bytes], bytes] | None:
        """A tar sample: the image's bytes as they are (extension from its magic, else its name); and
        its line of the name map (`_TarOut`): the input's key below the input folder, and for a table
        the row's image name (HF's `Image.path`) or place. None for an image of no known format (a
        bad record)."""
        ext = next((e for magic, e in _IMAGE_MAGIC if image.startswith(magic)), None)
        if ext is None and image[:4] == b"RIFF" and image[8:12] == b"WEBP":
            ext = "webp"
        if ext is None and "." in member:
            ext = member.rsplit(".", 1)[-1].lower()
        if not ext or not ext.isalnum():  # a bad record, skipped with on_bad = "skip" (it stopped the run)
            self.bad(DataError(f"image {member!r} of {key!r}: its format is not known from its bytes or name",
                               key=key, offset=0))
            return None
        self.documents += 1
        sample = f"{self.documents - 1:09d}"
        origin = {"key": sample, "from": key[len(self.base):] if key.startswith(self.base) else key}
        if member != key:
            origin["item"] = member
        return sample, {ext: image, "txt": text.encode()}, _enc.encode(origin) + b"\n"


class _ZstOut:
    """Writes lines as multi-frame JSONL.zst shards of about `target` compressed bytes."""

    def __init__(self, job: _Job, store: Store, prefix: str) -> None:
        self.job, self.store, self.prefix = job, store, prefix
        self.keys: list[str] = []
        self.bytes_out = 0
        self._cctx = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True)
        self._lines: list[bytes] = []
        self._pending = 0  # bytes in _lines
        self._frames: list[bytes] = []
        self._sizes: list[tuple[int, int]] = []
        self._size = 0  # compressed bytes of the open shard

    async def add(self, line: bytes) -> None:
        if self._lines and self._pending + len(line) > self.job.frame:
            await self._frame()
            if self._size >= self.job.target:
                await self._shard()
        self._lines.append(line)
        self._pending += len(line)

    async def _frame(self) -> None:
        raw = b"".join(self._lines)
        out = await threads.run_sync(self._cctx.compress, raw)
        self._frames.append(out)
        self._sizes.append((len(out), len(raw)))
        self._size += len(out)
        self._lines, self._pending = [], 0

    async def _shard(self) -> None:
        key = f"{self.prefix}{self.job.name}-{len(self.keys):05d}.jsonl.zst"
        data = b"".join([*self._frames, seek_table(self._sizes)])
        await self.store.put(key, data)
        self.keys.append(key)
        self.bytes_out += len(data)
        self._frames, self._sizes, self._size = [], [], 0

    async def close(self) -> None:
        if self._lines:
            await self._frame()
        if self._frames:
            await self._shard()


class _TarOut:
    """Writes samples as tar shards (formats.tar.write_tar_shards) of about `target` bytes."""

    def __init__(self, job: _Job, store: Store, prefix: str) -> None:
        self.job, self.store, self.prefix = job, store, prefix
        self.keys: list[str] = []
        self.bytes_out = 0
        self._samples: list[tuple[str, dict[str, bytes]]] = []
        self._names: list[bytes] = []  # the samples' lines of the shard's name map
        self._size = 0

    async def add(self, sample: tuple[str, dict[str, bytes], bytes]) -> None:
        size = sum(len(v) + 1024 for v in sample[1].values())  # data, header and padding, about
        if self._samples and self._size + size > self.job.target:
            await self._shard()
        self._samples.append(sample[:2])
        self._names.append(sample[2])
        self._size += size

    async def _shard(self) -> None:
        import tempfile

        from zephon_stream.formats.tar import write_tar_shards

        with tempfile.TemporaryDirectory() as tmp:
            paths = await threads.run_sync(
                lambda: write_tar_shards(self._samples, tmp, shard_bytes=1 << 62, prefix="part"))
            data = paths[0].read_bytes()
        key = f"{self.prefix}{self.job.name}-{len(self.keys):05d}.tar"
        await self.store.put(key, data)
        # each sample's input: samples are renamed 000000000, ... (inputs' names may repeat across folders,
        # and a sample's key ends at its first dot); "_" first, so that no source reads it as data
        names = f"{self.prefix}_{self.job.name}-{len(self.keys):05d}{NAME_MAP_SUFFIX}"
        await self.store.put(names, b"".join(self._names))
        self.keys.append(key)
        self.bytes_out += len(data)
        self._samples, self._names, self._size = [], [], 0

    async def close(self) -> None:
        if self._samples:
            await self._shard()


class _Metered:
    """The input store, telling `meter` the bytes of each read (the `Store` calls, delegated)."""

    def __init__(self, store: Store, meter: _Progress) -> None:
        self._store, self._meter = store, meter

    def __getattr__(self, name: str) -> Any:  # list, head, overlap_reads, ...
        return getattr(self._store, name)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data = await self._store.read(key, start, end)
        self._meter.read(key, len(data))
        return data


class _Progress:
    """Input bytes done: a tqdm bar on a terminal, else a plain line every 5 s, on stderr. The bytes
    of the object in hand count as they are read (`read`, from `_Metered`), so one large file moves
    it too; `counts()` gives the documents and shards so far."""

    def __init__(self, total: int, bar: bool | None, file: Any = None, clock: Callable[[], float] = time.monotonic,
                 counts: Callable[[], tuple[int, int]] = lambda: (0, 0)):
        self.file, self.total, self.clock, self.counts = file or sys.stderr, total, clock, counts
        self.done, self.start = 0, clock()
        self.last = self.start
        self.key, self.size, self.current = None, 0, 0  # the object in hand, its size, its bytes counted
        self.share = 1.0  # of each byte read of it (see `read`)
        use_bar = self.file.isatty() if bar is None else bar
        self.bar = None
        if use_bar:
            try:
                from tqdm import tqdm
            except ImportError:  # an optional dependency: plain lines without it
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="shard",
                                file=self.file)

    def start_object(self, obj: ObjectInfo) -> None:
        self.key, self.size, self.current = obj.key, obj.size, 0

    def read(self, key: str, nbytes: int) -> None:
        """`nbytes` read of `key`: they count if it is the object in hand, times `share`, up to its
        size (a file's footer may be read twice, a caption beside an image is not the image). A CSV
        file is read twice, once from the store and once from its copy: half its size each time."""
        if key == self.key:
            self._add(min(round(nbytes * self.share), self.size - self.current))
            self.tick()

    def done_object(self) -> None:
        """The object in hand is done: what was not read of it (a Parquet file's other columns) counts too."""
        self._add(self.size - self.current)
        self.key = None

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.done += nbytes
        if self.bar is not None and nbytes:
            self.bar.update(nbytes)

    def tick(self) -> None:
        now = self.clock()
        if now - self.last < (0.5 if self.bar is not None else 5.0):
            return
        self.last = now
        if self.bar is not None:
            documents, shards = self.counts()
            self.bar.set_postfix(documents=documents, shards=shards, refresh=True)
        else:
            self._line()

    def close(self, done: bool = True) -> None:
        """The last line (the bar closed, or a plain line if the run is `done`)."""
        if self.bar is not None:
            documents, shards = self.counts()
            self.bar.set_postfix(documents=documents, shards=shards)
            self.bar.close()
        elif done:
            self._line()

    def _line(self) -> None:
        documents, shards = self.counts()
        pct = 100 * self.done / self.total if self.total else 100.0
        buf = io.StringIO()
        print(f"shard: {self.done}/{self.total} input bytes ({pct:.0f}%), {documents} document"
              f"{'s' * (documents != 1)}, {shards} shard{'s' * (shards != 1)}, {self.clock() - self.start:.0f} s",
              file=buf)
        self.file.write(buf.getvalue())
        self.file.flush()
