"""A restore's documents: read and tokenized in the order the lane needs them, when it needs them.

A lane state refers to documents (a shuffle window, the packer's carry or window); restoring
re-reads them. A `Reread` holds them in need order and reads (`Documents`) and tokenizes:

- at once (`load`), what an operator needs whole in `restore` (the packer's documents);
- when first asked (`fetch`), a shuffle window's documents: the window holds them as
  `Deferred` payloads and fetches one when a pull takes it. A fetch reads and tokenizes that
  document and the next ones of its source in need order (`Shuffle.refs` lists a window that
  way), in chunks that double from `first_chunk` up to the source's batch size; while `lean()`
  says so (the loader's first step: `loader.lane.FirstStep`), one document a fetch, since a
  document fetched for a later pull is CPU the other lanes' first pulls wait behind.

```
need order  w17 w3 w40 w8 w22 w5 w61 ...   (the window's documents, as the next pulls take them)
fetch(w17): read, tokenize [w17]           first pull: the frames of one document, one tokenizer call
fetch(w3):  read, tokenize [w3 w40]        the next chunk, twice as long
fetch(w40): already there
```

`Documents` reads a document by its position where the split's reader can
(`SplitReader.lines_at`: JSON lines, zstd with a seek table): the frames that hold it, not its
split from the start; elsewhere the first ask of a split scans it once for all of its
documents. Reading and decoding whole splits had been most of a restore's time to the first
batch at the bench's defaults (12 lanes x 64-document windows: 32 MB decoded and parsed).

So the first sample after a restore waits for the few documents its pulls take, not the
whole window; what the lane yields does not change (payloads are the same either way). A
reference that matches no record is refused when a pull (or the packer's restore) needs it.
Memory: the records read and not tokenized yet, bounded by the window sizes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import anyio

from zephon_stream.errors import DataError, IncompatibleState, in_source
from zephon_stream.operators.read import SplitReader
from zephon_stream.operators.shuffle import Deferred
from zephon_stream.operators.types import Doc, DocRef

__all__ = ["Documents", "Reread", "interleave"]

Tokenize = Callable[[int, list[Doc]], Awaitable[list[Doc]]]  # (source, [(ref, record)]) -> [(ref, tokens)]
Read = Callable[[list[DocRef]], Awaitable[dict[DocRef, Any]]]  # refs -> their records (and maybe others')
_UNREAD = object()  # the record of a document not read yet


class Reread:
    """Records of re-read documents (`{ref: record}`, in need order), tokenized on demand.

    `tokenize(source, docs)` tokenizes documents of one source; `batch(source)` is the most
    documents a call takes; `refused(detail)` makes the lane's IncompatibleState. Its methods
    are never called concurrently: from the lane's task, or a window's fetch from a task of its
    own while the window fills from the feeds (`Shuffle`), which call none of them.
    """

    def __init__(self, records: dict[DocRef, Any], tokenize: Tokenize, batch: Callable[[int], int],
                 refused: Callable[[str], IncompatibleState], first_chunk: int = 1, *,
                 unread: Iterable[DocRef] = (), read: Read | None = None,
                 lean: Callable[[], bool] = lambda: False) -> None:
        self._todo = dict(records)  # not tokenized yet, in need order
        self._todo.update((ref, _UNREAD) for ref in unread if ref not in self._todo)
        self._read = read
        self._ready: dict[DocRef, Any] = {}  # tokenized, not handed out yet
        self._tokenize, self._batch, self._refused = tokenize, batch, refused
        self._chunk = max(1, first_chunk)
        self._lean = lean
        self.calls = 0  # tokenizer calls made (for tests and statistics)

    def __repr__(self) -> str:
        return f"Reread({len(self._todo)} to tokenize, {len(self._ready)} ready)"

    async def load(self, refs: Iterable[DocRef]) -> None:
        """Tokenize `refs` now (by source, a call per batch), for `now`."""
        by_source: dict[int, list[DocRef]] = {}
        for ref in refs:
            if ref in self._todo:
                by_source.setdefault(ref[0], []).append(ref)
        await self._read_now([r for mine in by_source.values() for r in mine])
        for source, mine in by_source.items():
            step = self._batch(source)
            for i in range(0, len(mine), step):
                await self._run(source, mine[i:i + step])

    def now(self, ref: DocRef) -> Doc:
        """The document `ref`, tokenized by `load` (a `Resolve` for operators that need it whole)."""
        ref = tuple(ref)
        if ref not in self._ready:
            raise self._refused(f"of a checkpoint's document {ref}: it was not loaded before the restore "
                                "that needs it (a bug: report it)")
        return ref, self._ready[ref]

    def later(self, ref: DocRef) -> Doc:
        """The document `ref`, its payload `Deferred` unless already tokenized (a `Resolve` for windows)."""
        ref = tuple(ref)
        if ref in self._ready:
            return ref, self._ready.pop(ref)
        return ref, Deferred(self.fetch)

    async def fetch(self, ref: DocRef) -> Any:
        """The tokens of `ref`, tokenizing it and the next documents of its source in need order."""
        if ref not in self._ready:
            if ref not in self._todo:
                raise self._refused(f"of a checkpoint's document {ref}: fetched twice (a bug: report it)")
            lean = self._lean()
            size = 1 if lean else min(self._chunk, self._batch(ref[0]))
            self._chunk *= 1 if lean else 2
            following = (r for r in self._todo if r[0] == ref[0] and r != ref)
            chunk = [ref, *(r for _, r in zip(range(size - 1), following))]
            await self._read_now(chunk)
            await self._run(ref[0], chunk)
        return self._ready.pop(ref)

    async def _read_now(self, refs: list[DocRef]) -> None:
        """Read the records of `refs` not read yet (keeping any other unread one the reads gave)."""
        unread = [ref for ref in refs if self._todo[ref] is _UNREAD]
        if not unread:
            return
        if self._read is None:
            raise self._refused(f"of a checkpoint's document {unread[0]}: nothing reads it (a bug: report it)")
        for ref, record in (await self._read(unread)).items():
            if self._todo.get(ref, None) is _UNREAD:
                self._todo[ref] = record

    async def _run(self, source: int, refs: list[DocRef]) -> None:
        docs = [(ref, self._todo.pop(ref)) for ref in refs]
        self.calls += 1
        tokens = dict(await self._tokenize(source, docs))
        lost = [ref for ref in refs if ref not in tokens]
        if lost:  # the first run tokenized these: a skipped record here means other data or another tokenizer
            raise self._refused(f"window or carry = {lost[:3]}: these documents of source {source} no longer "
                                "tokenize (skipped as bad records)")
        self._ready.update(tokens)


def interleave(orders: list[list[DocRef]]) -> list[DocRef]:
    """One need order from several (one per window): their first documents, then their seconds, ..."""
    out = []
    for i in range(max(map(len, orders), default=0)):
        out += [order[i] for order in orders if i < len(order)]
    return out


class _Lanes(Protocol):
    """What `Documents` needs of the lanes' shared parts (`loader.lane.Lanes`)."""

    run_cpu: Callable[..., Awaitable[Any]]
    plan: Any  # the DataPlan: its sources' names, for errors

    def reader(self, source: int, lane: int, position: int, counting: bool = True) -> Any: ...

    def decode(self, source: int, position: int, reader: Any, pos: int, block: bytes) -> list[Doc]: ...

    def decode_before(self, source: int, position: int, reader: Any, pos: int, block: Any,
                      error: DataError) -> list[Doc]: ...


