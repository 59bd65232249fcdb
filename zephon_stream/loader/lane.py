"""The text pipeline of one lane: read -> tokenize -> mix -> shuffle -> pack.

```
source 0: SplitReader -> parse -> tokenize --[doc_buffer]--\\
source 1: SplitReader -> parse -> tokenize --[doc_buffer]---> Mix -> Shuffle -> Pack --[sample_buffer]--> sequencer
```

Each source runs ahead in its own task, bounded by `doc_buffer` batches. Mix, Shuffle and Pack
are pulled in one task, so the lane state right after each sample is one consistent snapshot;
it travels with the sample and becomes the checkpoint once the trainer consumes the sample.
Lane `l` takes the splits of source `s` at positions `l, l+L, l+2L, ...` of the endless
sequence `perm(s, epoch 0) ++ perm(s, epoch 1) ++ ...`, so every split of an epoch goes to
exactly one lane, whatever the number of splits.

A lane cannot see a whole epoch of a source (it reads only its own positions), so a source
that yields no document at all would leave it reading empty splits forever. A lane that reads
`_EMPTY_RUN` positions in a row without a document therefore checks the whole source once
(every split, stopping at the first document): a source with none is a DataError. Valid data
never fails the check, and the check never changes what a lane yields.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import lru_cache
from typing import Any

import anyio
import msgspec
import numpy as np

from zephon_stream.loader.config import Config
from zephon_stream.engine.rng import permutation
from zephon_stream.loader.state import DocRef, LaneState
from zephon_stream.errors import CheckpointError, DataError
from zephon_stream.connectors.base import Store
from zephon_stream.operators.mix import Doc, Mix
from zephon_stream.operators.pack import Pack, Sample
from zephon_stream.operators.read import Parser, SourcePlan, SplitReader
from zephon_stream.operators.shuffle import Shuffle
from zephon_stream.operators.tokenize import Tokenize

RunCpu = Callable[..., Awaitable[Any]]
_EMPTY_RUN = 8  # split positions in a row without a document before a lane checks the whole source


class DataPlan(msgspec.Struct, frozen=True):
    """Every source's shards and splits, and the data fingerprint."""

    sources: list[SourcePlan]
    fingerprint: str


class Lanes:
    """What every lane of a process shares: config, plan, stores, tokenizer, CPU policy."""

    def __init__(self, config: Config, plan: DataPlan, stores: list[Store], tokenizer: Tokenize,
                 run_cpu: RunCpu) -> None:
        self.config, self.plan, self.stores, self.tokenizer, self.run_cpu = config, plan, stores, tokenizer, run_cpu
        self.parsers = [Parser(s.text_field, config.on_bad_record) for s in plan.sources]
        self._perm = lru_cache(maxsize=8)(self._permutation)
        self.spawn: Callable[..., Any] | None = None  # the lanes' task group, for read-ahead requests
        self._has_documents = [False] * len(plan.sources)  # checked once per process, see `check_source`
        self._checking = [anyio.Lock() for _ in plan.sources]  # one check at a time; the others wait for it

    def _permutation(self, source: int, epoch: int) -> list[int]:
        return permutation(len(self.plan.sources[source].splits), self.config.seed, source, epoch)

    def reader(self, source: int, lane: int, position: int) -> SplitReader | None:
        """The reader of the split at `position` of `lane`'s sequence for `source`, or None at the end."""
        src = self.plan.sources[source]
        g = lane + position * self.config.lanes
        epoch, index = divmod(g, len(src.splits))
        if self.config.max_epochs and epoch >= self.config.max_epochs:
            return None
        split = src.splits[self._perm(source, epoch)[index]]
        return SplitReader(self.stores[source], src.shards[split.shard], split, self.config.max_record_bytes,
                           self.run_cpu, spawn=self.spawn, read_ahead=self.config.read_ahead,
                           bad=self.parsers[source].bad)

    async def check_source(self, source: int) -> None:
        """Raise DataError if no split of `source` yields a document: every epoch would be empty.

        Reads the splits in order until the first document, with a parser of its own, so the
        check counts nothing in the loader's statistics.
        """
        async with self._checking[source]:
            if not self._has_documents[source]:
                await self._check_source(source)

    async def _check_source(self, source: int) -> None:
        src, cfg = self.plan.sources[source], self.config
        parser = Parser(src.text_field, cfg.on_bad_record)
        for split in src.splits:
            reader = SplitReader(self.stores[source], src.shards[split.shard], split, cfg.max_record_bytes,
                                 self.run_cpu, bad=parser.bad)
            async for pos, block in reader.blocks():
                if await self.run_cpu(parser.parse, reader, pos, block):
                    self._has_documents[source] = True
                    return
        what = (f"all {parser.skipped} of its records are bad and skipped (on_bad_record = \"skip\"); the first: "
                f"{parser.bad.first}" if parser.skipped else "its shards hold nothing but blank lines")
        raise DataError(f"source {src.name!r} ({src.uri}) yields no document in a whole epoch of its "
                        f"{len(src.splits)} splits, so no batch could ever be made: {what}")

    def skipped(self) -> int:
        return sum(p.skipped for p in self.parsers)

    def decode(self, source: int, position: int, reader: SplitReader, pos: int, block: bytes) -> list[Doc]:
        records = self.parsers[source].parse(reader, pos, block)
        return [((source, position, off, n), text) for off, n, text in records]

    def tokenize(self, docs: list[Doc]) -> list[Doc]:
        return [(ref, ids) for (ref, _), ids in zip(docs, self.tokenizer([t for _, t in docs]))]


