"""WebDataset-style tar shards: a per-shard sample index, a sample parser, and a writer.

A sample is a run of consecutive file members that share a *key*: a member's path up to the first
"." of its basename (`dir/000123.png` -> key `dir/000123`, extension `png`; extensions are compared
lowercased). A member holds one header block (512 bytes, after any GNU longname 'L'/'K' or pax 'x'/'g'
extension headers of its own) and its data, padded to whole blocks:

```
shard:  | hdr 000.png | data ... | hdr 000.txt | data | hdr 001.png | data ... | hdr 001.txt | data | 0 | 0 |
starts:   0                                              s1                                          end
          [------------- sample "000" ------------------)[------------- sample "001" -----------------)
```

`tar_index` walks the headers with ranged reads, skipping the contents of members larger than one
read (reads double, up to 1 MiB, while the contents are smaller), and returns where each sample
starts (then the end of the last complete sample), so a planner can cut a shard into splits at
sample starts. `parse_samples` decodes a block of whole
samples read from those offsets. Both walk headers with the same code, so a range the index
accepted parses without error unless the object changed.

Members that are not files (directories, links, devices) and files whose basename has no key and
extension (`README`, `.hidden`, `x.`) belong to no sample; they are skipped and counted
(`TarIndex.ignored`), as WebDataset skips them. A tar that ends without its two zero blocks is
read to its last member; a truncated tar that happens to end exactly between two members of one
sample cannot be told from such a tar, so its last sample comes back without the missing members.
"""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from zephon_stream.connectors.base import Store
from zephon_stream.engine import threads
from zephon_stream.engine.files import atomic_write
from zephon_stream.errors import DataError

__all__ = ["INDEX_READ", "TarIndex", "TarSample", "parse_samples", "tar_index", "write_tar_shards"]

INDEX_READ = 64 << 10  # bytes per ranged read of the index walk: small members cost no extra request
_INDEX_READ_MAX = 1 << 20  # ... and the most, reached by doubling while no large content is skipped
_BLOCK = 512
_MAX_EXTENSIONS = 1 << 20  # bytes of extension headers ('L', 'K', 'x', 'g') one member may have: names are short
_ZERO = bytes(_BLOCK)
_FILE_TYPES = frozenset(b"07\0")  # regular, contiguous, old-style regular
_NO_DATA_TYPES = frozenset(b"123456")  # links, devices, directories, FIFOs: tarfile reads no data after them
_OCTAL = re.compile(rb"[0-7]*")


class TarSample(msgspec.Struct, frozen=True):
    """One sample: its members by lowercased extension, and where it lies in the shard."""

    offset: int  # the shard offset of its first header block
    length: int  # bytes from there to the end of its last member's padded data
    key: str
    members: dict[str, bytes]


class TarIndex(msgspec.Struct, frozen=True, array_like=True):
    """Where a shard's samples start: `starts[i]` is sample i's first header, and `starts[-1]` the end
    of the last complete sample (so sample i is bytes `[starts[i], starts[i + 1])`, with any ignored
    members between samples). Empty when the shard holds no complete sample.

    `bad_tail` says why the walk stopped before the end of the archive (a truncated or corrupt
    header, ...), and `bad_offset` where; the samples before stay. A sample with a member over
    the limit is a sample of `starts` all the same (its header says how far to skip), named in
    `oversized` (its start: why), and read as one bad record, its content unread.
    """

    starts: list[int]
    bad_tail: str | None = None
    bad_offset: int = -1
    ignored: int = 0  # members that belong to no sample (directories, links, names without an extension)
    oversized: dict[int, str] = {}


# ---- walking headers -----------------------------------------------------------------------------

class _Member(NamedTuple):
    start: int  # the shard offset of its first header (an extension header if it has one)
    data: int  # of its data
    size: int
    end: int  # after its padded data
    name: str
    kind: int  # the typeflag of its own header
    too_big: str = ""  # why, when its content is over the limit (an index walk skips it; a parse refuses it)


