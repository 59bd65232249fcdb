"""The text pipeline of one lane: a composition of operators (`engine.operator.Operator`).

```
Feed 0: SplitReader -> parse -> tokenize --[doc_buffer]--\\
Feed 1: SplitReader -> parse -> tokenize --[doc_buffer]---> Mix -> Shuffle -> Pack --[sample_buffer]--> sequencer
```

The reader and parser of a source depend on its format (`operators.sources`: JSONL and zstd
text, or WebDataset tar image+text, whose "tokenize" also decodes and resizes the image); the
rest of the lane is the same for all.

Each source's feed runs ahead in its own producer task, bounded by `doc_buffer` batches (an image
source: `vision.decode_ahead` images, in whole decode calls). Mix,
Shuffle and Pack are pulled in one task, so the lane state right after each sample is one consistent snapshot;
it travels with the sample and becomes the checkpoint once the trainer consumes the sample.
Lane `l` takes the splits of source `s` at positions `l, l+L, l+2L, ...` of the endless
sequence `perm(s, epoch 0) ++ perm(s, epoch 1) ++ ...`, so every split of an epoch goes to
exactly one lane, whatever the number of splits.

A lane cannot see a whole epoch of a source (it reads only its own positions), so a source
that yields no document at all would leave it reading empty splits forever. A lane that reads
`_EMPTY_RUN` positions in a row without a document therefore checks the whole source once
(every split, stopping at the first document): a source with none is a DataError. So does a
lane whose share of the source ends (`max_epochs`) with positions that gave no document: with
`max_epochs = 1` a lane may read a single position of it. Valid data never fails the check,
and the check never changes what a lane yields.
"""

from __future__ import annotations

import collections
import copy
import functools
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import lru_cache
from typing import Any

import anyio
import msgspec

from zephon_stream.chat import ChatTokens
from zephon_stream.connectors.base import Store, overlaps_reads
from zephon_stream.engine.operator import Operator, refuse
from zephon_stream.engine.rng import mix64, permutation
from zephon_stream.errors import DataError, IncompatibleState, in_source
from zephon_stream.loader.config import Config
from zephon_stream.loader.plan import DataPlan
from zephon_stream.loader.reread import Documents, Reread, interleave
from zephon_stream.loader.state import LaneState, split_at
from zephon_stream.operators.best_fit import BestFitPack
from zephon_stream.operators.feed import Feed, FeedSender, cut, piece_of
from zephon_stream.operators.images import VisionTokens
from zephon_stream.operators.mix import Mix, Schedule
from zephon_stream.operators.pack import Pack
from zephon_stream.operators.read import BadRecords, RecordCounts, SplitReader
from zephon_stream.operators.shuffle import Shuffle, ShuffleState
from zephon_stream.operators.single import SinglePack
from zephon_stream.operators.sources import make_parser, make_reader
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import Doc, LaneFailure, Sample

__all__ = ["Lanes", "TextLane", "decode_processes"]

RunCpu = Callable[..., Awaitable[Any]]
_EMPTY_RUN = 8  # split positions in a row without a document before a lane checks the whole source
HANDOFF_BYTES = 1 << 20  # a lane hands off its samples once they hold this much (or sample_batch of them)
_SOURCE_SHUFFLE = 0x53485546  # keys the RNG of a source's own shuffle window (shuffle_scope = "source")


class FirstStep:
    """The lanes of a process that have not handed off their samples of the first step yet.

    A lane that has waits here until none is left, so lanes that made their part of the first
    batch leave the CPU threads to the lanes the sequencer still waits for, instead of running
    ahead on later steps (after a restore they did three times the needed tokenizing). It only
    schedules: what a lane yields does not change. A lane started alone later (a worker
    restart) finds nobody pending and goes on. (It was off in Ray actors while its waits, which
    let a pool thread idle out, took a local Ray down: see `ray_backend._Owner`.)
    """

    def __init__(self) -> None:
        self._pending: set[int] = set()
        self._clear: anyio.Event | None = None  # made in the event loop, at the first `enter`

    def enter(self, lane: int) -> None:
        if not self._pending:
            self._clear = anyio.Event()
        self._pending.add(lane)

    def leave(self, lane: int) -> None:
        self._pending.discard(lane)
        if not self._pending and self._clear is not None:
            self._clear.set()

    def pending(self) -> bool:
        """Whether a lane of the process has not handed off its first step yet: while it has not,
        the lanes' feeds and restores read nothing ahead of their pulls (`Feed.lean`), so the CPU
        threads make only what the first batch takes."""
        return bool(self._pending)

    async def passed(self, lane: int) -> None:
        """`lane` has handed off its first step: wait for the others."""
        self.leave(lane)
        if self._clear is not None:
            await self._clear.wait()