Found = dict[int, tuple[int, Any]]  # decoded offset -> (length, record)


class Documents:
    """The documents a lane's checkpoint refers to, read when a `Reread` asks for them (`read`).

    Where the split's reader can (`SplitReader.lines_at`: JSON lines, and zstd frames with a
    seek table), a read takes only the bytes of the documents asked for: their frames, not the
    split from its start. Elsewhere the first ask of a split scans it once for every document of
    it the checkpoint refers to. A read also gives the other documents of the checkpoint that it
    passed over, for later asks. So a restore reads what the first draws need before the first
    sample, and the rest as the draws come to it (`Reread.fetch`'s growing chunks).

    `refused(detail)` makes the lane's IncompatibleState. Its methods are called from the
    lane's one task, never concurrently.
    """

    def __init__(self, lanes: _Lanes, lane: int, refs: Iterable[DocRef],
                 refused: Callable[[str], IncompatibleState]) -> None:
        self._lanes, self._lane, self._refused = lanes, lane, refused
        self._left: dict[tuple[int, int], dict[int, list[DocRef]]] = {}  # split -> offset -> refs not read yet
        for ref in refs:
            self._left.setdefault((ref[0], ref[1]), {}).setdefault(ref[2], []).append(tuple(ref))
        self._readers: dict[tuple[int, int], Any] = {}
        self.scans = 0  # splits read by a scan from their start (for tests)

    def __repr__(self) -> str:
        return f"Documents(lane {self._lane}, {sum(map(len, self._left.values()))} offsets not read yet)"

    async def read(self, refs: list[DocRef]) -> dict[DocRef, Any]:
        """The records of `refs` (refused if one is not in the data), and of others passed over."""
        by_split: dict[tuple[int, int], dict[int, int]] = {}
        for ref in refs:
            by_split.setdefault((ref[0], ref[1]), {})[ref[2]] = ref[3]
        out: dict[DocRef, Any] = {}
        async with anyio.create_task_group() as tg:
            for split, want in by_split.items():
                tg.start_soon(self._split, split, want, out)
        missing = [ref for ref in refs if ref not in out]
        if missing:
            raise self._refused(f"window or carry = {missing[:3]}: no such documents in the data "
                                "(a reference's offset or length does not match a record)")
        return out

    async def _split(self, split: tuple[int, int], want: dict[int, int], out: dict[DocRef, Any]) -> None:
        src = self._lanes.plan.sources[split[0]]
        with in_source(src.name, src.uri):
            await self._split_of(split, want, out)

    async def _split_of(self, split: tuple[int, int], want: dict[int, int], out: dict[DocRef, Any]) -> None:
        source, position = split
        left = self._left.setdefault(split, {})
        reader = self._reader(source, position)
        found: Found | None = None
        if isinstance(reader, SplitReader):
            lines = await reader.lines_at(want, [offset for offset in left if offset not in want])
            if lines is not None:
                found = await self._lanes.run_cpu(self._parse, source, position, reader, lines)
        if found is None:
            found = await self._scan(source, position, reader, set(left) | set(want))
        for offset, (length, record) in found.items():
            refs = left.get(offset, [])
            for ref in [r for r in refs if r[3] == length]:
                out[ref] = record
                refs.remove(ref)
            if not refs:
                left.pop(offset, None)

    def _reader(self, source: int, position: int) -> Any:
        if (source, position) not in self._readers:
            reader = self._lanes.reader(source, self._lane, position, counting=False)  # counted by the first run
            if reader is None:
                raise self._refused(f"sources[{source}] split position {position}: past the end of the data")
            self._readers[source, position] = reader
        return self._readers[source, position]

    def _parse(self, source: int, position: int, reader: Any, lines: dict[int, bytes]) -> Found:
        found: Found = {}
        for offset, line in lines.items():
            for (_, _, at, length), record in self._lanes.decode(source, position, reader, offset, line):
                found[at] = (length, record)
        return found

    async def _scan(self, source: int, position: int, reader: Any, offsets: set[int]) -> Found:
        """One pass over the split from its first document in `offsets` to its last."""
        self.scans += 1
        found: Found = {}
        last = max(offsets)
        lanes = self._lanes
        try:
            async for pos, block in reader.blocks(min(offsets)):
                try:
                    docs, ended = await lanes.run_cpu(lanes.decode, source, position, reader, pos, block), False
                except DataError as exc:  # a bad record (or a transform's, a page's error) beside the documents
                    docs = await lanes.run_cpu(lanes.decode_before, source, position, reader, pos, block, exc)
                    ended = True  # wanted: they come before it, as the feed handed them out before it; the
                    # lane's feed raises it (or skips it) where it reaches it, not the restore
                for (_, _, at, length), record in docs:
                    if at in offsets:
                        found[at] = (length, record)
                if ended or pos + len(block) > last:
                    break
        except IncompatibleState as exc:  # a reference in mid-record
            raise self._refused(f"of a document of source {source}: {exc}") from None
        return found