class _Bad(Exception):
    """Malformed from `offset` on: `name` is the member's name when its header could be read."""

    def __init__(self, message: str, offset: int, name: str | None = None) -> None:
        super().__init__(message)
        self.offset, self.name = offset, name


class _More(Exception):
    """The walk needs the bytes up to shard offset `upto`, beyond what it was given."""

    def __init__(self, upto: int) -> None:
        self.upto = upto


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


class _Walker:
    """Reads one member at a time from bytes `view` that begin at shard offset `base`.

    `limit` is where the data ends (the object's size, or the end of a block read); a member
    that needs bytes beyond it is truncated. Bytes before `limit` but not in `view` raise `_More`.
    """

    def __init__(self, key: str, limit: int, max_member: int, end_what: Literal["shard", "block"]) -> None:
        self.key, self.limit, self.max_member, self.end_what = key, limit, max_member, end_what
        self.view: bytes | bytearray | memoryview = b""  # shard bytes from offset `base` on
        self.base = 0

    def need(self, lo: int, hi: int, what: str) -> bytes | bytearray | memoryview:
        if hi > self.limit:
            raise _Bad(f"{what} of {self.key!r} needs bytes {lo}..{hi}, {self._short()}", lo)
        if lo < self.base or hi > self.base + len(self.view):
            raise _More(hi)
        return self.view[lo - self.base:hi - self.base]

    def _short(self) -> str:
        """Why data ends before `self.limit`, and what to do."""
        if self.end_what == "shard":
            return f"but the shard ends at byte {self.limit}: the tar is truncated; rewrite the shard"
        return f"but the block read ends at byte {self.limit}: parse whole samples, from the offsets of the index"

    def member(self, pos: int) -> _Member | None:
        """The member whose headers start at `pos`, or None at the end of the archive."""
        at, name, size = pos, None, None
        while True:
            if at == self.limit and at == pos:
                return None  # a tar written without its end blocks
            if at + _BLOCK > self.limit and at == pos and not any(self.need(at, self.limit, "the end")):
                return None  # zero padding shorter than a block: the end blocks, cut short
            header = bytes(self.need(at, at + _BLOCK, f"the header at byte {at}"))
            if header == _ZERO:
                if at == pos:
                    return None
                raise _Bad(f"the extension header at byte {pos} of {self.key!r} is followed by the end of the "
                           "archive, not by its member: the shard is corrupt; rewrite it", pos)
            self._check_sum(header, at)
            kind, own_size = header[156], self._number(header, 124, 136, at, "size")
            if kind in b"LKxg":
                content = self._extension(header, pos, at, own_size)
                name, size = self._apply(kind, content, at, name, size)
                at += _BLOCK + _padded(own_size)
                continue
            return self._finish(pos, at, header, name, own_size if size is None else size)

    def _finish(self, pos: int, at: int, header: bytes, name: str | None, size: int) -> _Member:
        kind, own = header[156], self._ustar_name(header)
        if kind == 0 and own.endswith(b"/"):
            kind = ord("5")  # an old-style directory (judged by its own header's name, as tarfile does)
        name = name if name is not None else self._text(own, at, "member name")
        if kind == ord("S"):
            raise _Bad(f"member {name!r} at byte {pos} of {self.key!r} is a GNU sparse file, which WebDataset shards "
                       "do not use: write the shard without --sparse", pos, name)
        if kind in _NO_DATA_TYPES:
            size = 0
        too_big = ""
        if size > self.max_member:
            too_big = (f"member {name!r} at byte {pos} of {self.key!r} holds {size:,} bytes, more than "
                       f"max_record_bytes = {self.max_member:,}: raise max_record_bytes or split the member")
        data = at + _BLOCK
        end = data + _padded(size)
        if end > self.limit:
            raise _Bad(f"member {name!r} at byte {pos} of {self.key!r} needs bytes up to {end}, {self._short()}", pos,
                       name)
        return _Member(pos, data, size, end, name, kind, too_big)

    def _check_sum(self, header: bytes, at: int) -> None:
        stored = self._number(header, 148, 156, at, "checksum")
        unsigned = _byte_sum(header) - sum(header[148:156]) + 8 * 32  # the checksum field counts as spaces
        if stored == unsigned:
            return
        high = sum(1 for b in header if b > 127) - sum(1 for b in header[148:156] if b > 127)
        if stored != unsigned - 256 * high:  # some old writers summed signed chars
            raise _Bad(f"bad header checksum at byte {at} of {self.key!r}: the header says {stored}, its bytes sum "
                       f"to {unsigned}: the shard is corrupt from here; rewrite it", at)

    def _number(self, header: bytes, lo: int, hi: int, at: int, field: str) -> int:
        raw = header[lo:hi]
        if raw[0] == 0x80:  # GNU base-256 (a negative 0xFF form is never a valid size)
            return int.from_bytes(raw[1:], "big")
        digits = raw.split(b"\0", 1)[0].strip(b" ")
        if not _OCTAL.fullmatch(digits):
            raise _Bad(f"the header at byte {at} of {self.key!r} has a malformed {field} field {raw!r}: the shard is "
                       "corrupt from here; rewrite it", at)
        return int(digits or b"0", 8)

    def _text(self, raw: bytes, at: int, what: str) -> str:
        try:
            return raw.decode()
        except UnicodeDecodeError as exc:
            raise _Bad(f"the {what} at byte {at} of {self.key!r} is not UTF-8 ({raw[:80]!r}, byte {exc.start}): rename "
                       "the member and rewrite the shard", at) from None

    @staticmethod
    def _ustar_name(header: bytes) -> bytes:
        name = header[:100].split(b"\0", 1)[0]
        if header[257:263] == b"ustar\0":  # POSIX ustar: a long path is split into prefix/name
            prefix = header[345:500].split(b"\0", 1)[0]
            name = prefix + b"/" + name if prefix else name
        return name

    def _extension(self, header: bytes, pos: int, at: int, size: int) -> bytes:
        """The content of the extension header at `at`, of the member whose headers start at `pos`."""
        if at + _BLOCK + size - pos > _MAX_EXTENSIONS:  # bounds memory, and the index's re-reads of a long chain
            raise _Bad(f"the extension headers at byte {pos} of {self.key!r} take more than {_MAX_EXTENSIONS} bytes "
                       f"(the {chr(header[156])!r} header at byte {at} holds {size}): names and pax records are "
                       "never that long; the shard is corrupt; rewrite it", pos)
        return bytes(self.need(at + _BLOCK, at + _BLOCK + size, f"the extension header at byte {at}"))

    def _apply(self, kind: int, content: bytes, at: int, name: str | None, size: int | None
               ) -> tuple[str | None, int | None]:
        """The (name, size) of the member after this extension header; the first header to set one wins
        (as in tarfile, which lets an outer extension header override an inner one)."""
        if kind == ord("L"):
            return (name if name is not None else self._text(content.split(b"\0", 1)[0], at, "GNU long name"),
                    size)
        if kind == ord("K"):  # a long link target: links are skipped anyway
            return name, size
        records = self._pax(content, at)
        if kind == ord("g"):
            if "path" in records or "size" in records:  # per-member values for all later members: no block stands alone
                raise _Bad(f"the pax global header at byte {at} of {self.key!r} sets {sorted(records)}; path or size "
                           "in a global header is not supported: rewrite the shard without it", at)
            return name, size
        if any(k.startswith("GNU.sparse.") for k in records):
            raise _Bad(f"the member at byte {at} of {self.key!r} is a GNU sparse file (pax GNU.sparse.* records), "
                       "which WebDataset shards do not use: write the shard without --sparse", at)
        if name is None and "path" in records:
            name = self._text(records["path"], at, "pax path")
        if size is None and "size" in records:
            raw = records["size"]
            if not raw.isdigit() or len(raw) > 20:  # (int() refuses a string of over 4300 digits)
                raise _Bad(f"the pax header at byte {at} of {self.key!r} has a malformed size {raw!r}: the shard is "
                           "corrupt; rewrite it", at)
            size = int(raw)
        return name, size

    def _pax(self, content: bytes, at: int) -> dict[str, bytes]:
        """The records `"%d %s=%s\\n"` of a pax header (length, key, value)."""
        records: dict[str, bytes] = {}
        pos = 0
        while pos < len(content) and content[pos]:
            space = content.find(b" ", pos, pos + 24)
            length = int(content[pos:space]) if space > pos and content[pos:space].isdigit() else 0
            record = content[pos:pos + length]
            eq = record.find(b"=", space - pos)
            if length <= space - pos or len(record) < length or not record.endswith(b"\n") or eq <= space - pos + 1:
                raise _Bad(f"the pax header at byte {at} of {self.key!r} has a malformed record at its byte {pos} "
                           f"({content[pos:pos + 40]!r}): the shard is corrupt; rewrite it", at)
            key = self._text(record[space - pos + 1:eq], at, "pax record key")
            records[key] = record[eq + 1:-1]
            pos += length
        return records