def decode_processes(config: Config) -> int:
    """The decode processes a config runs: `vision.decode_processes` with backend "threads", else 0
    (`backends.warn_decode_processes` says so where the setting asks for more)."""
    return config.vision.decode_processes if config.vision is not None and config.backend == "threads" else 0


def lane_worker_config(config: Config) -> Config:
    """The config a lane worker (backend "processes", a Ray actor) runs its lanes on: backend
    "threads", with the images decoded on those threads. `decode_processes` is for backend
    "threads" alone (`backends.warn_decode_processes`): each worker started N decode processes."""
    vision = config.vision
    if vision is not None and vision.decode_processes:
        vision = msgspec.structs.replace(vision, decode_processes=0)
    return config.replace(backend="threads", vision=vision)


def png_text_limits(config: Config) -> tuple[int, int] | None:
    """This process's Pillow PNG text limits, for a lane worker to decode under (see
    `vision.image.png_text_limits`); None without images (no Pillow import for text)."""
    if config.vision is None:
        return None
    from zephon_stream.vision.image import png_text_limits as here

    return here()


def use_png_text_limits(limits: list[int] | tuple[int, int] | None) -> None:
    """In a lane worker: the limits `png_text_limits` took in the trainer's process."""
    if limits is not None:
        from zephon_stream.vision.image import use_png_text_limits as use

        use((limits[0], limits[1]))


def _decode_pool(config: Config) -> Any:
    """The process's decode processes for `decode_processes(config)`, or None for none."""
    if not (n := decode_processes(config)):
        return None
    from zephon_stream.vision.processes import decode_pool

    pool = decode_pool(n)
    pool.start()  # importing Pillow in the workers while the lanes start
    return pool


