"""Read: list a source's shards, cut them into splits, and stream a split's records.

A source is one family of formats, by key suffix: JSON lines (`.jsonl`, `.jsonl.zst`,
`.jsonl.gz`, `.json.gz`; this module's `SplitReader`), Parquet (`.parquet`, row groups as
splits: `operators.parquet`) or, for an image source, WebDataset tar (`.tar`) or Parquet.

A *split* owns the records that **start** inside its range. For `.jsonl` the range is bytes
`[start, end)` of the shard; for `.jsonl.zst` it is zstd frames `[start, end)` (gzip members for
`.gz`, found as `formats.gzip` says), found from the
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

import bisect
import collections
import contextlib
import functools
import itertools
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import anyio
import msgspec
import numpy as np

from zephon_stream.connectors import missing_locally
from zephon_stream.connectors.base import ObjectInfo, Store
from zephon_stream.engine import threads
from zephon_stream.engine.ordered import run_ordered
from zephon_stream.engine.window import Spawn, read_ranges
from zephon_stream.errors import ConfigError, DataError, IncompatibleState, ObjectNotFound
from zephon_stream.formats.gzip import GZIP_SUFFIXES, GzipStream, find_members
from zephon_stream.formats.jsonl_zst import DECODE_PIECE, ZstdStream, read_seek_entries, walk_frames
from zephon_stream.formats.parquet import PARQUET_SUFFIXES, chunk_bytes, read_footer, resolve_column
from zephon_stream.operators.types import field

if TYPE_CHECKING:
    from zephon_stream.operators.transforms import Records

__all__ = ["BadRecords", "FORMATS", "MAX_DEPTH", "Parser", "RecordCounts", "SUFFIXES", "ShardPlan", "SourcePlan",
           "Split", "SplitReader", "is_hidden", "nesting", "plan_parquet", "plan_shard", "plan_source", "plan_splits",
           "too_deep", "visible", "warn_coarse"]

SUFFIXES = (".jsonl", ".jsonl.zst", *GZIP_SUFFIXES)  # JSON lines, read by SplitReader
PLAN_WORKERS = 16  # shards planned at once (a scan reads one part of at most 8 MiB at a time)
FORMATS = {"lines": SUFFIXES, "parquet": PARQUET_SUFFIXES, "tar": (".tar",)}  # a source's shards are one of these
log = logging.getLogger("zephon_stream.loader")
_SPLITS_PER_LANE, _MIN_SPLIT = 4, 256 << 10  # see plan_splits
_READ_PART = 1 << 20  # the largest ranged read of a split
_NAMED_SKIPS = 5  # shards skipped at planning named one by one in warnings, a source
_MIN_PART = 1 << 10  # the smallest, when a small split is cut into `read_ahead` parts
_TAIL_PART = 1 << 16  # reads past a split's end, only to finish its last record
_LOCATE_MAX = 8 << 20  # the most decoded bytes of frames `SplitReader.lines_at` decodes for one record
_HEADER_MAX = 18  # the longest zstd frame header (magic, descriptor, window, dictionary id, content size)
_HEADER_GAP = 64 << 10  # frame headers this close are read together (see SplitReader._header_groups)
_ZSTD_MAGIC, _SKIPPABLE = 0xFD2FB528, range(0x184D2A50, 0x184D2A60)


class ShardPlan(msgspec.Struct, frozen=True, array_like=True):
    key: str  # the full key in the store
    size: int
    etag: str
    frames: list[int] = []  # zstd (gzip): compressed offset of every frame (member), then the end of the frames;
    # tar: of every sample; parquet: the running total of the needed columns' bytes per row group (to cut splits)
    bad_tail: str = ""  # tar: why the archive ends before its size (truncated, corrupt), read as one bad record
    rows: list[int] = []  # parquet: the first row of every row group, then the number of rows
    content: list[int] = []  # zstd with a seek table: running total of the frames' decompressed sizes (planning)
    oversized: dict[int, str] = {}  # tar: samples with a member over max_record_bytes (start: why), one bad record each


class Split(msgspec.Struct, frozen=True, array_like=True):
    shard: int
    start: int  # byte (jsonl), frame index (zst, gzip member), sample index (tar) or row group (parquet)
    end: int


class SourcePlan(msgspec.Struct, frozen=True):
    name: str
    uri: str
    prefix: str
    text_field: str
    shards: list[ShardPlan]
    splits: list[Split]
    skipped_shards: list[str] = []
    format: str = "lines"  # a key of FORMATS: which reader and parser the source gets (operators.sources)
    # a coarse shard's share of splits went to the others: split plan 2 cut this source otherwise, so its
    # data digest is marked (loader.plan), and a checkpoint written by an older version is refused
    refilled: bool = False


# ---- planning ------------------------------------------------------------------------------------

async def plan_source(store: Store, prefix: str, name: str, uri: str, text_field: str,
                      lanes: int, split_bytes: int, on_bad: str, *, images: bool = False,
                      max_record: int = 16 << 20, image_field: str | None = None,
                      text_kind: str = "text", tools_field: str | None = None,
                      documents_field: str | None = None, limiter: anyio.CapacityLimiter | None = None) -> SourcePlan:
    """List a source's shards (sorted by key) and cut them into splits.

    With `images`, the shards are WebDataset tar files (`*.tar`), indexed by sample, or Parquet
    files whose `image_field` column holds the images. For a chat source `text_field` is its
    `messages_field` and `text_kind` is "messages" (a Parquet column of lists), and a Parquet
    file must also have its `tools_field` and `documents_field` columns, if it has them.
    `limiter` bounds the shards planned at once across the sources that share it (each
    source's own bound is PLAN_WORKERS).
    """
    listed = await store.list(prefix)
    if not listed and prefix.endswith("/") and await is_object(store, prefix[:-1]):
        parent = uri.rstrip("/").rsplit("/", 1)[0] + "/"
        raise ConfigError(f"source {name!r}: {uri} names one object, not a folder (a prefix) of shards: give the "
                          f"prefix it is under, {parent}, to read every shard there")
    fmt, objects = _list_shards(visible(listed, prefix, f"source {name!r}", uri), name, uri, images)
    for obj in objects:
        _check_key(name, obj.key)
    columns = ([(text_field, text_kind)] + ([(image_field or "", "image")] if images else [])
               + [(name, what) for name, what in ((tools_field, "tools"), (documents_field, "documents"))
                  if name is not None])
    shards, skipped = [], []

    async def plan(obj: ObjectInfo) -> ShardPlan | DataError:
        async with limiter or contextlib.nullcontext():
            try:
                return await (_plan_tar(store, obj, max_record, on_bad) if fmt == "tar" else
                              plan_parquet(store, obj, columns) if fmt == "parquet" else plan_shard(store, obj))
            except DataError as exc:
                return exc

    async def keep(obj: ObjectInfo, got: ShardPlan | DataError) -> None:
        if not isinstance(got, DataError):
            shards.append(got)
        elif on_bad != "skip":
            raise got  # the first bad shard in key order, however the plans overlapped
        else:
            skipped.append(obj.key)
            causes.append(_SKIP_ADVICE.sub("", str(got)))  # "or set on_bad_record = skip": it is set

    causes: list[str] = []
    # Each plan is a request or two (a seek table, a footer) or a scan: overlapped, so a source of
    # many shards plans in its latency over PLAN_WORKERS, not in the sum of its latencies
    await run_ordered(objects, plan, keep, workers=PLAN_WORKERS, window=2 * PLAN_WORKERS)
    if not shards:
        raise DataError(f"source {name!r}: every shard under {uri} is empty or corrupt: {skipped}; the first: "
                        f"{causes[0]}")
    for key, cause in list(zip(skipped, causes))[:_NAMED_SKIPS]:  # a whole shard is no longer read: say so
        log.warning("source %r: shard %r is skipped whole (on_bad_record = \"skip\"), none of its records is read: "
                    "%s", name, key, cause)
    if len(skipped) > _NAMED_SKIPS:
        log.warning("source %r: %d more shards are skipped whole (loader.statistics().skipped_shards counts them)",
                    name, len(skipped) - _NAMED_SKIPS)
    splits, refilled = _plan_splits(shards, lanes, split_bytes)
    if not splits:
        raise DataError(f"source {name!r}: the {fmt} shards under {uri} hold no " +
                        {"tar": "samples", "parquet": "rows"}.get(fmt, "data"))
    return SourcePlan(name=name, uri=uri, prefix=prefix, text_field=text_field,
                      shards=shards, splits=splits, skipped_shards=skipped, format=fmt, refilled=refilled)


def warn_coarse(sp: SourcePlan, lanes: int, max_epochs: int = 0) -> None:
    """Warn that a planned source cannot be cut fine enough for `lanes` lanes, with what that costs:
    it has fewer splits than lanes (with `max_epochs`, lanes without a split pad; without, epochs
    overlap), or one split holds more than two lanes' share of an epoch (a single large frame
    beside small ones: the lane that reads it ends each epoch long after the others)."""
    piece = ("zstd frames or gzip members" if sp.format == "lines" else "row groups" if sp.format == "parquet"
             else "samples")
    stored = sum(s.frames[-1] - s.frames[0] if s.frames else s.size for s in sp.shards)
    per_lane = max(1, stored // lanes >> 10)  # KiB: a frame that size or smaller gives every lane a split
    fix = ("with smaller frames: `zephon shard --frame-size` (256KiB by default), e.g. "
           f"{min(64, 1 << (per_lane.bit_length() - 1))}KiB" if sp.format == "lines"
           else "in smaller pieces with `zephon shard`")
    if 0 < len(sp.splits) < lanes:
        idle = lanes - len(sp.splits)
        cost = (f"{idle} of its lanes {'has' if idle == 1 else 'have'} no split in an epoch and give"
                f"{'s' if idle == 1 else ''} padding while the others read" if max_epochs
                else "lanes read the same splits at about the same time: one batch can hold the same samples "
                "several times")
        if stored < lanes << 10:
            fix += f" (its {stored:,} bytes are too few to give each of {lanes} lanes a split)"
        log.warning("source %r has %d split%s for %d lanes: its %s cannot be cut finer, so %s; rewrite it %s",
                    sp.name, len(sp.splits), "" if len(sp.splits) == 1 else "s", lanes, piece, cost, fix)
        return
    sizes = [_split_bytes(sp.shards[s.shard], s) for s in sp.splits]
    big = max(range(len(sizes)), key=lambda i: (sizes[i], -i), default=None)
    if big is None or stored <= 0 or sizes[big] * lanes <= 2 * stored:
        return
    cost = ("the other lanes end long before it and give padding while it reads" if max_epochs
            else "its epochs fall behind the other lanes', and nearby batches can repeat documents")
    log.warning("source %r: one split (of shard %r) holds %.0f%% of its bytes, %.1fx a lane's share of an epoch "
                "at %d lanes: its %s cannot be cut finer, so the lane that reads it takes that much longer: %s; "
                "rewrite it %s", sp.name, sp.shards[sp.splits[big].shard].key, 100 * sizes[big] / stored,
                sizes[big] * lanes / stored, lanes, piece, cost, fix)


def _split_bytes(shard: ShardPlan, split: Split) -> int:
    """The stored bytes a split reads."""
    return shard.frames[split.end] - shard.frames[split.start] if shard.frames else split.end - split.start


def is_hidden(key: str, prefix: str) -> bool:
    """Whether a path part of `key` under `prefix` starts with "." or "_": `.ipynb_checkpoints/`,
    `.cache/`, macOS's `._name` copies, Spark's `_temporary/` (output still being written) and
    `_SUCCESS`. They are not data: pyarrow's datasets and Spark leave them out too."""
    parts = key[len(prefix):].split("/")
    if prefix and not prefix.endswith("/"):
        parts = parts[1:]  # the first part continues the prefix's last name ("data/train" + "_0.jsonl")
    return any(p.startswith((".", "_")) for p in parts)