def _byte_sum(block: bytes) -> int:
    """The sum of a 512-byte block's bytes, by zlib's Adler-32 in C: its low 16 bits are 1 + the
    bytes' sum modulo 65521, and 256 bytes sum to at most 65280, so each half's is exact. Five
    times faster than `sum(block)`, which was a fifth of a tar sample's parse."""
    if len(block) != _BLOCK:  # (exact for two halves of at most 256 bytes only)
        return sum(block)
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


def _split_key(name: str) -> tuple[str, str] | None:
    """(key, lowercased extension) of a member name, or None when its basename has no key or extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1:].lower()


class _Samples:
    """Groups a walk's members into samples: consecutive file members with one key, no extension twice."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.current: str | None = None  # the open sample's key
        self.start = self.end = -1
        self.exts: set[str] = set()
        self.ignored = 0

    def add(self, m: _Member) -> tuple[_Span | None, str | None]:
        """Take member `m`: the sample it closes (when it opens another), and its extension (None when
        it belongs to no sample)."""
        split = _split_key(m.name) if m.kind in _FILE_TYPES else None
        if split is None:
            self.ignored += 1
            return None, None
        key, ext = split
        closed = None
        if key != self.current:
            closed = self.close()
            self.current, self.start, self.exts = key, m.start, set()
        if ext in self.exts:
            raise _Bad(f"sample {key!r} in {self.key!r} has two {ext!r} members (the second, {m.name!r}, at byte "
                       f"{m.start}): a sample holds each extension once; rewrite the shard", m.start, m.name)
        self.exts.add(ext)
        self.end = m.end
        return closed, ext

    def close(self) -> _Span | None:
        if self.current is None:
            return None
        out = _Span(self.start, self.end, self.current)
        self.current = None
        return out

    def opened_by(self, bad: _Bad) -> bool:
        """Whether the member that failed would have opened a new sample (so the open one is complete)."""
        split = _split_key(bad.name) if bad.name is not None else None
        return split is not None and split[0] != self.current


