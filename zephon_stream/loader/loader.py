"""The loader: plans the data, runs this rank's lanes on a backend, and sequences batches."""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import gc
import logging
import multiprocessing.util  # noqa: F401  (registers its exit handler before ours: see `_close_open_iterations`)
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec

from zephon_stream.connectors.base import Store, StoreStatistics
from zephon_stream.engine import threads
from zephon_stream.engine.memory import managed_memory
from zephon_stream.engine.signals import ctrl_c_after
from zephon_stream.errors import CheckpointError, ConfigError, IncompatibleState, ZephonError, unwrap_groups
from zephon_stream.loader.backends import run_lanes, start_fork_server
from zephon_stream.loader.config import Config, ScheduleEntry
from zephon_stream.loader.plan import DataPlan, SourceData, old_split_digest, open_stores, plan_data
from zephon_stream.loader.relaunch import LaneRuns
from zephon_stream.loader.sequencer import check_world, consumed, rank_lanes, rank_slots
from zephon_stream.loader.state import FORMAT_VERSION, LaneState, LoaderState, StateHeader, check_lane_state
from zephon_stream.operators.collate import collate, padding_sample
from zephon_stream.operators.mix import Schedule
from zephon_stream.operators.read import RecordCounts
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.transforms import Transform, check_transforms, with_transforms
from zephon_stream.operators.types import LaneFailure, Sample

__all__ = ["BatchStream", "Frontier", "Loader", "LoaderStatistics"]

StoreWrapper = Callable[[Store], Store]


log = logging.getLogger("zephon_stream.loader")

class LoaderStatistics(msgspec.Struct, frozen=True):
    """A snapshot of the loader's progress and buffers (see `Loader.statistics()`)."""

    step: int  # the global position: restored with a state (`load_state_dict`)
    # samples and real tokens this Loader object handed out (like source_tokens and source_shares: they
    # start at 0 in a resumed run; add up the runs', or `--digests`' lines, for a whole training run)
    samples: int
    tokens: int
    # bad records skipped (on_bad_record = "skip"), each once per epoch that read it. Counted as the lanes
    # read, read-ahead included: mid-epoch it runs ahead of the batches handed out, by an amount that depends
    # on the backend and buffer sizes; once every lane has read an epoch whole it is exact
    skipped_records: int
    skipped_by_epoch: dict[int, int]  # the same, by the epoch whose split held them
    skipped_shards: int
    buffered_batches: int  # sample batches waiting in lane buffers now
    peak_buffered_batches: int
    buffer_capacity: int  # sample_buffer x lanes of this rank (the peak may exceed it by one batch in hand)
    store_requests: int
    store_retries: int
    store_bytes_read: int
    source_tokens: dict[str, int] = {}  # real tokens of each source in the batches this loader handed out
    source_shares: dict[str, float] = {}  # the same as shares of their sum: the realized mix
    weights: dict[str, float] = {}  # the weights in force at the next step (schedule and set_weights)
    worker_restarts: int = 0  # lane workers (processes, Ray actors) that died and were started again
    # records each source with transforms had its filters drop, each once per epoch that read it (counted
    # as the lanes read, read-ahead included, as skipped_records)
    filtered_records: dict[str, int] = {}
    filtered_by_epoch: dict[int, int] = {}  # the same, all sources, by the epoch whose split held them
    # packing = "none" with truncate: documents cut at seq_len in the samples this rank's lanes handed
    # out since the run began (counted in the lane states, so resumes keep them), and their tokens dropped
    truncated_documents: int = 0
    truncated_tokens: int = 0
    # bytes of the samples between the lanes and the sequencer, pixels included: the batches in the
    # lane buffers (or waiting for room in them) and the samples the sequencer holds
    buffered_bytes: int = 0


#: Steps back that `Loader.state_dict(step=...)` can still give: more than a trainer prefetches.
HISTORY = 16


class Frontier:
    """The consumed frontier of one rank: the step, each lane's state after its last consumed
    sample, and counters. `Loader.state_dict()` is this; a `BatchStream` advances it.

    It also remembers the lane states of the last `HISTORY` steps (references to immutable
    states: a few KB), for trainers that fetch batches ahead of the one they train on.
    """

    def __init__(self, lanes: list[int], n_sources: int) -> None:
        # (step, lane states) in one attribute: a batch is consumed by one assignment, so a reader in
        # this thread (a signal handler's state_dict) sees the batch wholly or not at all
        self.position: tuple[int, dict[int, LaneState]] = (0, {lane: LaneState.initial(lane, n_sources)
                                                               for lane in lanes})
        self.samples = self.tokens = 0
        self.source_tokens = [0] * n_sources  # real tokens consumed per source (realized shares)
        self.peak_buffered = 0  # sample batches held at once, lane buffers and the batch in hand
        self.history: collections.deque[tuple[int, dict[int, LaneState]]] = collections.deque(maxlen=HISTORY)
        # held while a batch is consumed and while set_weights decides a step: a call from another
        # thread or task then either comes first (the batch is made again) or is refused (too late).
        # Reentrant: a signal handler that saves the state in the thread consuming a batch must not hang
        self.deciding = threading.RLock()

    @property
    def step(self) -> int:
        return self.position[0]

    @step.setter
    def step(self, step: int) -> None:
        self.position = (step, self.position[1])

    @property
    def lanes(self) -> dict[int, LaneState]:
        return self.position[1]

    @lanes.setter
    def lanes(self, lanes: dict[int, LaneState]) -> None:
        self.position = (self.position[0], lanes)

    def commit(self, samples: list[Sample]) -> None:
        """Consume one global batch: count it and remember the lane states there."""
        if not self.history:  # the step the stream started from too: a trainer that fetched ahead may save it
            self.history.append((self.step, dict(self.lanes)))
        lanes = dict(self.lanes)
        for sample in samples:
            self.consume(lanes, sample)
        self.position = (self.step + 1, lanes)
        self.history.append((self.step, dict(lanes)))

    def lanes_at(self, step: int) -> dict[int, LaneState]:
        """The lane states once `step` global batches were consumed (the current step or a recent one)."""
        if step == self.step:
            return self.lanes
        for seen, lanes in self.history:
            if seen == step:
                return lanes
        recent = [seen for seen, _ in self.history if seen < self.step] or [self.step]
        raise CheckpointError(f"state_dict(step={step}): this rank is at step {self.step} and remembers steps "
                              f"{recent[0]}..{self.step} only; ask for a step in that range (the step after the "
                              "batch you trained on last: batch[\"step\"] + 1)")

    def consume(self, lanes: dict[int, LaneState], sample: Sample) -> None:
        """Advance `lanes` past `sample` and count it; a padding sample (no state) means its lane has ended."""
        if sample.state is not None:
            lanes[sample.lane] = sample.state
        elif not lanes[sample.lane].done:
            lanes[sample.lane] = msgspec.structs.replace(lanes[sample.lane], done=True)
        self.samples += 1
        self.tokens += sample.num_tokens
        for n, source in zip(sample.segments, sample.sources):
            self.source_tokens[source] += n

    def end(self, lane: int) -> None:
        if not self.lanes[lane].done:
            self.lanes[lane] = msgspec.structs.replace(self.lanes[lane], done=True)