class TextLane:
    """One lane: its output depends only on (config, seed, lane id, data)."""

    def __init__(self, shared: Lanes, lane: int, state: LaneState | None = None) -> None:
        self.shared, self.lane = shared, lane
        cfg = shared.config
        n = len(shared.plan.sources)
        self.state_in = state or LaneState(lane, 0, False, [(0, 0)] * n, [0] * n, 0, [], 0, None, 0)
        self._feeds: list[_Feed] = []
        self.mix = Mix([s.weight for s in cfg.sources], cfg.seed, lane, cfg.mix == "tokens",
                       [self._pull(s) for s in range(n)])
        self.shuffle = Shuffle(cfg.shuffle_window, cfg.seed, lane, self.mix.next)
        pad = shared.tokenizer.eos_id if cfg.pad_token_id is None else cfg.pad_token_id
        self.pack = Pack(cfg.seq_len, pad, cfg.mask_cross_document_labels, self.shuffle.next)

    def __repr__(self) -> str:
        return f"TextLane({self.lane})"

    def _pull(self, source: int) -> Callable[[], Awaitable[Doc | None]]:
        return lambda: self._feeds[source].next()

    async def run(self, out: anyio.abc.ObjectSendStream[list[Sample]]) -> None:
        """Produce samples into `out` (in batches of `sample_batch`) until the data ends."""
        cfg, st = self.shared.config, self.state_in
        async with out, AsyncExitStack() as stack, anyio.create_task_group() as tg:
            await self._restore(st)  # before read-ahead starts, so the two do not compete for CPU
            for s, cursor in enumerate(st.cursors):
                send, recv = anyio.create_memory_object_stream[list[Doc]](cfg.doc_buffer)
                stack.enter_context(recv)
                self._feeds.append(_Feed(recv))
                tg.start_soon(self._read_source, s, cursor, send)
            index, batch = st.samples, []
            while not st.done:
                sample = await self.pack.next(self.lane, index)
                if sample is None:
                    break
                index += 1
                sample.state = self._snapshot(index)
                batch.append(sample)
                if len(batch) == cfg.sample_batch:
                    await out.send(batch)
                    batch = []
            if batch:
                await out.send(batch)
            tg.cancel_scope.cancel()

    def _snapshot(self, samples: int) -> LaneState:
        m, sh, p = self.mix, self.shuffle, self.pack
        return LaneState(self.lane, samples, False, list(m.cursors), list(m.counts), m.position,
                         [d[0] for d in sh.window], sh.pulls, p.carry[0] if p.carry else None, p.offset)

    async def _restore(self, st: LaneState) -> None:
        refs = list(st.window) + ([st.carry] if st.carry else [])
        docs = dict(zip(refs, await self._reread(refs))) if refs else {}
        self.mix.restore(st.counts, st.position, st.cursors)
        self.shuffle.restore([(tuple(r), docs[tuple(r)]) for r in st.window], st.pulls)
        self.pack.restore((tuple(st.carry), docs[tuple(st.carry)]) if st.carry else None, st.carry_offset)

    async def _reread(self, refs: list[DocRef]) -> list[np.ndarray]:
        """Read and tokenize the documents a checkpoint refers to: one pass over each split involved."""
        by_split: dict[tuple[int, int], set[int]] = {}
        for source, position, offset, _ in refs:
            by_split.setdefault((source, position), set()).add(offset)
        texts: dict[tuple[int, int, int], str] = {}

        async def one(source: int, position: int, offsets: set[int]) -> None:
            reader = self.shared.reader(source, self.lane, position)
            if reader is None:
                raise CheckpointError(f"lane {self.lane} state refers to split position {position} of source "
                                      f"{source}, past the end of the data: the checkpoint does not match it")
            last = max(offsets)
            async for pos, block in reader.blocks(min(offsets)):
                for (_, _, off, _), text in await self.shared.run_cpu(self.shared.decode, source, position,
                                                                       reader, pos, block):
                    if off in offsets:
                        texts[source, position, off] = text
                if pos + len(block) > last:
                    return

        async with anyio.create_task_group() as tg:
            for (source, position), offsets in by_split.items():
                tg.start_soon(one, source, position, offsets)
        missing = [r for r in refs if (r[0], r[1], r[2]) not in texts]
        if missing:
            raise CheckpointError(f"lane {self.lane} state refers to documents that are not in the data: "
                                  f"{missing[:3]}: the checkpoint does not match the data")
        return await self.shared.run_cpu(self.shared.tokenizer, [texts[r[0], r[1], r[2]] for r in refs])

    async def _read_source(self, source: int, cursor: tuple[int, int], send: anyio.abc.ObjectSendStream) -> None:
        shared, position, offset = self.shared, *cursor
        batch = shared.config.tokenize_batch
        empty = 0  # positions in a row that gave no document
        async with send:
            while (reader := shared.reader(source, self.lane, position)) is not None:
                found = False
                async for pos, block in reader.blocks(offset):
                    docs = await shared.run_cpu(shared.decode, source, position, reader, pos, block)
                    found = found or bool(docs)
                    for i in range(0, len(docs), batch):
                        await send.send(await shared.run_cpu(shared.tokenize, docs[i:i + batch]))
                empty = 0 if found else empty + 1
                if empty >= min(_EMPTY_RUN, len(shared.plan.sources[source].splits)):
                    await shared.check_source(source)
                position, offset = position + 1, 0


class _Feed:
    """Hands out a source's documents one at a time from its batches."""

    def __init__(self, recv: anyio.abc.ObjectReceiveStream[list[Doc]]) -> None:
        self.recv, self.batch, self.i = recv, [], 0

    async def next(self) -> Doc | None:
        while self.i >= len(self.batch):
            try:
                self.batch, self.i = await self.recv.receive(), 0
            except anyio.EndOfStream:
                return None
        self.i += 1
        return self.batch[self.i - 1]