class _Span(NamedTuple):
    start: int
    end: int
    key: str


# ---- the index -----------------------------------------------------------------------------------

class _IndexWalk:
    """The index walk, fed ranged reads: `want` is the next (start, end) to read, None once done."""

    def __init__(self, key: str, size: int, max_member: int, read: int) -> None:
        self.walker = _Walker(key, size, max_member, "shard")
        self.walker.view = bytearray()
        self.samples = _Samples(key)
        self.size, self.read, self.pos = size, read, 0
        self.span = read  # bytes of the next read, see `feed`
        self.starts: list[int] = []
        self.end = 0  # of the last complete sample
        self.bad: _Bad | None = None
        self.oversized: dict[int, str] = {}  # sample start: why (a member over the limit, its content skipped)
        self.want: tuple[int, int] | None = (0, min(size, read))

    def feed(self, start: int, data: bytes) -> None:
        """Walk on with the bytes read from shard offset `start` (`want`), after those held if they follow."""
        w = self.walker
        del w.view[:self.pos - w.base]  # bytes before the current member are never needed again
        w.base = self.pos
        if start == w.base + len(w.view):
            w.view += data  # a member's headers longer than one read: read on, never read again
        else:
            w.view, w.base = bytearray(data), start
        while True:
            try:
                m = w.member(self.pos)
            except _More as more:
                held = w.base + len(w.view)
                # Read on from the bytes held when that skips no member's content, or less of it than the
                # next read takes anyway: then each read is twice the last, up to _INDEX_READ_MAX, so a shard
                # of small samples costs a few requests (and calls of this walk), not one per sample. A
                # larger content is skipped unread, and the reads start again at `read`.
                near = self.pos - held < self.span  # (negative while the member's headers are held)
                frm = held if near else self.pos
                self.span = min(2 * self.span, max(self.read, _INDEX_READ_MAX)) if near else self.read
                grow = max(self.span, held - self.pos)  # a long run of headers is walked again O(log n) times
                self.want = (frm, min(self.size, max(more.upto, frm + grow)))
                return
            except _Bad as bad:
                self._stop(bad)
                return
            if m is None:
                self._stop(None)
                return
            try:
                closed, ext = self.samples.add(m)
            except _Bad as bad:
                self._stop(bad)
                return
            self._took(closed)
            if m.too_big and ext is not None:  # a member of the open sample (one of no sample is skipped anyway)
                self.oversized.setdefault(self.samples.start, m.too_big)
            self.pos = m.end

    def _took(self, closed: _Span | None) -> None:
        if closed is not None:
            self.starts.append(closed.start)
            self.end = closed.end

    def _stop(self, bad: _Bad | None) -> None:
        self.want, self.bad = None, bad
        if bad is None or self.samples.opened_by(bad):
            self._took(self.samples.close())  # complete: the walk ended, or the bad member starts another sample

    def result(self) -> TarIndex:
        starts = [*self.starts, self.end] if self.starts else []
        kept = set(starts[:-1])
        oversized = {start: why for start, why in self.oversized.items() if start in kept}  # of complete samples
        if self.bad is None:
            return TarIndex(starts, ignored=self.samples.ignored, oversized=oversized)
        return TarIndex(starts, str(self.bad), self.bad.offset, self.samples.ignored, oversized)