class Lanes:
    """What every lane of a process shares: config, plan, stores, tokenizer, CPU policy."""

    def __init__(self, config: Config, plan: DataPlan, stores: list[Store], tokenizer: Tokenize,
                 run_cpu: RunCpu, decode_cpu: RunCpu | None = None) -> None:
        self.config, self.plan, self.stores, self.tokenizer, self.run_cpu = config, plan, stores, tokenizer, run_cpu
        self.decode_cpu = decode_cpu or run_cpu  # image sources' decode calls (`vision.decode_threads`)
        self.images = [s.image_field is not None for s in config.sources]
        self.parsers = [self._parser(s) for s in range(len(plan.sources))]
        for parser, src in zip(self.parsers, config.sources):
            parser.bad.source = src.name  # the first skip of the lanes' reads is logged (not a source check's)
        self.vision = (VisionTokens(config.vision, tokenizer, config.seq_len, _decode_pool(config))
                       if config.vision is not None else None)
        self.chats = [ChatTokens.for_source(config, s, tokenizer) if src.messages_field is not None else None
                      for s, src in enumerate(config.sources)]
        self._perm = lru_cache(maxsize=8)(self._permutation)
        self.spawn: Callable[..., Any] | None = None  # the lanes' task group, for read-ahead requests
        self._has_documents = [False] * len(plan.sources)  # checked once per process, see `check_source`
        self._checking = [anyio.Lock() for _ in plan.sources]  # one check at a time; the others wait for it
        self.first_step = FirstStep()

    def _parser(self, source: int) -> Any:
        return make_parser(self.config, source, self.plan.sources[source])

    def _reader(self, source: int, split: Any, bad: Any, **window: Any) -> Any:
        return make_reader(self.config, source, self.plan.sources[source], self.stores[source], split, self.run_cpu,
                           bad, **window)

    def buffer(self, source: int) -> int:
        """The calls' worth of documents a feed of `source` reads ahead: `doc_buffer`, or for an image
        source `vision.decode_ahead` images in whole decode calls (a bound that does not grow with them)."""
        vision = self.config.vision
        return vision.decode_calls_ahead() if self.images[source] and vision is not None else self.config.doc_buffer

    def batch_size(self, source: int) -> int:
        """Documents per tokenize (and image decode) call for `source`."""
        return self.config.vision.decode_batch if self.images[source] else self.config.tokenize_batch

    def _permutation(self, source: int, epoch: int) -> list[int]:
        return permutation(len(self.plan.sources[source].splits), self.config.seed, source, epoch)

    def reader(self, source: int, lane: int, position: int, counting: bool = True) -> SplitReader | None:
        """The reader of the split at `position` of `lane`'s sequence for `source`, or None at the end.

        Its bad records count into the source's statistics under the split's epoch; with `counting`
        False (a restore re-reading what an earlier run counted) they are skipped the same way,
        uncounted."""
        src, cfg = self.plan.sources[source], self.config
        at = split_at(len(src.splits), cfg.lanes, cfg.max_epochs, lane, position)
        if at is None:
            return None
        split = src.splits[self._perm(source, at[0])[at[1]]]
        # uncounted: a policy of its own, still bound to the epoch (transforms' per-record seeds depend on it)
        bad = (self.parsers[source].bad if counting else BadRecords(cfg.on_bad_record)).at(at[0])
        ahead = self.config.read_ahead if overlaps_reads(self.stores[source]) else 1  # local: one part at a time
        return self._reader(source, split, bad, spawn=self.spawn, read_ahead=ahead)

    async def check_source(self, source: int) -> None:
        """Raise DataError if no split of `source` yields a document: every epoch would be empty.

        Reads the splits in order until the first document, with a parser of its own, so the
        check counts nothing in the loader's statistics.
        """
        async with self._checking[source]:
            if not self._has_documents[source]:
                await self._check_source(source)

    async def _check_source(self, source: int) -> None:
        src = self.plan.sources[source]
        parser = self._parser(source)
        for split in src.splits:
            reader = self._reader(source, split, parser.bad)
            async for pos, block in reader.blocks():
                records = await self.run_cpu(parser.parse, reader, pos, block)
                docs = [((source, 0, off, n), payload) for off, n, payload in records]
                # tokenized too: images and conversations can be bad (and skipped) only there
                if docs and await self.run_tokenize(source, docs, reader.key, parser.bad, reader.where):
                    self._has_documents[source] = True
                    return
        filtered = sum(parser.bad.filtered_by_epoch.values())
        what = (f"all {parser.skipped} of its records are bad and skipped (on_bad_record = \"skip\"); the first: "
                f"{parser.bad.first}" if parser.skipped else
                f"its transforms' filters drop all {filtered} of its records" if filtered else
                "its shards hold nothing but blank lines")
        raise DataError(f"source {src.name!r} ({src.uri}) yields no document in a whole epoch of its "
                        f"{len(src.splits)} splits, so no batch could ever be made: {what}")

    def skipped(self) -> int:
        return sum(p.skipped for p in self.parsers)

    def record_counts(self) -> RecordCounts:
        """Bad records skipped and records filtered out so far (each once per epoch that read it)."""
        return RecordCounts(self.skipped_by_epoch(), {s: dict(p.bad.filtered_by_epoch)
                                                      for s, p in enumerate(self.parsers) if p.bad.filtered_by_epoch})

    def skipped_by_epoch(self) -> dict[int, int]:
        """Bad records skipped so far, by the epoch that read them (each once per epoch)."""
        out: collections.Counter[int] = collections.Counter()
        for p in self.parsers:
            out.update(p.bad.by_epoch)
        return dict(sorted(out.items()))

    async def run_tokenize(self, source: int, docs: list[Doc], key: str, bad: Any = None,
                           where: Callable[[int], str] | None = None) -> list[Doc]:
        """`tokenize` on a CPU thread: an image source's on the decode threads."""
        cpu = self.decode_cpu if self.images[source] else self.run_cpu
        return await cpu(self.tokenize, source, docs, key, bad, where)

    def decode(self, source: int, position: int, reader: Any, pos: int, block: bytes) -> list[Doc]:
        records = self.parsers[source].parse(reader, pos, block)
        return [((source, position, off, n), text) for off, n, text in records]

    def decode_before(self, source: int, position: int, reader: Any, pos: int, block: bytes,
                      error: DataError) -> list[Doc]:
        """The documents of `block` before its bad record, the one `decode` raised `error` for: the
        block's part before the error's offset (bytes, or a table's rows), decoded again. So the
        documents that go out before the error do not depend on where the block starts (the read
        sizes; a resumed run's first block starts at its cursor). None where the error has no
        offset in the block. What the first decode counted (records skipped, filtered) is not
        counted again: the reader's policy here is one of its own, of the same epoch (transforms'
        per-record seeds depend on it)."""
        if error.offset < 0:
            return []
        parser = self.parsers[source]
        n = (parser.record_offset(reader, error) if hasattr(parser, "record_offset") else error.offset) - pos
        table = hasattr(block, "num_rows")  # Parquet: a table of rows; else bytes
        if not 0 < n <= (block.num_rows if table else len(block)):
            return []
        again = copy.copy(reader)
        again.bad = BadRecords("skip").at(getattr(reader.bad, "epoch", 0))
        try:
            return self.decode(source, position, again, pos, block.slice(0, n) if table else block[:n])
        except DataError:
            return []

    def tokenize(self, source: int, docs: list[Doc], key: str, bad: Any = None,
                 where: Callable[[int], str] | None = None) -> list[Doc]:
        """Tokenize documents of `source` read from shard `key` (images: decode, resize and tokenize;
        conversations: render with the chat template and mark the trained tokens; a bad image or
        conversation is raised, or skipped and counted by `bad`, the reader's policy, and named at
        `where(offset)`, the reader's words for a document's place in the shard)."""
        if self.images[source]:
            assert self.vision is not None
            return self.vision(docs, bad or self.parsers[source].bad, key, where)
        if (chat := self.chats[source]) is not None:  # conversations: rendered, tokenized, trained tokens marked
            out = chat(docs, bad or self.parsers[source].bad, key, where)
        else:
            out = [(ref, ids) for (ref, _), ids in zip(docs, self.tokenizer([t for _, t in docs]))]
        if self.vision is not None:  # beside images: a text that holds the image token's text is a bad record
            out = self.vision.clean(out, bad or self.parsers[source].bad, key, where)
        return out