#: The suffix of `zephon shard`'s name maps beside image tar shards (`_NAME-00000.names.jsonl`): hidden
#: by their leading "_", and known not to be data, so that no source warns of them.
NAME_MAP_SUFFIX = ".names.jsonl"


def visible(objects: list[ObjectInfo], prefix: str, owner: str, uri: str,
            suffixes: tuple[str, ...] = ()) -> list[ObjectInfo]:
    """`objects` less the hidden ones (`is_hidden`), with a warning from `owner` naming those that
    look like data (a shard's suffix, or one of `suffixes`)."""
    hidden = [o for o in objects if is_hidden(o.key, prefix)]
    if hidden:
        looks = (*(s for k in FORMATS.values() for s in k), *suffixes)
        data = [o.key for o in hidden if o.key.lower().endswith(looks) and not o.key.endswith(NAME_MAP_SUFFIX)]
        if data:
            log.warning("%s: %d object%s under %s with a data suffix %s not read, being under a name that starts "
                        "with '.' or '_' (hidden, or a job's temporary output): %s", owner, len(data),
                        "" if len(data) == 1 else "s", uri, "is" if len(data) == 1 else "are",
                        ", ".join(repr(k) for k in data[:3]) + (", ..." if len(data) > 3 else ""))
        objects = [o for o in objects if not is_hidden(o.key, prefix)]
    return objects