async def tar_index(store: Store, key: str, size: int, max_member: int, *, read: int = INDEX_READ) -> TarIndex:
    """Index the samples of the tar shard `key` (`size` bytes): where each starts, and where the last ends.

    Walks the headers with ranged reads of about `read` bytes, so many small members cost one
    request and the contents of larger ones are skipped unread; while the contents are smaller
    than a read, each read is twice the last (up to 1 MiB), so small samples take few requests.
    The walk stops at the end of the archive (two zero blocks, or the end of the object), or at
    the first malformed header or member: the samples before it stay, and `bad_tail` says what
    is wrong and where. A sample is kept only when the walk saw all of it (a member that fails
    may belong to it). A member over `max_member` is skipped unread, and its sample is named in
    `oversized`: the walk goes on after it.
    """
    walk = _IndexWalk(key, size, max_member, read)
    while walk.want is not None:
        start, end = walk.want
        data = await store.read(key, start, end)
        if len(data) != end - start:
            raise DataError(f"{key!r} returned {len(data)} bytes for bytes {start}..{end} of a {size}-byte object: "
                            "it changed while being indexed; restart the loader", key=key, offset=start + len(data))
        await threads.run_sync(walk.feed, start, data)
    return walk.result()


# ---- parsing -------------------------------------------------------------------------------------