class _HandedOut(Exception):
    """A document that the producer was handing out is bad (`error`): raised past the handler that
    hands out the documents read before a bad record, since those come after this one."""

    def __init__(self, error: DataError) -> None:
        super().__init__(str(error))
        self.error = error


def _packer(cfg: Config, pad: int, upstream: Operator[Doc]) -> Operator[Sample]:
    """The lane's last operator, as `packing` says: concat, best_fit (a window) or none (one document each)."""
    if cfg.packing == "best_fit":
        return BestFitPack(cfg.seq_len, pad, cfg.mask_cross_document_labels, cfg.packing_window, upstream)
    if cfg.packing == "none":
        return SinglePack(cfg.seq_len, pad, cfg.truncate, upstream)
    return Pack(cfg.seq_len, pad, cfg.mask_cross_document_labels, upstream)


class TextLane:
    """One lane, a composition of operators: its output depends only on (config, seed, lane id, data).

    `sources` (one `Feed` per source) -> `Mix` -> `Shuffle` -> `Pack`; with `shuffle_scope =
    "source"`, `sources` -> one `Shuffle` per source -> `Mix` -> `Pack`, so that what Mix draws is
    what Pack packs next and a weight change shows in the next samples, not after the lane's
    window has drained (the lane `Shuffle` is then off). The lane state nests their
    states (`LaneState`), taken together right after each sample. Before making its sample `k`
    the lane tells Mix the global step of that sample, `(k * lanes + lane) // global_batch_size`,
    so the config's schedule (with `Loader.set_weights` decisions merged in) applies by step.
    """

    def __init__(self, shared: Lanes, lane: int, state: LaneState | None = None) -> None:
        self.shared, self.lane = shared, lane
        cfg = shared.config
        n = len(shared.plan.sources)
        self.state_in = state or LaneState.initial(lane, n)
        self.sources = [Feed(functools.partial(self._read_source, s), shared.buffer(s), cfg.piece_tokens)
                        for s in range(n)]
        by_source = cfg.shuffle_scope == "source" and cfg.shuffle_window > 0
        self.source_shuffles = [Shuffle(cfg.shuffle_window, mix64(cfg.seed, _SOURCE_SHUFFLE, s), lane, feed)
                                for s, feed in enumerate(self.sources)] if by_source else []
        self.mix = Mix(Schedule(cfg.weights_by_step()), cfg.seed, lane, cfg.mix == "tokens",
                       self.source_shuffles or self.sources)
        self.shuffle = Shuffle(0 if by_source else cfg.shuffle_window, cfg.seed, lane, self.mix)
        pad = shared.tokenizer.eos_id if cfg.pad_token_id is None else cfg.pad_token_id
        self.pack = _packer(cfg, pad, self.shuffle)

    def __repr__(self) -> str:
        return f"TextLane({self.lane})"

    async def run(self, out: anyio.abc.ObjectSendStream[list[Sample]]) -> None:
        """Produce samples into `out` until the data ends, in batches of `sample_batch` samples or
        of `HANDOFF_BYTES`, whichever is reached first: a batch amortizes a hand-off's fixed cost
        over small (text) samples, while a sample with images (megabytes) goes at once, instead of
        waiting, complete, for the lane's next ones (seconds each) while the sequencer waits for it."""
        cfg, st, gate = self.shared.config, self.state_in, self.shared.first_step
        gate.enter(self.lane)
        stack = AsyncExitStack()
        stack.callback(gate.leave, self.lane)  # also when it ends or fails before its first step
        async with out, stack, anyio.create_task_group() as tg:
            index, batch, held, first = st.samples, [], 0, self._first_handoff(st.samples)
            try:
                await self._restore(st)  # before read-ahead starts, so the two do not compete for CPU
                for feed in self.sources:
                    stack.enter_context(feed.start(tg.start_soon))
                while not st.done:
                    self.mix.enter((index * cfg.lanes + self.lane) // cfg.global_batch_size)  # the sample's step
                    sample = await self.pack.next()
                    if sample is None:
                        break
                    sample.lane, sample.index = self.lane, index
                    index += 1
                    sample.state = self._snapshot(index)
                    batch.append(sample)
                    held += sample.nbytes
                    if len(batch) == cfg.sample_batch or held >= HANDOFF_BYTES or index == first:
                        await out.send(batch)
                        batch, held = [], 0
                        if index == first:
                            await gate.passed(self.lane)
            except DataError as exc:  # raised where the order reaches this sample, not now (see `_read_source`)
                batch.append(LaneFailure(exc.with_traceback(None), self.lane, index))
            if batch:
                await out.send(batch)
            tg.cancel_scope.cancel()

    def _first_handoff(self, start: int) -> int:
        """The index after the lane's samples in the step of its sample `start`: the first batch
        is handed off there, so the first global batch waits for those only, not `sample_batch`."""
        cfg = self.shared.config
        step = (start * cfg.lanes + self.lane) // cfg.global_batch_size
        end = start + 1
        while (end * cfg.lanes + self.lane) // cfg.global_batch_size == step:
            end += 1
        return end

    def _operators(self, st: LaneState) -> list[tuple[str, Operator[Any], Any]]:
        """(field, operator, its state in `st`) for every operator of the lane, upstream first."""
        feeds = [(f"sources[{s}]", feed, st.sources[s]) for s, feed in enumerate(self.sources)]
        windows = [(f"shuffles[{s}]", op, st.shuffles[s] if st.shuffles else ShuffleState([], 0))
                   for s, op in enumerate(self.source_shuffles)]
        return feeds + windows + [("mix", self.mix, st.mix), ("shuffle", self.shuffle, st.shuffle),
                                  ("pack", self.pack, st.pack)]

    def _snapshot(self, samples: int) -> LaneState:
        return LaneState(self.lane, samples, False, [f.state() for f in self.sources], self.mix.state(),
                         self.shuffle.state(), self.pack.state(), [op.state() for op in self.source_shuffles])

    async def _restore(self, st: LaneState) -> None:
        """Set every operator back to `st`. The documents it refers to are read again and
        tokenized: the packer's now, the shuffle windows' when a pull takes them (`loader.reread`),
        so the first sample waits only for the documents its pulls take."""
        ops = self._operators(st)
        windows = [self.shuffle, *self.source_shuffles]
        whole = [tuple(r) for _, op, state in ops if op not in windows for r in op.refs(state)]
        drawn = interleave([[tuple(r) for r in op.refs(state)] for _, op, state in ops if op in windows])
        refs = list(dict.fromkeys(whole + drawn))
        lean = self.shared.first_step.pending
        docs = Reread({}, self._tokenize_again, self.shared.batch_size, self._refused, unread=refs,
                      read=Documents(self.shared, self.lane, refs, self._refused).read, lean=lean)
        for source, feed in enumerate(self.sources):  # started after this: see `FirstStep.pending`
            if not self.shared.images[source]:  # an image a decode call cost the image bench 8-12% of its images/s
                feed.lean(lean)
        await docs.load(whole)
        for field, op, state in ops:
            try:
                op.restore(state, docs.later if op in windows else docs.now)
            except IncompatibleState as exc:
                name = field if field.startswith(("sources", "shuffles")) else ""
                raise self._refused(f"{name} {exc}".strip()) from None

    def _refused(self, detail: str) -> IncompatibleState:
        return IncompatibleState(f"lane {self.lane} state field {detail}; this state was not written by a run of "
                                 "this config over this data (edited or damaged?): resume from the checkpoint as "
                                 "saved, or start fresh")

    async def _tokenize_again(self, source: int, docs: list[Doc]) -> list[Doc]:
        """Tokenize documents a checkpoint refers to (their bad records were counted by the first run);
        a piece's reference gives that piece of its document."""
        whole = await self.shared.run_tokenize(source, docs, "a checkpoint's documents",
                                               BadRecords(self.shared.config.on_bad_record))
        try:
            return [(ref, piece_of(ref, tokens, self.shared.config.piece_tokens) if len(ref) == 5 else tokens)
                    for ref, tokens in whole]
        except IncompatibleState as exc:
            raise self._refused(f"of a document of source {source}: {exc}") from None

    async def _read_source(self, source: int, position: int, offset: int, piece: int, send: FeedSender) -> None:
        """The producer of `sources[source]`: read, decode and tokenize from the cursor on
        (`piece`: tokens of the document at the cursor already handed out, see `operators.feed.cut`).

        A tokenizer call takes what `send.room` allows (the read-ahead grows with what the lane
        takes, see `operators.feed`), so the lane's first documents come after a short call. While
        the read-ahead would take more documents than the blocks decoded so far hold, the next
        block of the split is decoded first: a call takes up to a whole `tokenize_batch` of the
        split, not only what one block (a zstd frame: about 35 documents) holds.

        A DataError (a bad record in error mode, a source with no document) ends the feed in band
        (`FeedSender.fail`), after every document before the bad record: the lane raises it when it
        takes the document after those, and hands it to the sequencer in place of that sample
        (`LaneFailure`). So the error comes at a place in the order, whatever the read-ahead's and
        the tokenizer calls' sizes or the lanes' speeds (raised at once, the first lane to meet its
        bad record stopped the run, and two identical runs could name different records)."""
        src = self.shared.plan.sources[source]
        async with send:
            try:
                with in_source(src.name, src.uri):
                    await self._read_from(source, position, offset, piece, send)
            except DataError as exc:
                await send.fail(exc.with_traceback(None))  # held until raised: not the producer's locals
            except _HandedOut as out:
                await send.fail(out.error.of_source(src.name, src.uri).with_traceback(None))

    async def _read_from(self, source: int, position: int, offset: int, piece: int, send: FeedSender) -> None:
        shared = self.shared
        first = (position, offset) if piece else None  # the document the cursor is inside
        empty = 0  # positions in a row that gave no document
        while (reader := shared.reader(source, self.lane, position)) is not None:
            found = False
            pending: list[Doc] = []  # decoded, not tokenized yet
            try:
                try:
                    async for pos, block in reader.blocks(offset):
                        try:
                            pending += await shared.run_cpu(shared.decode, source, position, reader, pos, block)
                        except DataError as exc:  # the block's records before the bad one still go out
                            pending += await shared.run_cpu(shared.decode_before, source, position, reader, pos,
                                                            block, exc)
                            raise
                        more, first = await self._hand_out(source, reader, pending, send, False, first, piece)
                        found = found or more
                except DataError:  # a bad record or frame read: what was read before it goes out first
                    await self._hand_out(source, reader, pending, send, True, first, piece)
                    raise  # (a bad document among those is raised instead, as `_HandedOut`: it comes first)
                more, first = await self._hand_out(source, reader, pending, send, True, first, piece)
                found = found or more
            except IncompatibleState as exc:  # the cursor is not a record start, or not a piece start
                raise self._refused(f"sources[{source}] = {(position, offset, piece)}: {exc}") from None
            empty = 0 if found else empty + 1
            if empty >= min(_EMPTY_RUN, len(shared.plan.sources[source].splits)):
                await shared.check_source(source)
            position, offset = position + 1, 0
        if empty:  # the last epoch (max_epochs) ended this lane's share in a run shorter than _EMPTY_RUN
            await shared.check_source(source)

    async def _hand_out(self, source: int, reader: SplitReader, pending: list[Doc], send: FeedSender, final: bool,
                        first: tuple[int, int] | None, piece: int) -> tuple[bool, tuple[int, int] | None]:
        """Tokenize `pending` (taking the documents out) and send them, in calls of what the feed's
        room allows, while a call is worth making now: always when `final` (the split's last
        block), else while the room would not take more than `pending` holds. Returns whether any
        document came out, and `first` (None once the document at the cursor has been cut)."""
        shared, found = self.shared, False
        pieces, batch = shared.config.piece_tokens, shared.batch_size(source)
        while pending and (final or len(pending) >= batch or send.room_now(batch) <= len(pending)):
            size = await send.room(min(batch, len(pending)))
            docs = pending[:size]
            del pending[:size]
            tokens, failed = await self._tokenized(source, reader, docs)
            if failed is not None and not tokens:
                raise _HandedOut(failed)
            found = found or bool(tokens)  # a bad image or conversation skipped is no document
            if first is not None and (not tokens or tuple(tokens[0][0][1:3]) != first):
                refuse("piece", piece, "no document starts at the cursor to take pieces from")
            if pieces:
                tokens, first = cut(tokens, pieces, piece if first else 0), None
            await send.send(tokens)
            if failed is not None:
                raise _HandedOut(failed)
        return found, first

    async def _tokenized(self, source: int, reader: SplitReader, docs: list[Doc]) -> tuple[list[Doc], DataError | None]:
        """`docs` tokenized, and None; or, where the call raised a DataError (in error mode: a bad
        image or conversation), the documents before the bad one and its error: tokenized again one
        at a time, so that what goes out before the error does not depend on the call's size."""
        run = self.shared.run_tokenize
        try:
            return await run(source, docs, reader.key, reader.bad, reader.where), None
        except DataError as exc:
            if reader.bad.skipping or len(docs) == 1:  # skipping, bad records do not raise: not theirs
                return [], exc
            error = exc
        good: list[Doc] = []
        for doc in docs:
            try:
                good += await run(source, [doc], reader.key, reader.bad, reader.where)
            except DataError as exc:
                return good, exc
        return good, error  # each alone passed: the call's own error, after all of them