_KIND_NAMES = {"lines": "JSON-lines", "parquet": "Parquet", "tar": "tar"}  # format families, as messages name them


async def is_object(store: Store, key: str) -> bool:
    """Whether `key` names an object (a source's uri that names a shard, read as a prefix, lists
    nothing; the caption beside an image that `zephon shard` was given alone)."""
    try:
        await store.head(key)
    except ObjectNotFound:
        return False
    return True


def _list_shards(objects: list[ObjectInfo], name: str, uri: str, images: bool) -> tuple[str, list[ObjectInfo]]:
    """The source's format family and its shards: one family per source, so one reader and parser."""
    kinds = ("tar", "parquet") if images else ("lines", "parquet")
    found = {k: [o for o in objects if o.key.endswith(FORMATS[k])] for k in kinds}
    present = [k for k in kinds if found[k]]
    if not present:
        what = " or ".join(f"*{s}" for k in kinds for s in FORMATS[k])
        there = _unread_suffixes(objects)
        held = f" (it holds {_listed(there)})" if there else " (it holds no object)"
        if not objects and missing_locally(uri):
            raise ConfigError(f"source {name!r}: {uri} does not exist")
        convert = ("; `zephon shard` converts .arrow (Hugging Face save_to_disk), .json (JSON lines or an array of "
                   "records), .csv, .tsv (gzipped too), .txt and .md files"
                   if not images and set(there) & _CONVERTIBLE else "")
        if images and any(o.key.endswith(FORMATS["lines"]) for o in objects):
            convert = "; image_field makes it an image+text source: remove image_field to read it as text"
        elif images and any(o.key.endswith((".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz")) for o in objects):
            convert = ("; image shards are read as plain tar (each sample by a ranged read; its images are compressed "
                       "already): decompress them, e.g. `gunzip *.tar.gz` or `zstd -d *.tar.zst`")
        raise ConfigError(f"source {name!r}: no {what} objects under {uri}{held}{convert}")
    if len(present) > 1:
        raise ConfigError(f"source {name!r}: {uri} holds both {_KIND_NAMES[present[0]]} shards "
                          f"({found[present[0]][0].key!r}) and {_KIND_NAMES[present[1]]} shards "
                          f"({found[present[1]][0].key!r}): a source reads one format; "
                          "put each under its own source (or convert them with `zephon shard`)")
    kind = present[0]
    _warn_unread([o for o in objects if o not in found[kind]], name, uri, kind)
    return kind, found[kind]


def _warn_unread(objects: list[ObjectInfo], name: str, uri: str, kind: str) -> None:
    """Say which objects under a source are not read (data of another format would otherwise be
    left out silently); hidden and `_`-prefixed names (`.crc`, `_SUCCESS`) are not counted."""
    unread = _unread_suffixes(objects)
    if unread:
        n = sum(unread.values())
        log.warning("source %r: %d object%s under %s %s not read, not being %s shards (%s)", name, n,
                    "" if n == 1 else "s", uri, "is" if n == 1 else "are",
                    _KIND_NAMES[kind], _listed(unread))


# what `zephon shard` reads and the loader does not, as `_suffix` names them
_CONVERTIBLE = {"*.arrow", "*.json", "*.csv", "*.tsv", "*.csv.gz", "*.tsv.gz", "*.txt", "*.md"}


def _unread_suffixes(objects: list[ObjectInfo]) -> collections.Counter[str]:
    """The objects by suffix, hidden and `_`-prefixed names left out."""
    names = [o.key.rsplit("/", 1)[-1] for o in objects]
    return collections.Counter(_suffix(n) for n in names if not n.startswith((".", "_")))


def _listed(counts: collections.Counter[str]) -> str:
    return ", ".join(f"{suffix}: {count}" for suffix, count in counts.most_common(5))


def _suffix(name: str) -> str:
    """`*.jsonl.xz`, `*.md`, or the name itself when it has no suffix."""
    parts = name.split(".")
    if len(parts) < 2:
        return name
    keep = 2 if len(parts) > 2 and parts[-1] in ("gz", "zst", "xz", "bz2", "lz4", "zip") else 1
    return "*." + ".".join(parts[-keep:])


def _check_key(source: str, key: str) -> None:
    """A shard name must be UTF-8: plans, checkpoints and S3 requests carry it as text."""
    try:
        key.encode()
    except UnicodeEncodeError as exc:
        raw = key.encode("utf-8", "surrogateescape")
        raise DataError(f"source {source!r}: shard name {raw!r} is not valid UTF-8 (byte {exc.start}): rename "
                        "the file", key=ascii(key)) from None


#: The advice that an error-mode planning error gives, left out where the shard is skipped already.
_SKIP_ADVICE = re.compile(r' \(?or set on_bad_record = "skip"(?: to leave it out\))?')


async def plan_shard(store: Store, obj: ObjectInfo) -> ShardPlan:
    """A JSON lines shard's plan: its zstd frames (from the seek table, or walked) or gzip members."""
    key = obj.key
    if obj.size == 0:
        raise DataError(f"empty shard {obj.key!r} (0 bytes): remove it or set on_bad_record = \"skip\"",
                        key=obj.key, offset=0)
    if obj.key.endswith(GZIP_SUFFIXES):  # members found by a scan of the whole file (formats.gzip)
        return ShardPlan(obj.key, obj.size, obj.etag, await find_members(store, key, obj.size))
    if not obj.key.endswith(".zst"):
        return ShardPlan(obj.key, obj.size, obj.etag)
    entries = await read_seek_entries(store, key, obj.size)
    if entries is None:  # no seek table: walk the frame headers once (reads the whole shard, in parts)
        return ShardPlan(obj.key, obj.size, obj.etag, await walk_frames(store, key, obj.size))
    return ShardPlan(obj.key, obj.size, obj.etag, entries[0], content=entries[1])