def parse_samples(block: bytes, base: int, key: str, max_member: int) -> list[TarSample]:
    """The samples of `block`, bytes of whole samples of shard `key` starting at shard offset `base`.

    The block ends at its last byte or at the archive's end blocks. Anything malformed (a bad
    header, a member over `max_member` or running past the block, an extension twice in a
    sample) raises a DataError naming the shard, the member and its offset.
    """
    walker = _Walker(key, base + len(block), max_member, "block")
    walker.view, walker.base = block, base
    samples = _Samples(key)
    out: list[TarSample] = []
    members: dict[str, bytes] = {}
    pos = base
    try:
        while (m := walker.member(pos)) is not None:
            closed, ext = samples.add(m)
            if m.too_big and ext is not None:  # the index names its sample, which readers do not read
                raise _Bad(m.too_big, m.start, m.name)
            if closed is not None:
                out.append(TarSample(closed.start, closed.end - closed.start, closed.key, members))
                members = {}
            if ext is not None:
                members[ext] = bytes(walker.view[m.data - base:m.data - base + m.size])
            pos = m.end
    except _Bad as bad:
        raise DataError(str(bad), key=key, offset=bad.offset) from None
    closed = samples.close()
    if closed is not None:
        out.append(TarSample(closed.start, closed.end - closed.start, closed.key, members))
    return out


# ---- writing -------------------------------------------------------------------------------------

def write_tar_shards(samples: Iterable[tuple[str, dict[str, bytes]]], out_dir: str | os.PathLike[str], *,
                     shard_bytes: int = 64 << 20, prefix: str = "shard") -> list[Path]:
    """Write `(key, {ext: bytes})` samples as tar shards `{prefix}-{i:05d}.tar` in `out_dir`; their paths.

    The bytes depend only on the samples: members `key.ext` in sorted extension order, mtime 0,
    uid/gid 0, mode 0o644, no user names, ustar headers (pax ones only for what ustar cannot
    hold, such as long or non-ASCII names), then two zero blocks. A shard takes samples in order
    until the next would take it past `shard_bytes` (a larger sample gets a shard of its own).
    Each shard is written to a temporary name and renamed. No samples, no shards.
    """
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pending = iter(_encoded(samples))
    paths: list[Path] = []
    nxt = next(pending, None)
    while nxt is not None:
        path = out / f"{prefix}-{len(paths):05d}.tar"
        chunks: list[bytes] = []
        size = 0
        while nxt is not None and (not chunks or size + len(nxt) <= shard_bytes - 2 * _BLOCK):
            chunks.append(nxt)
            size += len(nxt)
            nxt = next(pending, None)
        atomic_write(path, [*chunks, bytes(2 * _BLOCK)])
        paths.append(path)
    return paths


def _encoded(samples: Iterable[tuple[str, dict[str, bytes]]]) -> Iterator[bytes]:
    """Each sample's members as tar bytes: headers, data and padding."""
    for key, members in samples:
        _check_sample(key, members)
        parts: list[bytes] = []
        for ext in sorted(members):
            data = bytes(members[ext])
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            info.uname = info.gname = ""
            parts += [info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict"), data, bytes(_padded(len(data)) - len(data))]
        yield b"".join(parts)


def _check_sample(key: str, members: dict[str, bytes]) -> None:
    """A sample must read back as written: a key without a '.' in its basename, lowercase extensions."""
    base = key.rsplit("/", 1)[-1]
    if not base or "." in base or "\0" in key or key.startswith("/"):
        raise ValueError(f"sample key {key!r} must be a relative path whose last part is non-empty and has no '.'")
    if not members:
        raise ValueError(f"sample {key!r} has no members")
    for ext in members:
        if not ext or ext != ext.lower() or "/" in ext or "\0" in ext or ext.endswith("."):
            raise ValueError(f"sample {key!r}: extension {ext!r} must be non-empty, lowercase, with no '/' and not end "
                             "in '.'")