#: Why local shards of the same count and size can differ from a checkpoint's (LocalStore: a file's ETag is
#: its modification time and size; S3's is a hash of the content, so the same bytes on another store differ too).
_SAME_SIZE_LOCAL = ("a local file's ETag is its modification time and size, so a copy that did not keep the "
                    "times, such as `cp -r` without -p, reads as rewritten (copy the files again with `cp -rp` or "
                    "`rsync -a`), and so does the same data moved between S3 and a local folder, whose ETags differ")


class Loader:
    """A deterministic, resumable stream of packed token batches for one data-parallel rank.

    ```
    loader = Loader.from_toml("stream.toml")           # dp_rank/dp_size from torch.distributed
    for batch in loader:                                # or: async with loader.open() as s: async for ...
        loss = model(batch["input_ids"], labels=batch["labels"])
        if loader.step % 100 == 0:                      # loader.step == batch["step"] + 1 here
            torch.save({"loader": loader.state_dict(), ...}, path)
    ```
    The sample at every global slot is a pure function of (config, seed, data): it does not
    depend on dp_size, backend, buffer sizes or resume points.

    Steps: `batch["step"]` is the global step of a batch (0 for the first); `loader.step` counts
    the global batches consumed, so right after receiving a batch `loader.step == batch["step"] + 1`,
    and `state_dict()` then resumes with the next batch. A trainer that fetches ahead of the batch
    it trains on (Lightning prefetches one) saves `state_dict(step=batch["step"] + 1)` of the
    batch it trained on last.

    torch: a Loader is a torch `IterableDataset` (it already batches): `DataLoader(loader,
    batch_size=None)` iterates it, with `num_workers=0` (the loader runs its own workers:
    `backend = "processes"`). It is Stateful (`state_dict`/`load_state_dict`), for
    `torch.distributed.checkpoint` and StatefulDataLoader-style trainers.

    `close()` (or `with Loader(...) as loader:`) stops its streams for good; see there.
    """

    def __init__(self, config: Config, *, dp_rank: int | None = None, dp_size: int | None = None,
                 dp_group: Any = None, device_mesh: Any = None, mesh_dim: str = "dp",
                 backend: str | None = None, wrap_store: StoreWrapper | None = None,
                 transforms: Mapping[str, Sequence[Transform]] | None = None) -> None:
        """`dp_rank`/`dp_size` come, in order of precedence, from the arguments, from `dp_group`
        (a torch.distributed process group), from `device_mesh[mesh_dim]`, or from the default
        process group when torch.distributed is initialized; else rank 0 of 1. Ranks that share a
        DP rank (tensor/pipeline/context-parallel peers) receive identical batches.

        `transforms` ({source name: [Map(fn), Filter(fn)]}) appends steps to those sources'
        `transforms`, as their import paths (`zephon_stream.operators.transforms`)."""
        config = with_transforms(config, transforms)
        if any("://" not in s.uri for s in config.sources):  # plain paths, from Python: from the working directory
            config = config.replace(sources=config.with_paths_from(Path.cwd()).sources)
        if dp_size is None:
            dp_rank, dp_size = _dist_rank_size(dp_group, device_mesh, mesh_dim) if dp_rank is None else (dp_rank, 1)
        self.config = config.replace(backend=backend) if backend else config
        self.dp_rank, self.dp_size = dp_rank or 0, dp_size
        check_transforms(self.config)  # every path imports here, before a worker starts
        check_world(config.lanes, config.global_batch_size, self.dp_size, self.dp_rank)
        self.tokenizer = _tokenizer(config)
        import torch  # noqa: F401  (loaded here, not on the event loop at the first batch)
        order = config.order_settings(self.tokenizer.sha256)
        self.order_settings = msgspec.msgpack.decode(msgspec.msgpack.encode(order))  # as a checkpoint holds it
        self.order_digest = config.order_digest(self.tokenizer.sha256)
        self.lanes = rank_lanes(config.lanes, self.dp_size, self.dp_rank)
        self.wrap_store = wrap_store
        self.frontier = Frontier(self.lanes, len(config.sources))
        self.decisions: list[ScheduleEntry] = []  # the set_weights log, in call order (see set_weights)
        self._fingerprint: str | None = None  # of the loaded checkpoint, checked against the data
        self._data_sources: dict[str, SourceData] = {}  # its sources' part of it, to name what changed
        self._plan: DataPlan | None = None
        self._streams: dict[int, Any] = {}
        self._store_stats: list[Any] = []
        self._skipped: Callable[[], RecordCounts] = RecordCounts
        self._worker_stores: Callable[[], StoreStatistics] = StoreStatistics
        self._restarts: Callable[[], int] = lambda: 0  # of the lanes' current run
        self._restarts_before = 0
        self._opened = 0  # streams open now (an `open()` block, a `for` loop in progress)
        self._batch_streams: set[BatchStream] = set()
        self._iterators: weakref.WeakSet[_Iteration] = weakref.WeakSet()
        self._closed = False
        _register_iterable_dataset()

    @classmethod
    def from_toml(cls, path: str | Path, **kwargs: Any) -> Loader:
        """`Loader(Config.from_toml(path), **kwargs)`: the loader of a TOML config file."""
        return cls(Config.from_toml(path), **kwargs)

    def __repr__(self) -> str:
        return (f"Loader(lanes={self.config.lanes}, dp_rank={self.dp_rank}, dp_size={self.dp_size}, "
                f"backend={self.config.backend!r}, step={self.step})")

    # ---- checkpoint -------------------------------------------------------------------------

    def state_dict(self, step: int | None = None) -> dict[str, bytes]:
        """The consumed frontier of this rank: `{"meta": ..., "lane_0003": ..., ...}` (torch Stateful).

        One entry per lane this rank owns; save every rank's dict (with torch.distributed.checkpoint,
        or `state_to_bytes` per rank) and any world size that divides `lanes` can load them.

        `step` (default: `self.step`) asks for the state once `step` global batches were consumed,
        one of the last `HISTORY` steps: a trainer that fetched batches ahead of the one it trained
        on saves `state_dict(step=batch["step"] + 1)` of that batch.
        """
        with self.frontier.deciding:  # the step and the log as one
            at = self.step if step is None else step
            lanes = self.frontier.lanes_at(at)
            decisions = list(self.decisions)
        data = (self._fingerprint, self._data_sources) if self._fingerprint else (
            (self._plan.fingerprint, self._plan.by_source) if self._plan else ("", {}))
        header = StateHeader(FORMAT_VERSION, self.order_digest, data[0], self.config.lanes,
                             self.config.global_batch_size, at, self.order_settings, decisions, data[1])
        return LoaderState(header, [lanes[lane] for lane in self.lanes]).to_dict()

    def load_state_dict(self, state_dict: dict[str, bytes] | list[dict[str, bytes]]) -> None:
        """Load one rank's state, or several ranks' states (a list) that together hold our lanes.

        Only while no stream of this loader is open: load first, then iterate (or load into a new
        Loader). The next batch is then the one after the saved step.
        """
        if self._still_open():
            raise CheckpointError("load_state_dict() while a stream of this loader is open (a `for batch in "
                                  "loader` loop or an `open()` block): leave it first (break, or close the "
                                  "iterator), or load the state into a new Loader")
        parts = state_dict if isinstance(state_dict, list) else [state_dict]
        decoded = [LoaderState.from_dict(p) for p in parts]
        if not decoded:
            raise CheckpointError("load_state_dict got an empty list: pass every rank's state_dict()")
        first = max(decoded, key=lambda st: st.header.step)
        for st in decoded:
            self._check_compatible(st, first)
        lanes = self._merge_lanes(decoded)
        missing = [lane for lane in self.lanes if lane not in lanes]
        if missing:
            raise CheckpointError(f"checkpoint holds lanes {sorted(lanes)} but rank {self.dp_rank}/{self.dp_size} "
                                  f"needs lanes {missing} too: pass every rank's state")
        head = first.header
        slots = head.step * head.global_batch_size
        for lane in self.lanes:
            expect = consumed(lane, head.lanes, slots)
            if lanes[lane].samples > expect or (lanes[lane].samples < expect and not lanes[lane].done):
                raise IncompatibleState(f"lane {lane} state field samples = {lanes[lane].samples}: step "
                                        f"{head.step} means {expect} (the lane has not ended); the checkpoint is "
                                        "inconsistent: resume from the files of one checkpoint, as saved")
        self.decisions = self._merge_decisions(decoded)
        self.frontier.step = head.step
        self._fingerprint, self._data_sources = head.data_fingerprint, head.data_sources
        self.frontier.lanes = {lane: lanes[lane] for lane in self.lanes}
        self.frontier.history.clear()

    def _merge_decisions(self, decoded: list[LoaderState]) -> list[ScheduleEntry]:
        """The set_weights log of the checkpoint: every part holds all of it, checked against the config."""
        logs = {msgspec.json.encode(st.header.decisions) for st in decoded}
        if len(logs) > 1:
            raise IncompatibleState("rank states hold different set_weights logs (meta field decisions): pass the "
                                    "files of one checkpoint")
        decisions = list(decoded[0].header.decisions)
        try:
            self.config.with_decisions(decisions).weights_by_step()
        except ConfigError as exc:
            raise IncompatibleState(f"checkpoint meta field decisions (the set_weights log): {exc}; the checkpoint "
                                    "was written for other sources, or edited: resume under its config") from None
        if any(d.step < 0 for d in decisions):
            raise IncompatibleState(f"checkpoint meta field decisions holds a negative step: {decisions}")
        return decisions

    # ---- dynamic mixing -----------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, float], at_step: int) -> None:
        """Mix the sources by `weights` (name -> relative weight > 0, every source) from global step
        `at_step` on: the documents drawn for the samples of step `at_step` on use them (until a
        later schedule entry or decision). Every rank makes the same call.

        Batches before `at_step` are unchanged. Before an open stream's next batch, its lanes go back
        to their state at `at_step` (the state after their last sample of an earlier step; samples
        already made for earlier steps are kept) and run on from there with the new weights; with
        the processes backend that starts the worker processes again.
        The call is logged: the log (one entry per call that changed it) is part of every rank's
        `state_dict()`, so a resumed run, on any dp size, continues the same without repeating the
        calls. Repeating a logged decision does nothing; a step this rank has already consumed
        (`at_step < loader.step`) is refused.

        It may be called from another thread or asyncio task while a batch is being made: a call
        for that batch's step (or an earlier one not yet consumed) has it made again with the new
        weights before it is handed out.
        """
        entry = self._decision(weights, at_step)
        with self.frontier.deciding:  # against a batch consumed meanwhile in another thread or task
            if [d for d in self.decisions if d.step == at_step][-1:] == [entry]:
                return
            if at_step < self.step:
                raise ConfigError(f"set_weights(at_step={at_step}): step {at_step} was already consumed (this rank "
                                  f"has handed out batches 0..{self.step - 1}); decide for a step >= {self.step}, the "
                                  "next batch's")
            self.decisions.append(entry)
            for stream in list(self._batch_streams):
                # before its next batch, its lanes go back to their state at the earliest step decided
                stream.rewind = at_step if stream.rewind is None else min(stream.rewind, at_step)

    def _decision(self, weights: Mapping[str, float], at_step: int) -> ScheduleEntry:
        """The log entry of `set_weights(weights, at_step)`, checked (ConfigError if bad)."""
        if isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0:
            raise ConfigError(f"set_weights at_step = {at_step!r}: must be a global step, an int >= 0")
        entry = ScheduleEntry(at_step, dict(weights))
        self.config.check_weights(entry.weights, f"set_weights(at_step={at_step}) weights")
        return entry

    def lane_config(self) -> Config:
        """The config the lanes run: this loader's, with the set_weights log merged into its schedule."""
        with self.frontier.deciding:
            decisions = list(self.decisions)
        return self.config.with_decisions(decisions) if decisions else self.config

    def _merge_lanes(self, decoded: list[LoaderState]) -> dict[int, LaneState]:
        """The lane states of every part, each checked against the config; a lane given twice must agree."""
        lanes: dict[int, LaneState] = {}
        for ls in (ls for st in decoded for ls in st.lane_states):
            check_lane_state(ls, self.config)
            if lanes.setdefault(ls.lane, ls) != ls:
                raise IncompatibleState(f"lane {ls.lane} has two different states in the files given: pass the "
                                        "files of one checkpoint, each once")
        return lanes

    def _check_compatible(self, st: LoaderState, first: LoaderState) -> None:
        cfg, head = self.config, st.header
        if head.order_digest != self.order_digest:
            ours, default = self.order_settings, Config.order_default  # a setting left out is at its default
            changed = [_sources_change(head.order[k], ours[k]) if k == "sources" and k in head.order and k in ours
                       else f"{k}: {head.order.get(k, default(k))!r} in the checkpoint, {ours.get(k, default(k))!r} now"
                       for k in sorted(set(head.order) | set(ours))
                       if head.order.get(k, default(k)) != ours.get(k, default(k))
                       and (k not in Config.ORDER_DEPENDENT or (k in head.order and k in ours))]
            what = "; ".join(changed) if head.order else (
                "seed, lanes, seq_len, sources, weights, tokenizer, shuffle_window, max_epochs, split_bytes or "
                "global_batch_size changed")
            raise IncompatibleState(
                f"checkpoint was written under another order config (digest {head.order_digest}, now "
                f"{self.order_digest}): {what}; restore them or start fresh")
        if (head.lanes, head.global_batch_size) != (cfg.lanes, cfg.global_batch_size):
            raise IncompatibleState(f"checkpoint has lanes={head.lanes} global_batch_size={head.global_batch_size}, "
                                    f"config has {cfg.lanes} and {cfg.global_batch_size}")
        if head.data_fingerprint != first.header.data_fingerprint:
            raise IncompatibleState("rank states were written for different data: pass the files of one checkpoint")
        if head.step != first.header.step and not all(ls.done for ls in st.lane_states):
            # a rank whose lanes all ended (max_epochs) stops early; any other must be at the same step
            raise IncompatibleState(f"rank states disagree: step {head.step} vs {first.header.step}; pass the "
                                    "states of one checkpoint")

    @property
    def data_plan(self) -> DataPlan | None:
        """The sources' shards and splits, once the first stream has listed them (else None)."""
        return self._plan

    @property
    def step(self) -> int:
        """Global batches this rank has consumed: the next batch's `batch["step"]`.

        Inside `for batch in loader:` it is already `batch["step"] + 1`. `state_dict()` saves this
        position; a run resumed from it continues with batch `step`.
        """
        return self.frontier.step

    def _data_change(self) -> str:
        """Which sources' shards changed since the checkpoint, as far as it says."""
        assert self._plan is not None
        was, now = self._data_sources, self._plan.by_source
        uris = {s.name: s.uri for s in self.config.sources}
        names = [name for name in now if name in was and was[name].digest != now[name].digest]
        same = [name for name in names if (was[name].shards, was[name].nbytes) == (now[name].shards, now[name].nbytes)]
        changed = [f"source {name!r} had {was[name].describe()}, now {now[name].describe()}"
                   + (" (a shard was replaced or rewritten: another key, size or ETag)" if name in same else "")
                   for name in names]
        if any(uris.get(name, "").startswith("file:") or "://" not in uris.get(name, "") for name in same):
            changed.append(_SAME_SIZE_LOCAL)  # once: it holds for every local source
        return "; ".join(changed) if changed else "shards were added, removed or rewritten"

    # ---- planning -----------------------------------------------------------------------------

    async def plan(self, stores: list[Store]) -> DataPlan:
        """List and split every source once; check the data against a loaded checkpoint."""
        if self._plan is None:
            self._plan = await plan_data(self.config, stores)
        if self._fingerprint and self._fingerprint != self._plan.fingerprint:
            was = self._data_sources
            resplit = [sp.name for sp in self._plan.sources
                       if sp.name in was and was[sp.name].digest == old_split_digest(sp)]
            if resplit and all(was.get(n) == d or n in resplit for n, d in self._plan.by_source.items()):
                names = ("sources " if len(resplit) > 1 else "source ") + ", ".join(map(repr, resplit))
                raise IncompatibleState(
                    f"checkpoint was written by an older zephon-stream, which cut {names} into other "
                    "splits: a shard there cannot be cut into its share of splits (too few or too uneven zstd "
                    "frames, gzip members or row groups), and the older version left the rest of that share to "
                    "no other shard (fewer splits than planned: lanes could read the same split); this version "
                    "gives it to the other shards, so it cannot continue that checkpoint's order: start fresh, "
                    "or finish the run with the version that wrote the checkpoint")
            raise IncompatibleState(
                f"checkpoint was written for other data (fingerprint {self._fingerprint}, the sources now give "
                f"{self._plan.fingerprint}): {self._data_change()}; resume against the same data or start fresh")
        for ls in self.frontier.lanes.values():  # the loaded (or reached) states, now against the data
            check_lane_state(ls, self.config, self._plan)
        return self._plan

    # ---- streaming ----------------------------------------------------------------------------

    @asynccontextmanager
    async def open(self) -> AsyncIterator[BatchStream]:
        """Start this rank's lanes; yield a stream of batches. Leaving the block stops them.

        One stream at a time: each continues from the last batch handed out, so a second one open
        beside it (another `for` loop, an `iter(loader)` not yet exhausted or closed) is refused.
        """
        self._check_usable()
        if self._still_open():
            raise ZephonError("this Loader has a stream open already (a `for batch in loader` loop, an iterator from "
                              "`iter(loader)` not exhausted or closed, or an `open()` block): each stream continues "
                              "from the last batch handed out, so only one may be open; leave the other first "
                              "(break, or close the iterator: `it.close()`), or stream from another Loader")
        if self.config.vision is not None:  # here too: the processes backend decodes in workers that may not have it
            from zephon_stream.vision.image import check_pillow_settings

            check_pillow_settings()
        self._opened += 1
        if self.config.backend == "processes":
            start_fork_server()
        try:
            with unwrap_groups():
                async with self._open() as stream:
                    yield stream
        finally:
            self._opened -= 1

    @asynccontextmanager
    async def _open(self) -> AsyncIterator[BatchStream]:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(managed_memory())  # RSS flat over a long run (ZEPHON_MALLOC)
            stores = await open_stores(self.config, stack, self.wrap_store)
            self._store_stats = stores
            plan = await self.plan(stores)
            states = {lane: self.frontier.lanes[lane] for lane in self.lanes}
            async with anyio.create_task_group() as tg:
                runs = LaneRuns(tg, lambda st: run_lanes(self.lane_config(), self.tokenizer, plan, stores, st,
                                                         self.wrap_store))

                async def launch(states: dict[int, LaneState]) -> tuple[Any, Any]:
                    streams, credit, skipped, worker_stores, restarts = await runs.restart(states)
                    self._streams, self._skipped, self._worker_stores = streams, skipped, worker_stores
                    self._restarts_before += self._restarts()  # a relaunch (set_weights) starts new counts
                    self._restarts = restarts
                    return streams, credit

                streams, credit = await launch(states)
                stream = BatchStream(self.frontier, streams, credit, self.config, self.dp_rank, self.dp_size,
                                     self.tokenizer.eos_id)
                stream.relaunch = launch
                self._batch_streams.add(stream)
                ended = anyio.Event()
                if self.config.stall_warning_s > 0:
                    tg.start_soon(_watch_stalls, stream, ended, self.config.stall_warning_s)
                try:
                    yield stream
                finally:
                    ended.set()
                    stream.forget()
                    self._batch_streams.discard(stream)
                    self._streams = {}
                    runs.stop()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches in step order, the pipeline run in a helper thread (torch IterableDataset semantics)."""
        return self._iteration(self._iterate())

    def _iteration(self, gen: Iterator[Any]) -> _Iteration:
        self._check_usable()
        _check_not_in_torch_worker()
        if self.config.backend == "processes":
            start_fork_server()  # from this thread (the helper thread cannot make it deaf to Ctrl-C)
        it = _Iteration(gen)
        self._iterators.add(it)
        _OPEN_ITERATIONS.add(it)
        return it

    def _iterate(self, deferred: bool = False) -> Iterator[Any]:
        """The batches, each consumed (`commit`) as it is yielded; with `deferred`, (batch, commit)
        pairs: the caller consumes each as it hands it out (an `async for` whose wait was cancelled
        after the batch was made holds it, and the state must not be past it)."""
        with ExitStack() as stack:
            # Ctrl-C held while the event-loop thread starts: anyio's portal, interrupted while it waited
            # for the loop, joined the thread with the loop left running (the process hung for good);
            # and one in the import of anyio.from_thread (its first use) came out as a RuntimeError
            with ctrl_c_after():
                portal = stack.enter_context(anyio.from_thread.start_blocking_portal())
            stack.push(_stop_sent_whole(portal))  # ... and while its stop is sent (before anyio's exit joins it)
            cm = portal.wrap_async_context_manager(self.open())
            stream = cm.__enter__()
            try:
                while True:
                    call = portal.start_task_soon(stream.next_batch)
                    try:
                        batch = call.result()
                    except StopAsyncIteration:
                        return
                    except BaseException:  # Ctrl-C while waiting: the batch is not consumed, so the
                        call.cancel()  # state (saved next, say) still names it as the next one
                        raise
                    if deferred:
                        yield batch, stream.commit
                    elif stream.commit():  # handed out: only now the rank's state moves past it
                        yield batch  # (else set_weights decided its step meanwhile: it is made again)
            finally:  # an early `break` closes the generator: stop the lanes without an error
                cm.__exit__(None, None, None)

    def __aiter__(self) -> _ThreadedAsyncIterator:
        """`async for` over a pipeline run in a helper thread; `open()` runs it on your loop instead."""
        return _ThreadedAsyncIterator(self._iteration(self._iterate(deferred=True)))

    # ---- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop this loader for good; calling it again does nothing.

        A `for batch in loader` loop that is paused between batches is closed now (its lanes and
        worker processes stop; a `next` that comes meanwhile, from the loop's own thread, waits for
        that and ends the loop); one waiting for a batch in another thread, and an `open()` stream,
        end at their next batch (`StopIteration` / `StopAsyncIteration`). The state stays readable:
        `state_dict()` after `close()` is the position of the last batch handed out. Iterating or
        opening a closed loader raises `ZephonError`.
        """
        self._closed = True
        for stream in list(self._batch_streams):
            stream.stop()
        for it in list(self._iterators):
            it.close_if_paused()  # one waiting for a batch (in another thread) stops at its next batch

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _still_open(self) -> bool:
        """Whether a stream of this loader is open. An iteration dropped inside a reference cycle
        stays open (its lanes running) until the garbage collector finds it: an `async for` cut by
        Ctrl-C is held so by its exception's traceback. Collected here, it closes, before a refusal."""
        if self._opened:
            gc.collect()
        return bool(self._opened)

    def _check_usable(self) -> None:
        if self._closed:
            raise ZephonError("this Loader is closed: create a new one (load_state_dict(state_dict()) of this one "
                              "continues where it stopped)")

    def statistics(self) -> LoaderStatistics:
        """Progress and buffers now. The store counters include the reads of worker processes."""
        buffered = sum(s.statistics().current_buffer_used for s in self._streams.values())
        stores = [s.statistics() for s in self._store_stats] + [self._worker_stores()]
        skipped_shards = sum(len(s.skipped_shards) for s in self._plan.sources) if self._plan else 0
        counts = self._skipped()
        skipped = counts.skipped
        return LoaderStatistics(
            step=self.step, samples=self.frontier.samples, tokens=self.frontier.tokens,
            skipped_records=sum(skipped.values()), skipped_by_epoch=skipped, skipped_shards=skipped_shards,
            buffered_batches=buffered, peak_buffered_batches=self.frontier.peak_buffered,
            buffer_capacity=self.config.sample_buffer * len(self.lanes),
            store_requests=sum(s.requests for s in stores), store_retries=sum(s.retries for s in stores),
            store_bytes_read=sum(s.bytes_read for s in stores), **self._mix_statistics(),
            worker_restarts=self._restarts_before + self._restarts(), **self._filtered(counts),
            truncated_documents=sum(ls.pack.truncated for ls in self.frontier.lanes.values()),
            truncated_tokens=sum(ls.pack.dropped for ls in self.frontier.lanes.values()),
            buffered_bytes=self._buffered_bytes())

    def _buffered_bytes(self) -> int:
        """The bytes of the samples in the lane buffers (a batch in one, or waiting for room in it)
        and in the sequencer's hands, pixels included. Counted here, when asked, from what the
        buffers hold, so that a hand-off costs nothing more: a wrapper that kept a running count
        on every hand-off cost 8% of the text loader's tokens per CPU-second."""
        # list() copies a deque or a dict's values without letting another thread in (the progress
        # thread calls statistics() while the loop moves samples)
        held = sum(s.nbytes for st in list(self._batch_streams) for q in list(st.pending.values())
                   for s in list(q))
        states = [recv._state for recv in list(self._streams.values())]  # anyio's memory stream state
        offered = [batch for st in states for batch in (*list(st.buffer), *list(st.waiting_senders.values()))]
        return held + sum(s.nbytes for batch in offered for s in batch)

    def _filtered(self, counts: RecordCounts) -> dict[str, Any]:
        by_epoch: collections.Counter[int] = collections.Counter()
        for epochs in counts.filtered.values():
            by_epoch.update(epochs)
        return {"filtered_records": {s.name: sum(counts.filtered.get(i, {}).values())
                                     for i, s in enumerate(self.config.sources) if s.transforms},
                "filtered_by_epoch": dict(sorted(by_epoch.items()))}

    def _mix_statistics(self) -> dict[str, Any]:
        names = [s.name for s in self.config.sources]
        tokens = dict(zip(names, self.frontier.source_tokens))
        total = sum(tokens.values())
        weights = Schedule(self.lane_config().weights_by_step())
        now = weights.at(weights.since(self.step)) or []
        return {"source_tokens": tokens, "source_shares": {k: v / total if total else 0.0 for k, v in tokens.items()},
                "weights": {k: w / sum(now) for k, w in zip(names, now)}}