async def _plan_tar(store: Store, obj: ObjectInfo, max_record: int, on_bad: str) -> ShardPlan:
    from zephon_stream.formats.tar import tar_index

    index = await tar_index(store, obj.key, obj.size, max_record)
    if index.bad_tail and (on_bad != "skip" or len(index.starts) < 2):
        raise DataError(f"tar shard {obj.key!r}: {index.bad_tail}" + (
            "" if on_bad == "skip" else ' (set on_bad_record = "skip" to keep the samples before it)'),
            key=obj.key, offset=index.bad_offset)
    return ShardPlan(obj.key, obj.size, obj.etag, list(index.starts), index.bad_tail or "",
                     oversized=dict(index.oversized))


async def plan_parquet(store: Store, obj: ObjectInfo, columns: list[tuple[str, str]]) -> ShardPlan:
    """A Parquet file's row groups, sized by the bytes of the columns a lane will read; its footer
    read and its columns checked (a missing column or one of the wrong type is a DataError)."""
    footer = await read_footer(store, obj.key, obj.size, obj.etag)
    needed = [resolve_column(footer, name, kind) for name, kind in columns]
    return ShardPlan(obj.key, obj.size, obj.etag, list(itertools.accumulate(chunk_bytes(footer, needed), initial=0)),
                     rows=list(itertools.accumulate(footer.row_counts(), initial=0)))


def plan_splits(shards: list[ShardPlan], lanes: int, split_bytes: int) -> list[Split]:
    """Cut a source's shards into splits of about equal bytes, as many as a multiple of `lanes`.

    The count comes from the stored bytes (what the reads fetch); the shares balance decompressed
    bytes where a zstd seek table declares them (the text, which tokens follow), else stored bytes.

    An epoch's splits go round the lanes (lane `l` takes positions `l, l + L, ...` of a
    permutation), so equal splits, `k * lanes` of them, give every lane an equal share of the
    epoch, and lanes end an epoch within about one split of each other. `k` is the smallest that
    keeps splits under `split_bytes`, but at least 4 where splits stay over 256 KiB. Each shard
    gets a whole number of the splits (largest remainder, at least one), cut at byte offsets
    (JSONL) or at the frame, member, sample or row-group boundary nearest an equal cut. A shard
    with fewer of those than its share (one gzip member, a few large frames) gives what it has,
    and the rest of its share goes to the source's other shards, so that a source with one coarse
    shard still gives every lane a split of its own (split plan 2 left that share to no shard:
    `SourcePlan.refilled` says where the two differ).
    """
    return _plan_splits(shards, lanes, split_bytes)[0]


def _plan_splits(shards: list[ShardPlan], lanes: int, split_bytes: int) -> tuple[list[Split], bool]:
    """`plan_splits`, and whether its splits differ from those of split plan 2 (its first round)."""
    content = all(len(s.content) == len(s.frames) and s.content[-1] > s.content[0] for s in shards if s.frames)
    sizes = [_extent(s, content) for s in shards]
    if sum(sizes) == 0:
        return [], False
    stored = sum(s.frames[-1] - s.frames[0] if s.frames else s.size for s in shards)  # what the reads fetch
    # every shard needs a split of its own: with more shards than that, the next multiple of lanes
    # and up to _SPLITS_PER_LANE splits a lane where they stay >= _MIN_SPLIT: an epoch's end is then
    # averaged over several splits a lane, and its padding shrinks (bench data: 15% -> 10% of the positions)
    more = min(_SPLITS_PER_LANE, stored // (lanes * _MIN_SPLIT))
    want = lanes * max(1, more, math.ceil(stored / (lanes * split_bytes)), math.ceil(len(shards) / lanes))
    given: dict[int, list[Split]] = {}  # the shards that gave fewer splits than their share: what they gave
    first: list[Split] | None = None
    while True:
        counts = _shares(sizes, want, {i: len(cut) for i, cut in given.items()})
        cuts = [given[i] if i in given else _cut(i, shard, n, content)
                for i, (shard, n) in enumerate(zip(shards, counts))]
        splits = [sp for cut in cuts for sp in cut]
        first = splits if first is None else first
        short = {i: cut for i, cut in enumerate(cuts) if i not in given and len(cut) < counts[i]}
        if not short or len(given) + len(short) == len(shards):  # no shard left to take the rest
            return splits, splits != first
        given.update(short)


def _shares(sizes: list[int], want: int, fixed: dict[int, int]) -> list[int]:
    """`want` splits shared out in proportion to `sizes` (largest remainder, at least one a shard),
    less the counts of the `fixed` shards, which keep them."""
    free = [i for i in range(len(sizes)) if i not in fixed]
    left, total = want - sum(fixed.values()), sum(sizes[i] for i in free)
    quotas = [left * sizes[i] / total if i not in fixed and total else float(fixed.get(i, 1))
              for i in range(len(sizes))]
    counts = [fixed[i] if i in fixed else max(1, math.floor(quotas[i])) for i in range(len(sizes))]
    while sum(counts) > want:  # the at-least-one rule overshot: take from the most over-served shard
        over = [i for i in free if counts[i] > 1]
        if not over:
            break
        i = max(over, key=lambda i: (counts[i] - quotas[i], -i))
        counts[i] -= 1
    for i in sorted(free, key=lambda i: (counts[i] - quotas[i], i))[:max(0, want - sum(counts))]:
        counts[i] += 1  # the largest remainders first (ties by shard order)
    return counts


def _scale(shard: ShardPlan, content: bool) -> list[int]:
    """Where each frame starts on the scale splits are balanced by: the decompressed bytes when every
    seek table of the source declares them (compression ratios differ between prose and code, and
    tokens follow the text), else the stored offsets (frames, members, samples, row-group bytes)."""
    return shard.content if content else shard.frames


def _extent(shard: ShardPlan, content: bool) -> int:
    """The bytes a shard's splits share out: its size, or (frames) what its frames span."""
    if not shard.frames:
        return shard.size
    scale = _scale(shard, content)
    return scale[-1] - scale[0]


def _cut(index: int, shard: ShardPlan, pieces: int, content: bool) -> list[Split]:
    """`shard` in `pieces` splits of about equal bytes (fewer where its frames are too coarse)."""
    if not shard.frames:
        pieces = min(pieces, shard.size)
        bounds = [shard.size * k // pieces for k in range(pieces + 1)]
        return [Split(index, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    frames, last = _scale(shard, content), len(shard.frames) - 1
    if last < 1:
        return []
    cuts = [0]
    for k in range(1, pieces):
        goal = frames[0] + (frames[-1] - frames[0]) * k / pieces
        f = bisect.bisect_left(frames, goal, 1, last)
        f = f - 1 if f > 1 and goal - frames[f - 1] <= frames[f] - goal else f  # the nearer boundary
        if cuts[-1] < f < last:
            cuts.append(f)
    cuts.append(last)
    return [Split(index, a, b) for a, b in zip(cuts, cuts[1:])]


# ---- reading -------------------------------------------------------------------------------------

class BadRecords:
    """A source's bad-record policy: raise the DataError (`on_bad_record = "error"`) or count it,
    by the epoch of the split it was read in. A reader gets `at(epoch)`, bound to its split's epoch;
    a record is counted once for each epoch that reads it. Records that a transform's filter
    drops are counted here too (`filtered`), the same way."""

    epoch = 0  # unbound: what a reader outside a lane's sequence (a source check, a test) counts into

    def __init__(self, on_bad: Literal["error", "skip"] = "error") -> None:
        self.skipping = on_bad == "skip"
        self.by_epoch: collections.Counter[int] = collections.Counter()
        self.filtered_by_epoch: collections.Counter[int] = collections.Counter()
        self.first: str | None = None  # the first skipped record's error, for a later message
        self.source: str | None = None  # a loader source's name: its first skip is logged (`Lanes`)

    @property
    def count(self) -> int:
        return sum(self.by_epoch.values())

    def __call__(self, err: DataError, epoch: int = 0) -> None:
        if not self.skipping:
            raise err
        self.by_epoch[epoch] += 1
        if self.first is None:
            self.first = str(err)
            if self.source is not None:  # a setting that skips most records (a too-narrow image_field) showed
                log.warning("source %r skips bad records (on_bad_record = \"skip\"); the first: %s. Each is counted "
                            "in statistics().skipped_records", self.source, err,  # nowhere but in a count
                            extra={"event": "skipping", "source": self.source})

    def filtered(self, epoch: int = 0) -> None:
        """A filter dropped a record of `epoch`."""
        self.filtered_by_epoch[epoch] += 1

    def at(self, epoch: int) -> _AtEpoch:
        """This policy, counting into `epoch`."""
        return _AtEpoch(self, epoch)


class RecordCounts(msgspec.Struct, frozen=True, array_like=True):
    """What the parsers of a process (or several, summed with `+`) counted so far: bad records
    skipped by epoch, and records that filters dropped, by source and epoch. Workers send it to
    the loader, which shows it in `statistics()`."""

    skipped: dict[int, int] = {}  # epoch -> bad records skipped
    filtered: dict[int, dict[int, int]] = {}  # source -> epoch -> records filtered out

    def __add__(self, other: RecordCounts) -> RecordCounts:
        filtered = {s: dict(_summed(self.filtered.get(s, {}), other.filtered.get(s, {})))
                    for s in sorted(self.filtered.keys() | other.filtered.keys())}
        return RecordCounts(dict(sorted(_summed(self.skipped, other.skipped).items())), filtered)


def _summed(a: dict[int, int], b: dict[int, int]) -> collections.Counter[int]:
    out = collections.Counter(a)
    out.update(b)
    return out


class _AtEpoch:
    __slots__ = ("records", "epoch")

    def __init__(self, records: BadRecords, epoch: int) -> None:
        self.records, self.epoch = records, epoch

    @property
    def skipping(self) -> bool:
        return self.records.skipping

    def __call__(self, err: DataError) -> None:
        self.records(err, self.epoch)

    def filtered(self) -> None:
        self.records.filtered(self.epoch)


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
                 read_ahead: int = 1, bad: BadRecords | _AtEpoch | None = None) -> None:
        self.store, self.key, self.shard, self.split = store, shard.key, shard, split
        self.max_record = max_record
        self.run_cpu = run_cpu or threads.run_sync
        self.spawn, self.read_ahead = spawn, read_ahead
        self.bad = bad or BadRecords()
        self._byte_before = b""

    def _part(self, owned: int) -> int:
        """Request size for `owned` bytes: up to _READ_PART, small enough that the window has
        `read_ahead` requests to overlap (when there is a window)."""
        if self.spawn is None or self.read_ahead <= 1:
            return _READ_PART
        return min(_READ_PART, max(_MIN_PART, -(-owned // self.read_ahead)))

    def _ranges(self, ranges: list[tuple[int, int]]) -> AsyncIterator[bytes]:
        """The bytes of `ranges` in order: through a window when there is one, else one by one."""
        return read_ranges(functools.partial(self.store.read, self.key), ranges, self.read_ahead, self.spawn)

    def __repr__(self) -> str:
        return f"SplitReader({self.key!r}, {self.split})"

    # -- by position: the records a checkpoint refers to, without a scan from the split's start

    async def lines_at(self, want: Mapping[int, int], others: Iterable[int] = ()) -> dict[int, bytes] | None:
        """The lines of the records at decoded offsets `want` (offset -> length, newline included),
        read by their position instead of by a scan from the split's start, and the lines of
        `others` (offsets) that lie in the bytes decoded for those. An offset is in the result
        only where a record the split owns starts there: a line end (or the data's start) right
        before it; its line runs to the next line end (or the data's end).

        JSONL: one ranged read per record. zstd: the frames that hold each record (and the frame
        with the byte before it), found by the seek table's decompressed sizes, which are checked
        first: a decoded frame by what it decodes to, every frame between the split's start and
        the record by the size its header declares (which zstd checks whenever the frame is
        decoded, as the run that wrote the checkpoint did). So an offset means here what it
        meant to that run's scan.

        None where that cannot be known without the scan: gzip members; frames without a seek
        table's sizes, or a header that declares none, or sizes that disagree; a record whose
        frames decode to more than `_LOCATE_MAX`; and zstd with `on_bad_record = "skip"`, where a
        corrupt frame skipped before a record moved it. The caller scans then (`blocks`).
        """
        if self.key.endswith(GZIP_SUFFIXES) or not self.key.endswith(SUFFIXES):
            return None
        if not self.shard.frames:
            return await self._jsonl_lines(want)
        if self.bad.skipping or len(self.shard.content) != len(self.shard.frames):
            return None
        return await self._frame_lines(want, others)

    async def _jsonl_lines(self, want: Mapping[int, int]) -> dict[int, bytes]:
        """JSONL: each record's bytes and the byte before it, in one ranged read each."""
        start, owned, size = self.split.start, self.split.end - self.split.start, self.shard.size
        out: dict[int, bytes] = {}

        async def one(offset: int, length: int) -> None:
            at = start + offset
            if not 0 <= offset < owned or length < 1 or at + length - 1 > size:
                return
            data = await self.store.read(self.key, max(at - 1, 0), min(at + length, size))
            line = data[1:] if at else data
            if (not at or data[:1] == b"\n") and _one_line(line, length, at + len(line) == size):
                out[offset] = line

        async with anyio.create_task_group() as tg:
            for offset, length in want.items():
                tg.start_soon(one, offset, length)
        return out

    async def _frame_lines(self, want: Mapping[int, int], others: Iterable[int]) -> dict[int, bytes] | None:
        """zstd: decode only the frames that hold the records (see `lines_at`)."""
        frames, content, split = self.shard.frames, self.shard.content, self.split
        base, owned = content[split.start], content[split.end] - content[split.start]
        decode: set[int] = set()
        for offset, length in want.items():
            if 0 <= offset < owned and length > 0:
                span = self._frames_of(base + offset, length)
                if content[span[-1] + 1] - content[span[0]] > _LOCATE_MAX:
                    return None
                decode.update(span)
        if not decode:
            return {}
        runs = _runs(sorted(decode))
        check = [f for f in range(split.start, max(decode)) if f not in decode]
        data: dict[int, bytes] = {}
        declared: dict[int, int | None] = {}

        async def run(a: int, b: int) -> None:
            data[a] = await self.store.read(self.key, frames[a], frames[b + 1])

        async def headers(group: list[int]) -> None:
            lo = frames[group[0]]
            got = await self.store.read(self.key, lo, min(frames[group[-1] + 1], frames[group[-1]] + _HEADER_MAX))
            for f in group:
                declared[f] = _declared_size(got[frames[f] - lo:min(frames[f + 1], frames[f] + _HEADER_MAX) - lo])

        async with anyio.create_task_group() as tg:  # the headers' reads and the frames' at once
            for a, b in runs:
                tg.start_soon(run, a, b)
            for group in self._header_groups(check):
                tg.start_soon(headers, group)
        if any(declared[f] != content[f + 1] - content[f] for f in check):
            return None
        out: dict[int, bytes] = {}
        wanted = set(want) | set(others)
        for a, b in runs:
            decoded = await self.run_cpu(self._decode_frames, a, b, data.pop(a))
            if decoded is None:
                return None
            out.update(self._lines_in(decoded, content[a] - base, a == 0 or content[a] == content[0],
                                      b == len(frames) - 2, wanted, owned))
        return out

    def _header_groups(self, check: list[int]) -> list[list[int]]:
        """`check` (ascending frames) in groups whose headers one read takes: small frames' headers
        lie close together, and a request costs more than the bytes between them (an S3 GET)."""
        frames, groups = self.shard.frames, []
        for f in check:
            if groups and frames[f] - frames[groups[-1][-1]] <= _HEADER_GAP and frames[f] - frames[groups[-1][0]] \
                    + _HEADER_MAX <= _READ_PART:
                groups[-1].append(f)
            else:
                groups.append([f])
        return groups

    def _frames_of(self, at: int, length: int) -> range:
        """The frames holding decoded bytes [at, at + length) of the shard and the byte before `at`."""
        content, last = self.shard.content, len(self.shard.frames) - 2
        first = _frame_at(content, last, at - 1) if at > content[0] else _frame_at(content, last, at)
        return range(first, _frame_at(content, last, min(at + length - 1, content[-1] - 1)) + 1)

    def _decode_frames(self, a: int, b: int, data: bytes) -> bytes | None:
        """Frames `a..b` of the shard (their compressed bytes `data`), each decoded and checked
        against its seek-table size; None where one decodes to another size."""
        frames, content, out = self.shard.frames, self.shard.content, []
        for f in range(a, b + 1):
            stream = ZstdStream(self.key, frames[f], frames, f)
            piece, expect, got = data[frames[f] - frames[a]:frames[f + 1] - frames[a]], content[f + 1] - content[f], 0
            while True:
                decoded, _ = stream.pull(DECODE_PIECE, piece)  # error mode: a corrupt frame raises
                piece, got = b"", got + len(decoded)
                if got > expect:  # bounded: never more than the table says
                    return None
                out.append(decoded)
                if len(decoded) < DECODE_PIECE:
                    break
            stream.expect_end(frames[f + 1])
            if got != expect:
                return None
        return b"".join(out)

    @staticmethod
    def _lines_in(decoded: bytes, at: int, data_start: bool, data_end: bool, offsets: set[int],
                  owned: int) -> dict[int, bytes]:
        """The lines of `offsets` found whole in `decoded` (which starts at split offset `at`;
        `data_start`: nothing decodes before it, `data_end`: nothing after it)."""
        out = {}
        for offset in offsets:
            i = offset - at
            if not 0 <= offset < owned or not 0 <= i < len(decoded):
                continue
            if (decoded[i - 1:i] != b"\n") if i else not data_start:
                continue
            end = decoded.find(b"\n", i)
            if end >= 0 or data_end:
                out[offset] = decoded[i:end + 1] if end >= 0 else decoded[i:]
        return out

    async def blocks(self, offset: int = 0) -> AsyncIterator[tuple[int, bytes]]:
        """Yield (decoded offset, bytes) blocks of whole lines owned by the split, from `offset`.

        `offset` > 0 must be a record start (a checkpoint cursor always is one). In skip mode a
        record longer than `max_record` is dropped up to its newline, and one cut by a corrupt
        frame is dropped; what follows that frame is read as a record start (a cut-off tail of a
        record then fails to decode: a bad record of its own).

        The blocks end where the split's records do, usually before its pieces: the pieces (and
        the decode under them) are closed then, not left for the event loop to finalize.
        """
        async with contextlib.aclosing(self._pieces(offset)) as pieces:
            async for block in self._blocks(pieces, offset):
                yield block

    async def _blocks(self, pieces: AsyncIterator[tuple[int, Piece, bool]],
                      offset: int) -> AsyncIterator[tuple[int, bytes]]:
        skip_partial: bool | None = None if offset == 0 and self.split.start > 0 else False
        pos, pending, owned_end = 0, b"", None
        before = b"\n"  # the byte before `offset` (a corrupt frame skipped before it counts as a line end)
        async for piece_pos, piece, inside in pieces:
            if skip_partial is None:  # after the first piece: for JSONL it carries the byte before the split
                skip_partial = not await self._starts_at_record()
            elif offset and inside and piece_pos == offset and not self.shard.frames and self._byte_before != b"\n":
                raise self.not_a_record_start(offset)  # JSONL: the first request carried the byte before
            if not inside and owned_end is None:
                owned_end = piece_pos
            if isinstance(piece, DataError):  # a skipped corrupt frame: the record it cuts is lost with it
                if piece_pos < offset:  # skipped (and counted) by the run that wrote the checkpoint
                    before = b"\n"
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
                before, pending, pos = pending[drop - 1:drop], pending[drop:], pos + drop
                if pos == offset and before != b"\n":
                    raise self.not_a_record_start(offset)
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

    def not_a_record_start(self, offset: int) -> IncompatibleState:
        """A resume `offset` that does not follow a line end: it cannot come from a checkpoint of this data."""
        return IncompatibleState(f"offset {offset} of {self.key!r} ({self.where(offset)}) is not a record start")

    def where(self, pos: int) -> str:
        """Human location of decoded offset `pos`, for error messages."""
        if self.shard.frames:
            frame = "gzip member" if self.key.endswith(GZIP_SUFFIXES) else "frame"
            return f"decompressed byte {pos} after the {frame} at compressed byte {self.shard.frames[self.split.start]}"
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
        stream = self._stream(f)
        for start in range(frames[f], frames[f + 1], _READ_PART):
            data = await self.store.read(self.key, start, min(frames[f + 1], start + _READ_PART))
            async with contextlib.aclosing(self._decode(stream, data)) as decoded:
                async for piece in decoded:
                    if isinstance(piece, DataError):
                        return None
                    last = piece[-1:]
        stream.expect_end(frames[f + 1])
        return last

    async def _pieces(self, offset: int) -> AsyncIterator[tuple[int, Piece, bool]]:
        """(decoded offset, piece, inside the owned range) from the split's start onwards."""
        if self.shard.frames:
            async with contextlib.aclosing(self._frame_pieces()) as frame_pieces:
                async for piece in frame_pieces:
                    yield piece
            return
        start, end, size = self.split.start, self.split.end, self.shard.size
        pos = start + offset
        if pos < end:  # the owned bytes; the first request also takes the byte before (the split or `offset`)
            lo = pos - 1 if pos > 0 else pos
            bounds = [*range(lo, end, self._part(end - lo)), end]
            peek = lo < pos
            async for data in self._ranges(list(zip(bounds, bounds[1:]))):
                if peek:
                    self._byte_before, data, peek = data[:1], data[1:], False
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
        stream = self._stream(split.start)
        pos = 0
        bounds = [*range(lo, hi, self._part(hi - lo)), hi]
        async for data in self._ranges(list(itertools.pairwise(bounds))):
            async with contextlib.aclosing(self._decode(stream, data)) as decoded:
                async for piece in decoded:
                    yield pos, piece, True
                    pos += len(piece) if isinstance(piece, bytes) else 0
        stream.expect_end(hi)
        for f in range(split.end, len(frames) - 1):  # one frame at a time, a large one in parts
            for start in range(frames[f], frames[f + 1], _TAIL_PART):
                data = await self.store.read(self.key, start, min(frames[f + 1], start + _TAIL_PART))
                async with contextlib.aclosing(self._decode(stream, data)) as decoded:
                    async for piece in decoded:
                        yield pos, piece, False
                        pos += len(piece) if isinstance(piece, bytes) else 0
        stream.expect_end(end)

    def _stream(self, first: int) -> ZstdStream | GzipStream:
        """A decoder of the shard's frames (gzip members) from frame `first` on.

        A corrupt frame comes back as a piece after the output decoded before it, in either mode:
        `_blocks` raises it (`self.bad`) in error mode, once the lines before it have gone out. A
        decoder that raised it instead dropped the earlier frames of the same call, whose size
        follows the read sizes (`read_ahead`), and the records before the error with them."""
        kind = GzipStream if self.key.endswith(GZIP_SUFFIXES) else ZstdStream
        return kind(self.key, self.shard.frames[first], self.shard.frames, first, skip_corrupt=True)

    async def _decode(self, stream: ZstdStream | GzipStream, data: bytes) -> AsyncIterator[Piece]:
        """Feed `data` to `stream`; its output in pieces of about DECODE_PIECE, and any corrupt frame."""
        while True:
            out, err = await self.run_cpu(stream.pull, DECODE_PIECE, data)
            data = b""
            if out:
                yield out
            if err is not None:
                yield err
            elif len(out) < DECODE_PIECE:  # the stream needs more input
                return


def _one_line(line: bytes, length: int, data_end: bool) -> bool:
    """`line` is one record of `length` (its newline counted): it ends at its only newline, or
    without one at the data's end (a last record without a newline counts one)."""
    if len(line) == length and line.endswith(b"\n"):
        return b"\n" not in line[:-1]
    return data_end and len(line) == length - 1 and b"\n" not in line


def _frame_at(content: list[int], last: int, at: int) -> int:
    """The frame (0..last) holding decoded byte `at` of the shard, by the running sizes `content`."""
    return min(max(bisect.bisect_right(content, at) - 1, 0), last)


def _runs(frames: list[int]) -> list[tuple[int, int]]:
    """Sorted frame indexes as runs of consecutive ones, `(first, last)`."""
    out: list[tuple[int, int]] = []
    for f in frames:
        if out and out[-1][1] == f - 1:
            out[-1] = (out[-1][0], f)
        else:
            out.append((f, f))
    return out


def _declared_size(header: bytes) -> int | None:
    """The decompressed size a zstd frame's header declares (0: a skippable frame), or None if
    it declares none or is no frame (RFC 8878, 3.1.1.1)."""
    if len(header) < 5:
        return None
    magic = int.from_bytes(header[:4], "little")
    if magic in _SKIPPABLE:
        return 0
    descriptor = header[4]
    single = descriptor >> 5 & 1
    size = (single, 2, 4, 8)[descriptor >> 6]
    at = 5 + (1 - single) + (0, 1, 2, 4)[descriptor & 3]
    if magic != _ZSTD_MAGIC or not size or len(header) < at + size:
        return None
    value = int.from_bytes(header[at:at + size], "little")
    return value + 256 if size == 2 else value


# ---- records -------------------------------------------------------------------------------------

MAX_DEPTH = 512  # JSON nesting a record may have: a fixed limit, not wherever the stack runs out
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, np.int64)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|"  # a high one alone, or
                        rb"(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")  # a low one


class _TooDeep(Exception):
    pass


def too_deep(line: bytes) -> bool:
    """Whether `line` nests JSON deeper than MAX_DEPTH: counted only where it holds enough brackets to."""
    return line.count(b"[") + line.count(b"{") > MAX_DEPTH and nesting(line) > MAX_DEPTH


def nesting(line: bytes) -> int:
    """How deep `line` nests JSON arrays and objects (brackets inside strings do not count)."""
    bare = np.frombuffer(_JSON_STRING.sub(b"", line), np.uint8)
    depth = peak = 0
    for i in range(0, len(bare), 1 << 20):  # in pieces: the running sums stay small
        sums = np.cumsum(_DEPTH_STEP[bare[i:i + (1 << 20)]]) + depth
        peak, depth = max(peak, int(sums.max())), int(sums[-1])
    return peak


class Parser:
    """Decodes blocks of JSON lines into (offset, length, payload) records, strictly.

    `text_field` may be any JSON key, or a dotted path into nested objects (`"doc.body"`) where
    no key is the whole name. A record nesting deeper than 512 levels is a bad record
    (whatever the caller's stack depth, so the same records are skipped on every backend).
    With `records` (a source's transforms, or a chat source's `messages_field`) a line is
    decoded whole, as a JSON object, and `records.payload` makes the payload; without, only
    the text field is decoded (the fast path).
    """

    def __init__(self, text_field: str, on_bad: Literal["error", "skip"], records: Records | None = None) -> None:
        self.text_field, self.on_bad = text_field, on_bad
        self.bad = BadRecords(on_bad)
        self.records = records if records is not None and not records.plain else None
        try:
            self._record = msgspec.json.Decoder(_record_type(text_field))
            self._text = self._text_field if "." not in text_field else self._text_path
        except ValueError:  # a key msgspec cannot rename to (a quote, backslash or control character)
            self._text = self._text_any_key
        if self.records is not None:
            self._text = _OBJECT.decode

    @property
    def skipped(self) -> int:
        return self.bad.count

    def __repr__(self) -> str:
        more = f", records={self.records!r}" if self.records is not None else ""
        return f"Parser(text_field={self.text_field!r}, on_bad={self.on_bad!r}{more})"

    def _text_field(self, line: bytes) -> str:
        return self._record.decode(line).text

    def _text_path(self, line: bytes) -> str:
        """The key that is the whole dotted name, else the path (msgspec decodes those fields alone).
        A record whose fields are not of the path's types (`{"a": null, "a.b": "text"}`) is
        looked at whole: the key may still be there."""
        try:
            record = self._record.decode(line)
        except msgspec.ValidationError:
            return self._text_any_key(line)
        if record.whole is not msgspec.UNSET:
            return record.whole
        for _ in self.text_field.split("."):
            record = record.next
            if record is msgspec.UNSET:
                raise msgspec.ValidationError(f"Object missing required field `{self.text_field}`")
        return record

    def _text_any_key(self, line: bytes) -> str:
        record = _OBJECT.decode(line)
        value = field(record, self.text_field)
        if value is None:
            raise msgspec.ValidationError(f"Object missing required field `{self.text_field}`")
        if not isinstance(value, str):
            raise msgspec.ValidationError(f"Expected `str`, got `{type(value).__name__}` - at `$.{self.text_field}`")
        return value

    def parse(self, reader: SplitReader, block_pos: int, block: bytes) -> list[tuple[int, int, Any]]:
        """Records of `block` as (decoded offset, length incl. newline, payload)."""
        out, pos = [], block_pos
        for line in block.split(b"\n"):
            n = len(line) + 1
            if line.strip():
                if n > reader.max_record + 1:
                    reader.bad(reader.too_long(pos, line))
                elif (text := self._decode(reader, pos, line)) is not None:
                    out.append((pos, n, text))
            pos += n
        return out

    def _decode(self, reader: SplitReader, pos: int, line: bytes) -> Any:
        """The payload of one record, or None if it is bad and skipped (or filtered out)."""
        try:
            if too_deep(line):
                raise _TooDeep
            value = self._text(line)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, _TooDeep) as exc:
            hint = "" if self.bad.skipping else ' (set on_bad_record = "skip" to skip such records)'
            err = DataError(f"bad record in {reader.key!r} at {reader.where(pos)}: {_why(exc, line)}{hint}",
                            key=reader.key, offset=pos)
            err.__cause__ = exc
            reader.bad(err)  # the reader's policy: it counts into the epoch of its split
            return None
        return value if self.records is None else self.records.payload(value, reader, pos)


_OBJECT = msgspec.json.Decoder(dict[str, Any])  # a whole record, for transforms and chat sources


def _record_type(text_field: str) -> type:
    """A struct that decodes `text_field` alone: `.text`; for a dotted name, `.whole` (a key that
    is the whole name) and the path as nested `.next` fields, each UNSET where absent."""
    if "." not in text_field:
        return msgspec.defstruct("Record", [("text", str)], rename={"text": text_field})
    first, *rest = text_field.split(".")
    inner: Any = str
    for part in reversed(rest):
        inner = msgspec.defstruct("Level", [("next", inner | msgspec.UnsetType, msgspec.UNSET)], rename={"next": part})
    return msgspec.defstruct("Record", [("whole", str | msgspec.UnsetType, msgspec.UNSET),
                                        ("next", inner | msgspec.UnsetType, msgspec.UNSET)],
                             rename={"whole": text_field, "next": first})


def _why(exc: Exception, line: bytes) -> str:
    """What is wrong with a record that does not decode, in words that name the likely cause."""
    if isinstance(exc, (RecursionError, _TooDeep)):
        return f"it nests JSON arrays or objects more than {MAX_DEPTH} deep, the most a record may"
    msg = str(exc)
    if line.startswith(b"\xef\xbb\xbf"):
        return f"{msg}: the line starts with a UTF-8 byte order mark (EF BB BF); remove it"
    if isinstance(exc, msgspec.ValidationError):
        if msg.startswith("Object missing required field"):  # the setting names another field: say which there are
            try:
                fields = list(_OBJECT.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError):
                return msg
            shown = ", ".join(repr(f) for f in fields[:8]) + (", ..." if len(fields) > 8 else "")
            return f"{msg}; the record's fields are {shown or 'none'}"
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