class BatchStream:
    """Batches of one rank in step order; each consumed batch advances the rank's `Frontier`."""

    def __init__(self, frontier: Frontier, streams: dict[int, Any], credit: Callable[[int], None], config: Config,
                 dp_rank: int, dp_size: int, eos_id: int) -> None:
        self.frontier, self.streams, self.credit, self.config = frontier, streams, credit, config
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.pending: dict[int, collections.deque] = {lane: collections.deque() for lane in streams}
        self.done = {lane: frontier.lanes[lane].done for lane in streams}
        self.pad_id = eos_id if config.pad_token_id is None else config.pad_token_id
        self.stopped = False
        self.rewind: int | None = None  # set_weights was called for this step: lanes go back to their state there
        self.relaunch: Callable[[dict[int, LaneState]], Any] | None = None
        self.taken: list[Sample] = []  # the samples of the next batch taken so far (kept when __anext__ is cancelled)
        # each lane's receive and the collate of `taken`, kept likewise (see `_KeptCall`)
        self.receiving = {lane: _KeptCall() for lane in streams}
        self.collating = _KeptCall()
        self.waiting: tuple[int, float] | None = None  # (lane, since): the batch waits for that lane's samples
        self.stalled = False  # a warning was logged for this wait (see `_watch_stalls`)

    def stop(self) -> None:
        """End the stream at its next batch (`Loader.close()`); the frontier stays where it is."""
        self.stopped = True

    def __aiter__(self) -> BatchStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        """The next batch. Cancelling it (a timeout around it, say) loses nothing: the samples taken
        so far stay in `taken` and their collate runs on, and the next call goes on from there to the
        same batch."""
        while True:
            batch = await self.next_batch()
            if self.commit():
                return batch

    async def next_batch(self) -> dict[str, Any]:
        """The next batch, not yet consumed: until `commit()`, the rank's state is before it and
        another call makes the same batch again (from the samples kept in `taken`)."""
        if self.stopped:
            raise StopAsyncIteration
        with self.frontier.deciding:
            rewind, self.rewind = self.rewind, None
        if rewind is not None:
            with anyio.CancelScope(shield=True):  # half a relaunch would leave lanes of two states
                await self._rewind(rewind)
        cfg, frontier = self.config, self.frontier
        slots = rank_slots(frontier.step, cfg.global_batch_size, self.dp_size, self.dp_rank)
        while len(self.taken) < len(slots):
            i = slots[len(self.taken)]
            self.taken.append(await self._sample(i % cfg.lanes, i // cfg.lanes))
        samples = self.taken
        if all(s.state is None for s in samples) and self._ended():
            for lane in self.streams:  # every lane of this rank has ended
                frontier.end(lane)
            self.taken = []
            raise StopAsyncIteration
        if cfg.backend == "inline":
            batch = collate(samples, frontier.step, slots, cfg)
        else:  # stacking seq_len x batch tensors is CPU work: keep it off the trainer's loop
            batch = await self.collating.result(threads.run_sync, collate, samples, frontier.step, slots, cfg)
        return batch

    def commit(self) -> bool:
        """Consume the batch `next_batch` made: the rank's state moves past it. False (nothing
        consumed) if `set_weights` decided its step, or an earlier one, while it was made (from
        another thread, or another task while this one waited): `next_batch` makes it again."""
        with self.frontier.deciding:
            if self.rewind is not None and self.rewind <= self.frontier.step:
                return False
            self.frontier.commit(self.taken)
            self.taken = []
            return True

    async def _rewind(self, step: int) -> None:
        """set_weights for `step`: keep the samples the lanes made for earlier steps, drop the rest,
        and run the lanes again from their state after the last sample kept (the consumed one if none)."""
        cfg, states = self.config, {}
        for sample in reversed(self.taken):  # taken by a cancelled __anext__: back in line (padding is made anew)
            if sample.state is not None:
                self.pending[sample.lane].appendleft(sample)
        self.taken = []
        self.forget()
        for lane in self.streams:  # a lane's failure is not kept: the lane run again meets it again
            kept = [s for s in self.pending[lane] if (s.index * cfg.lanes + lane) // cfg.global_batch_size < step
                    and not isinstance(s, LaneFailure)]
            self.pending[lane] = collections.deque(kept)
            states[lane] = kept[-1].state if kept else self.frontier.lanes[lane]
        assert self.relaunch is not None
        self.streams, self.credit = await self.relaunch(states)
        self.done = {lane: states[lane].done for lane in self.streams}
        self.receiving = {lane: _KeptCall() for lane in self.streams}

    def forget(self) -> None:
        """Drop the kept receives and collate (the stream ends, or its lanes start again)."""
        for call in (*self.receiving.values(), self.collating):
            call.forget(cancel=True)

    def _ended(self) -> bool:
        """Every lane of this rank has ended and handed out all its samples. (A step of padding alone
        does not say so: with global_batch_size < lanes a step reads only some of the lanes.)"""
        return all(self.done[lane] and not self.pending[lane] for lane in self.streams)

    async def _sample(self, lane: int, index: int) -> Sample:
        queue = self.pending[lane]
        while not queue and not self.done[lane]:
            self.waiting = (lane, time.monotonic())
            try:
                got = await self.receiving[lane].result(self.streams[lane].receive)
            except anyio.EndOfStream:
                self.done[lane] = True
                break
            finally:  # a cancelled wait (a timeout around it) ends here too, and the next is watched anew
                (_, since), self.waiting = self.waiting, None
                stalled, self.stalled = self.stalled, False
            if stalled:  # the watch said it waited: say it is over
                log.warning("lane %d answered after %.0f s; batch %d goes on", lane, time.monotonic() - since,
                            self.frontier.step)
            queue.extend(got)
            self.credit(lane)
            self.frontier.peak_buffered = max(self.frontier.peak_buffered, 1 + sum(  # + the batch just taken out
                s.statistics().current_buffer_used for s in self.streams.values()))
        if not queue:
            return padding_sample(self.config.seq_len, self.pad_id, lane, index)
        if isinstance(queue[0], LaneFailure):  # the lane could not make this sample: its error, here in the order
            if queue[0].index != index:
                raise ZephonError(f"internal error: lane {lane} failed at sample {queue[0].index}, sequencer expected "
                                  f"{index}; please report this with your config") from queue[0].error
            raise queue[0].error
        sample = queue.popleft()
        if sample.index != index:
            raise ZephonError(f"internal error: lane {lane} produced sample {sample.index}, sequencer expected "
                              f"{index}; please report this with your config")
        return sample


async def _watch_stalls(stream: BatchStream, ended: anyio.Event, every: float) -> None:
    """Log a batch that has waited `every` seconds (`Config.stall_warning_s`) for one lane's
    samples, at each multiple of it (and `BatchStream._sample` once more when they come): what a
    hang waits on, where it would be silent. It reads two attributes every few seconds; the
    batches' path only sets them."""
    check = min(5.0, every / 4)
    wait, warned = None, 0  # the wait being watched, and the warnings given for it
    while True:
        with anyio.move_on_after(check):
            await ended.wait()
            return
        if stream.waiting != wait:
            wait, warned = stream.waiting, 0
        if wait is None:
            continue
        waited = time.monotonic() - wait[1]
        if waited >= (warned + 1) * every:
            warned += 1
            stream.stalled = True
            log.warning("batch %d has waited %.0f s for the samples of lane %d (backend %r): a read, its "
                        "retries or a lane worker is slow or stuck; still waiting", stream.frontier.step, waited,
                        wait[0], stream.config.backend)


def _stop_sent_whole(portal: Any) -> Callable[..., bool]:
    """An exit callback that sends `portal` its stop with Ctrl-C held. One that landed before the
    stop reached the loop left anyio's exit joining a thread whose loop never stops: the process hung
    for good. Held for that round trip only: the lanes' stop before it and the thread's join after
    it stay open to Ctrl-C (a read stuck on a hung mount must not make it useless). Cancels what
    remains in the loop when the stream ends by an exception, as anyio's exit does."""

    def send(exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        with ctrl_c_after(), contextlib.suppress(RuntimeError):  # RuntimeError: the portal stopped already
            portal.call(portal.stop, exc_type is not None)
        return False

    return send


class _KeptCall:
    """A call whose result outlives a cancelled caller.

    `result(call, *args)` awaits `call(*args)`. On asyncio it runs in a task of its own: cancelling
    the caller (a timeout around it, say) neither stops the call nor drops its result, and the
    next `result` waits for that same call (its arguments are the ones that count) instead of
    starting another. The calls kept: a lane stream's receive (a receive cancelled by asyncio,
    `wait_for`, after its item was handed over drops the item: anyio's memory streams guard only
    against their own cancel scopes), a collate and a `next` in a worker thread (a call in a thread
    cannot be stopped halfway, and waiting it out would make every timeout as long as the call;
    starting it again would lose what it returned, or never finish under a timeout shorter than
    the call). On another event loop (trio) the call is awaited as it is. `forget()` drops a call
    whose result is no longer wanted.
    """

    def __init__(self) -> None:
        self._task: asyncio.Future[Any] | None = None

    async def result(self, call: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            return await call(*args)
        if self._task is None:
            self._task = asyncio.ensure_future(call(*args))
        task = self._task
        try:
            out = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the call's own task, not only this wait (the loop is shutting down)
                self.forget()
            raise
        except BaseException:
            self.forget()
            raise
        self.forget()
        return out

    def forget(self, cancel: bool = False) -> None:
        task, self._task = self._task, None
        if task is None or not cancel:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # seen: not logged as "never retrieved" (a stream closed under a failure)
        else:
            task.cancel()


class _Iteration:
    """A `for batch in loader` iteration: the `_iterate` generator, which one thread runs at a time.

    `Loader.close()` from another thread closes a paused iteration there (its lanes stop at once).
    A plain generator closed there while its own thread called `next` made that `next` raise
    "ValueError: generator already executing"; here the `next` waits for the close, then ends the
    loop (`StopIteration`), and a close that finds a `next` in progress leaves the iteration to end
    at its next batch.
    """

    def __init__(self, generator: Iterator[dict[str, Any]]) -> None:
        self._generator = generator
        self._running = threading.Lock()

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._running:
            return next(self._generator)

    def close(self) -> None:
        """Stop the lanes now; a later `next` raises StopIteration (the generator protocol's `close`)."""
        with self._running:
            self._generator.close()  # type: ignore[attr-defined]

    def close_if_paused(self) -> None:
        """`close()`, unless a `next` is in progress (in another thread, or at exit a daemon thread's)."""
        if self._running.acquire(blocking=False):
            try:
                self._generator.close()  # type: ignore[attr-defined]
            finally:
                self._running.release()


class _ThreadedAsyncIterator:
    """`async for` over a `for` iteration, each `next` in a worker thread; a cancelled `__anext__`
    loses no batch (see `_KeptCall`): the next one hands it out, and the state moves past a batch
    only then (`Loader._iterate(deferred=True)`), so a checkpoint taken after the cancel names it."""

    def __init__(self, it: Iterator[dict[str, Any]]) -> None:
        self._it = it
        self._next = _KeptCall()

    def __aiter__(self) -> _ThreadedAsyncIterator:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            item = await self._next.result(threads.run_sync, next, self._it, _END)
            if item is _END:
                raise StopAsyncIteration
            batch, commit = item  # made, not consumed: the state moves past it here, as it is handed out
            if commit():  # (else set_weights decided its step meanwhile: the next `next` makes it again)
                return batch


_END: Any = object()

#: Every `for` iteration (`Loader.__iter__`'s `_Iteration`) not yet collected, of every Loader.
_OPEN_ITERATIONS: weakref.WeakSet[_Iteration] = weakref.WeakSet()


@atexit.register
def _close_open_iterations() -> None:
    """At interpreter exit, close the iterations still open, such as `batches = iter(loader)` in a
    script's globals, a common way to feed a training loop `next(batches)`.

    Each runs its lanes on the event loop of a daemon thread (`_iterate`'s portal), and closing it
    asks that loop to stop them. Left to the interpreter's last clean-up of globals, the close came
    after daemon threads can no longer run, and the process hung there for good, on both backends.
    atexit handlers run before that. They run last registered first, and `multiprocessing.util`,
    imported above, registers the handler that terminates daemonic worker processes: so the
    lanes of the processes backend stop here first, not as workers that died under them.
    An iteration running in a thread at exit (a daemon thread's) is left alone: it cannot be closed.
    """
    for it in list(_OPEN_ITERATIONS):
        it.close_if_paused()
    processes = sys.modules.get("zephon_stream.vision.processes")
    if processes is not None:  # then the image decode processes, which those iterations no longer use
        processes.close_pool()


def _register_iterable_dataset() -> None:
    """Make Loader a torch `IterableDataset` (a virtual subclass), so that `DataLoader(loader,
    batch_size=None)` iterates it instead of asking for `len()`. Done when a Loader is built, not
    at import: importing the package must not import torch (the relay never loads it)."""
    from torch.utils.data import IterableDataset

    if not issubclass(Loader, IterableDataset):
        IterableDataset.register(Loader)


def _check_not_in_torch_worker() -> None:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None:
        raise ConfigError(
            f"a Loader iterated in torch DataLoader worker {info.id} of {info.num_workers} would hand every worker "
            "the same batches: use DataLoader(loader, batch_size=None, num_workers=0); the loader batches and "
            'runs its own workers (backend = "processes", workers = N)')


def _sources_change(was: list[list[Any]], now: list[list[Any]]) -> str:
    """What changed in `order_settings()["sources"]` ([name, weight, text_field, ...] each), by
    source and setting, where a dump of both lists hid a weight's change among every setting."""
    before, after = {s[0]: s for s in was}, {s[0]: s for s in now}
    out = ([f"source {n!r} is gone" for n in before if n not in after]
           + [f"source {n!r} is new" for n in after if n not in before])
    for name in [n for n in after if n in before and before[n] != after[n]]:
        (_, w0, f0, *rest0), (_, w1, f1, *rest1) = before[name], after[name]
        out += ([f"weight of {name!r}: {w0!r} in the checkpoint, {w1!r} now"] if w0 != w1 else []) + (
            [f"text_field of {name!r}: {f0!r} in the checkpoint, {f1!r} now"] if f0 != f1 else []) + (
            [f"the image, chat or transforms settings of {name!r}"] if rest0 != rest1 else [])
    if not out:  # the same sources and settings in another order
        out.append(f"the sources' order: {[s[0] for s in was]} in the checkpoint, {[s[0] for s in now]} now")
    weights_only = all(x.startswith("weight of") for x in out)
    return "sources: " + "; ".join(out) + (
        " (to change a run's weights from a step on, resume with the config as it was and call "
        "Loader.set_weights, or pass zephon stream --set-weights STEP:NAME=W,...)" if weights_only else "")


def _tokenizer(config: Config) -> Tokenize:
    """The config's tokenizer, with its vocabulary checked against `pad_token_id`."""
    tok = Tokenize.for_config(config)
    if config.pad_token_id is not None and config.pad_token_id >= tok.vocab_size:
        raise ConfigError(f"config pad_token_id = {config.pad_token_id}: outside the vocabulary of "
                          f"{config.tokenizer} ({tok.vocab_size} ids); use an id below {tok.vocab_size}, or leave "
                          "it unset to pad with the EOS id")
    return tok


def _dist_rank_size(group: Any, mesh: Any, mesh_dim: str) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None and mesh is not None:
        group = mesh.get_group(mesh_dim)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1
