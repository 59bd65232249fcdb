"""Subscriber: bring a state_dict (or a rank's shard of it) to the newest version, in place.

A pull runs in two phases over the chunks, both streamed through the same workers:

1. verify: fetch every object the pull needs, check its size and blake2b digest, decode it
   against its chunk, compose the XOR deltas of every pending version into one, and check the
   chunk digest it would produce (from the current values at the changed positions: O(delta)).
   Any failure tries the next route for that chunk (overwrite objects, then the newest
   keyframe); if none verifies, the pull is refused and nothing has been written.
2. apply: record "applying v" locally, write each chunk in place, then record v.

A chunk that holds no version (a joiner's, or one a killed join left torn) has nothing to
protect, so it skips phase 1: in phase 2 each byte plane of its keyframe is decompressed into
per-thread scratch (or read in place, when zstd stored it raw) and woven into the weights by a
compiled loop that hashes each word as it writes it (one pass, no staging); the later deltas
are XORed in and move the digest by the changed words only. Such chunks go to the workers in
batches (`_Pull._batches`), so the event loop and the thread hand-off cost per batch. A chunk
that does not verify then raises DigestMismatch (naming the object when its blake2b, computed
only then, shows it corrupt); the record still says "applying", and the next pull loads it
again. Object digests are computed in the worker threads, with the chunk's other CPU work,
never on the event loop.

`prefetch()`, called while waiting for the next version, does phase 1's work early for the
delta objects already in the store (a relay streaming ahead puts them there before the
MANIFEST): fetch, digest, decode, and the O(delta) digest change against the current values.
The pull then checks those results against the MANIFEST instead of fetching again; whatever
does not match (another publish attempt, a corrupt object) takes the normal path.

A subscriber killed in phase 2 finds "applying" in its record on restart. It re-hashes each
chunk it holds: a chunk that matches the old or the new digest resumes from there; any other
(torn) chunk is rebuilt from overwrite objects or the newest keyframe.

The record is bound to what it describes: the prefix (its canonical `connectors.location`, so
any spelling of one place matches; a record written before the location was canonical for S3
names the prefix without its endpoint, and is re-verified once) and, when the
subscriber is given the `weights` file that holds the state, that file's identity (device,
inode, size, mtime, ctime). A record whose binding does not hold (a file replaced or rewritten
behind it, a pull from another prefix, or a record loaded without a weights file to check) is
re-verified before it is trusted: every held chunk is re-hashed, and a chunk that is at no
version the record or the target names is rebuilt from a keyframe, exactly as a torn chunk is.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, NamedTuple

import anyio
import msgspec
import numpy as np
import torch

from zephon_stream.connectors.base import Store
from zephon_stream.connectors.location import location
from zephon_stream.engine import threads
from zephon_stream.engine.cpu import CpuPolicy, default_threads
from zephon_stream.engine.files import atomic_write
from zephon_stream.engine.ordered import resolve_workers, run_ordered
from zephon_stream.errors import (
    BaseVersionMismatch,
    ConfigError,
    ConnectorError,
    DataError,
    DigestMismatch,
    ObjectNotFound,
    RefitError,
)
from zephon_stream.refit import codec, hashing
from zephon_stream.refit import manifest as _manifest
from zephon_stream.refit.layout import WORD, RankStream, Sharding, TensorTable, check_count
from zephon_stream.refit.local import ChunkPlan, LocalState, Placed, sync_tied
from zephon_stream.refit.manifest import Manifest, object_digest
from zephon_stream.refit.owner import StoreOwner
from zephon_stream.refit.target import NameMap, module_state
from zephon_stream.refit.versions import (
    chunk_key,
    find_latest,
    has_version,
    manifest_key,
    object_label,
    parse_object,
    read_manifest,
    version_prefix,
)

__all__ = ["FileIdentity", "LocalRecord", "Subscriber"]
log = logging.getLogger(__name__)

_KEY_BATCH_BYTES = 32 << 20  # model bytes a worker loads from a keyframe per hand-off (see `_Pull._batches`)
_REFUSABLE = (DataError, DigestMismatch, ConnectorError, BaseVersionMismatch)
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack holds no int over 2**64 - 1
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]


class FileIdentity(msgspec.Struct, frozen=True, array_like=True):
    """A file as `stat` sees it: replacing it (a new inode) or writing it (mtime, ctime) changes this."""

    dev: _U64
    ino: _U64
    size: _U64
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> FileIdentity:
        """A file's identity; for several files (a sharded checkpoint), one identity that changes
        when any of them is replaced or written: a digest of theirs in `ino`, their total size."""
        if isinstance(path, (str, os.PathLike)):
            try:
                st = os.stat(path)
            except OSError as exc:
                raise ConfigError(f"weights file {os.fspath(path)!r} cannot be read ({exc.strerror}): give the "
                                  "file that holds the state being pulled") from exc
            return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        each = [cls.of(p) for p in path]
        digest = hashlib.blake2b(msgspec.msgpack.encode([[os.fspath(p) for p in path], each]), digest_size=8)
        return cls(0, int.from_bytes(digest.digest(), "little"), sum(f.size for f in each),
                   max((f.mtime_ns for f in each), default=0), max((f.ctime_ns for f in each), default=0))


class LocalRecord(msgspec.Struct):
    """What a subscriber holds: `version` (0: nothing yet), and `target` while applying.

    `prefix` and `file` bind the record to where the version came from and to the weights file
    it describes (None: no file was named, or an apply is under way)."""

    version: _Count = 0
    target: Annotated[int, msgspec.Meta(ge=1, le=1 << 62)] | None = None
    geometry: str = ""
    digests: list[_U64] = []
    model_digest: _U64 = 0
    prefix: str = ""
    file: FileIdentity | None = None


_record_dec = msgspec.msgpack.Decoder(LocalRecord)


def decode_record(data: bytes, key: str) -> LocalRecord:
    """A local version record, strictly typed; DataError naming `key` for anything else."""
    try:
        return _record_dec.decode(data)
    except msgspec.DecodeError as exc:
        raise DataError(f"{key}: unreadable local version record ({exc}): delete it to pull as a new joiner",
                        key=key) from exc


class Route(NamedTuple):
    """How one chunk reaches the target: `kind` xor/set from version `start`, or key at `start`."""

    kind: str
    start: int
    digest: int | None  # the chunk's digest at `start`, when known


def geometry(m: Manifest) -> str:
    return f"{m.table_digest}/{m.world_size}/{sorted(m.split_dims.items())}/{m.chunk_bytes}"


class Subscriber(StoreOwner):
    """Pull every pending version of `prefix` into a state_dict in place.

    `sharding` says which piece of each tensor this rank holds (default: everything).
    `record` is a file for the local version record; without it the record lives in memory and
    a restarted process starts as a joiner (from the newest keyframe). `weights` is the file
    that holds the state (a memory-mapped safetensors file), or the files of a sharded one: the
    record is bound to their identity, so a restarted process trusts them unchanged without
    re-hashing them. A record
    loaded without `weights` is re-verified on the first pull. Every `pull` of one subscriber
    must be given the state the record describes (the same tensors, changed only by pulls).

    `module` makes an `nn.Module` the target: `pull()` then writes the module's own parameters
    and buffers in place (the same tensor objects, on CPU or CUDA; no second copy), with
    `name_map` for a layout that differs from the trainer's (see `refit.target`).
    """

    def __init__(
        self,
        prefix: str,
        *,
        store: Store | None = None,
        sharding: Sharding | None = None,
        record: str | os.PathLike[str] | None = None,
        weights: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        workers: int | None = None,
        threads: int | None = None,
        staged_bytes: int = 256 << 20,
        lanes: int | None = None,
        module: torch.nn.Module | None = None,
        name_map: NameMap | None = None,
    ) -> None:
        workers = resolve_workers(workers, lanes, default=4, owner="Subscriber")
        if name_map is not None and module is None:
            raise ConfigError("name_map maps a module's tensors: give module= too")
        check_count("workers", workers, 1)
        check_count("staged_bytes", staged_bytes, 0)
        if threads is not None:
            check_count("threads", threads, 1)
        super().__init__(prefix, store)
        self._where = str(location(prefix, store=store))  # what the record is bound to
        self.sharding = sharding or Sharding()
        self.record_path = _record_path(record) if record is not None else None
        self.weights: Path | tuple[Path, ...] | None = (
            None if weights is None else Path(weights) if isinstance(weights, (str, os.PathLike))
            else tuple(Path(w) for w in weights))
        self.workers, self.staged_bytes = workers, staged_bytes
        self._cpu = CpuPolicy(default_threads(workers) if threads is None else threads)
        self.record = self._load_record()
        self._trusted = False  # whether this object has itself brought the state to `record`
        self._manifests: dict[int, tuple[Manifest, TensorTable] | None] = {}
        self._tags: dict[int, tuple[int, str]] = {}  # the newest version read -> its MANIFEST's (size, ETag)
        self._ahead: dict[str, _Ahead] = {}  # object key -> phase-1 result, from prefetch()
        self._ahead_bytes = 0
        self._ahead_tried: set[str] = set()
        self._ahead_job: tuple[int, Mapping[str, torch.Tensor], _Pull] | None = None  # plans per version
        self.module, self.name_map = module, name_map
        self._views: tuple[object, dict[str, torch.Tensor | Placed]] | None = None  # (what they were made from, views)
        self._busy = anyio.Lock()  # one pull or prefetch at a time
        self._unheld = False  # a pull found the state not at the record's version, and none completed since

    def __repr__(self) -> str:
        return f"Subscriber({self.uri!r}, version={self.version}, sharding={self.sharding})"

    @property
    def version(self) -> int:
        """The version the state holds: the record's, or 0 once a pull has found (re-hashing a record
        it could not trust) that the state does not hold it, until a pull completes."""
        return 0 if self._unheld else self.record.version

    # -- record ---------------------------------------------------------------------------

    def _load_record(self) -> LocalRecord:
        path = self.record_path
        if path is None or not path.exists():
            return LocalRecord()
        size, limit = path.stat().st_size, _manifest.MAX_MANIFEST_BYTES
        if size > limit:  # a record holds 9 bytes per chunk: never near a MANIFEST's limit
            raise DataError(f"{path}: local version record of {size} bytes is over the {limit}-byte limit: not a "
                            "zephon record; delete it to pull as a new joiner", key=str(path))
        return decode_record(path.read_bytes(), str(path))

    def _doubt(self) -> bool:
        """Whether the record's claim about the state must be re-verified before it is trusted."""
        rec = self.record
        if rec.version == 0 and rec.target is None:
            return False  # it claims nothing
        if rec.prefix != self._where:
            return True
        if self.weights is not None:
            return rec.file is None or rec.file != FileIdentity.of(self.weights)
        return not self._trusted

    async def _anchored(self) -> LocalRecord:
        """The record as a claim about this prefix. One made at another prefix claims the version
        of the same number here (the re-hash then checks each chunk against it), or nothing."""
        rec = self.record
        if rec.prefix == self._where or (rec.version == 0 and rec.target is None):
            return rec
        m = await self._maybe_manifest(rec.version) if rec.version else None
        if m is None:
            return LocalRecord(prefix=self._where)
        return LocalRecord(rec.version, None, geometry(m), [c.plain for c in m.chunks], m.model_digest, self._where)

    async def _save(self, record: LocalRecord) -> None:
        self.record = record
        if self.record_path is not None:
            await threads.run_sync(atomic_write, self.record_path, [msgspec.msgpack.encode(record)])

    # -- pull -----------------------------------------------------------------------------

    def _state(self, state: Mapping[str, torch.Tensor] | None, m: Manifest, table: TensorTable
               ) -> tuple[Mapping[str, torch.Tensor | Placed], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The state to write (the one given, or views of `module` named as in `table`) less the
        version's tied names, and the (tied target, its source) pairs to copy after a pull: those
        that are not the same memory (in a module that ties them, none)."""
        if state is not None:
            if self.module is not None:
                raise ConfigError("this subscriber targets its module: call pull() without a state")
        elif self.module is None:
            raise ConfigError("pull() needs the state_dict to update, or a Subscriber made with module=")
        else:
            own = self.module.state_dict(keep_vars=True)
            made_from = (table.digest, sorted(m.aliases.items()), [(k, id(t), t.data_ptr()) for k, t in own.items()])
            if self._views is None or self._views[0] != made_from:  # a new layout, or the module moved (.to(device))
                self._views = made_from, module_state(self.module, table, self.name_map, self.sharding, m.aliases)
            state = self._views[1]
        if not m.aliases:
            return state, []
        copies = [(state[a], state[src]) for a, src in sync_tied(state, m.aliases)]
        return {k: v for k, v in state.items() if k not in m.aliases}, copies

    async def pull(self, state: Mapping[str, torch.Tensor] | None = None, *,
                   sync: Callable[[], None] | None = None) -> int:
        """Apply every pending version in place; return the version reached (0: none exist).

        `state` is the state_dict to update (omit it for a subscriber made with `module=`).
        `sync`, when given, runs (in a thread) after the writes and before the record says the
        version is complete: e.g. flushing a memory-mapped weights file.

        Pulls (and prefetches) of one subscriber run one at a time: a second task's `pull()`
        waits for the one in progress, then pulls what is newer (usually nothing). Two at once
        applied the same deltas side by side. So `sync` must not pull or prefetch with this
        subscriber: it runs inside the pull, which would wait for it forever.
        """
        async with self._busy:
            return await self._pull(state, sync)

    async def _pull(self, state: Mapping[str, torch.Tensor] | None, sync: Callable[[], None] | None) -> int:
        latest = await find_latest(self.store, self.key_prefix)
        if latest == 0:  # nothing here: a record made at another prefix claims nothing here either
            return self.record.version if self.record.prefix == self._where else 0
        doubt = self._doubt()
        rec = await self._anchored() if doubt else self.record
        reset = await self._reset(rec, latest)
        if reset is not None:  # its chunks are re-hashed against the prefix's versions, as a record in doubt
            log.warning("%s was started again (%s): this subscriber re-checks its state against it and pulls "
                        "version %d", self.uri, reset, latest)
            rec, doubt = LocalRecord(prefix=self._where), True
        if latest not in self._tags:  # the version a pull ends at: what its next pull checks (`_reset`)
            tag = await self._tag(latest)
            if tag is not None:
                self._tags = {latest: tag}
        m, table = await self._manifest(latest)
        targets, ties = self._state(state, m, table)
        local = LocalState(table, self.sharding, targets)
        if rec.version == latest and rec.target is None and rec.geometry == geometry(m) and not doubt:
            return latest
        job = _Pull(self, m, table, local, rec, doubt)
        try:
            await job.plan()
            try:
                await job.verify()
            except Exception:
                self._unheld = self._unheld or job.unheld
                raise
            await self._save(msgspec.structs.replace(rec, target=latest, file=None))  # unbound until applied
            await job.apply()
        except ObjectNotFound as exc:
            if await has_version(self.store, self.key_prefix, latest):
                exc.add_note(f"an object of a version that version {latest} builds on is gone: the publisher's "
                             "retention (keep_versions) collected it while this pull read it, and a pull again "
                             "takes the newest keyframe; if it is gone again, the prefix lost it (deleted by "
                             "hand?) and a pull can only start from a keyframe published after it")
                raise
            exc.add_note(f"version {latest} was collected while this pull read it (the publisher keeps "
                         "keep_versions versions): pull again, it takes the newest one")
            raise
        if local.shared:  # the target ties tensors the version holds apart: they must hold the same values
            await self._cpu(job.check_shared)
        for target, source in ties:  # tied tensors the target holds apart: copied from the one pulled
            await self._cpu(target.copy_, source)
        if sync is not None:
            await threads.run_sync(sync)
        identity = FileIdentity.of(self.weights) if self.weights is not None else None  # after our own writes
        await self._save(LocalRecord(latest, None, geometry(m), [c.plain for c in m.chunks], m.model_digest,
                                     self._where, identity))
        self._trusted, self._unheld = True, False
        self._drop_ahead()
        return latest

    async def _rebind(self, weights: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> None:
        """Bind the record to `weights`: the file (or a sharded checkpoint's files) this
        subscriber's last pull wrote, since renamed (`zephon refit pull` fills a new checkpoint
        under other names). The next pull trusts it without re-hashing it, as it would the files
        under their old names."""
        if self.record.target is not None or not self._trusted:
            raise RefitError("only a file that a completed pull wrote can be rebound")
        self.weights = (Path(weights) if isinstance(weights, (str, os.PathLike))
                        else tuple(Path(w) for w in weights))
        await self._save(msgspec.structs.replace(self.record, file=FileIdentity.of(self.weights)))

    async def prefetch(self, state: Mapping[str, torch.Tensor] | None = None) -> int:
        """Verify ahead the delta objects of the next version that are already in the store.

        Call it while waiting for the next version, from the task that pulls, with the same
        `state` (which only `pull` may change). It fetches each new `chunk` object of version
        `v+1`, checks it decodes against its chunk, and computes the chunk's digest change
        from the current values, holding at most `staged_bytes` of results. The next `pull`
        uses a result only where the MANIFEST names that very object (key, size, blake2b) as a
        delta from our version. Returns how many results are held; 0 when there is no version
        to build on yet, or the next version's MANIFEST is already in (then just pull).
        """
        async with self._busy:
            return await self._prefetch(state)

    async def _prefetch(self, state: Mapping[str, torch.Tensor] | None) -> int:
        rec = self.record
        if rec.version == 0 or rec.target is not None:
            return 0
        nxt = version_prefix(self.key_prefix, rec.version + 1)
        objects = await self.store.list(nxt)
        if any(o.key == manifest_key(self.key_prefix, rec.version + 1) for o in objects):
            return len(self._ahead)
        m, table = await self._manifest(rec.version)
        if geometry(m) != rec.geometry:
            return 0
        targets, _ = self._state(state, m, table)
        given = state if state is not None else self._views[1]  # the module's views, cached while it stays put
        cached = self._ahead_job
        if cached is None or cached[0] != rec.version or cached[1] is not given:
            job = _Pull(self, m, table, LocalState(table, self.sharding, targets))
            cached = self._ahead_job = (rec.version, given, job)
        job = cached[2]
        todo = []
        for o in objects:
            name = parse_object(o.key[len(nxt):])
            if name is None or name.kind != "chunk" or o.key in self._ahead or o.key in self._ahead_tried:
                continue
            if name.index < len(job.plans) and job.plans[name.index].owned:
                todo.append((name.index, o.key))

        async def stage(n: int) -> None:
            i, key = todo[n]
            self._ahead_tried.add(key)
            try:
                data = await self.store.read(key)
            except ConnectorError:
                return  # gone, or not there yet: the pull fetches what it needs
            got = await self._cpu(job.ahead, i, rec.version + 1, rec.version, data)
            if got is not None and self._ahead_bytes + got.nbytes <= self.staged_bytes:
                self._ahead[key] = got
                self._ahead_bytes += got.nbytes

        async def commit(n: int, _: None) -> None:
            pass

        await run_ordered(range(len(todo)), stage, commit, workers=self.workers, window=2 * self.workers)
        return len(self._ahead)

    def _drop_ahead(self) -> None:
        self._ahead.clear()
        self._ahead_tried.clear()
        self._ahead_bytes = 0
        self._ahead_job = None

    async def _manifest(self, version: int) -> tuple[Manifest, TensorTable]:
        if version not in self._manifests:
            self._manifests[version] = await read_manifest(self.store, self.key_prefix, version)
        got = self._manifests[version]
        if got is None:
            raise RefitError(f"version {version} has no MANIFEST under {self.uri!r} (garbage-collected?)")
        return got

    async def _tag(self, version: int) -> tuple[int, str] | None:
        """The (size, ETag) of `version`'s MANIFEST now, None if it has none."""
        try:
            info = await self.store.head(manifest_key(self.key_prefix, version))
        except ObjectNotFound:
            return None
        return info.size, info.etag

    async def _reset(self, rec: LocalRecord, latest: int) -> str | None:
        """Why the prefix no longer holds the versions `rec` (a record of this prefix) names, if it
        does not: a trainer that started again on a wiped prefix numbers its versions from 1, and
        its version N is another model than the one this subscriber pulled as N. The manifests read
        before are forgotten then (a version of the same number is another object now)."""
        if rec.version == 0 or rec.prefix != self._where or not rec.model_digest:
            return None
        why = None
        tag = await self._tag(rec.version) if rec.version in self._tags else None
        if rec.version in self._tags and tag is None:  # collected: a copy read before says nothing of it now
            self._manifests.pop(rec.version, None)
        if rec.version > latest:
            why = f"its newest version is {latest}, behind version {rec.version} that this subscriber pulled"
        elif tag is not None and tag != self._tags[rec.version]:
            why = f"its version {rec.version} was written again since this subscriber read it"
        else:
            m = await self._maybe_manifest(rec.version)
            if m is not None and m.model_digest != rec.model_digest:
                why = (f"its version {rec.version} is another model (digest {m.model_digest:016x}) than the one this "
                       f"subscriber pulled as {rec.version} ({rec.model_digest:016x})")
            elif m is None and rec.version < latest:  # collected: the version after it says what it was
                after = await self._maybe_manifest(rec.version + 1)
                if after is not None and after.follows_another(rec.version, rec.model_digest):
                    why = (f"its version {rec.version + 1} is a delta from another model (digest "
                           f"{after.base_model_digest:016x}) than the one this subscriber pulled as {rec.version} "
                           f"({rec.model_digest:016x}), and its version {rec.version} is collected")
        if why is not None:
            self._manifests.clear()
            self._tags.clear()
            self._drop_ahead()
        return why

    async def _maybe_manifest(self, version: int) -> Manifest | None:
        """The manifest of `version`, or None when it is missing or unusable (malformed, oversized):
        a route through it is then not taken."""
        try:
            return (await self._manifest(version))[0]
        except (RefitError, DataError):
            return None


def _record_path(record: str | os.PathLike[str]) -> Path:
    path = Path(record)
    if path.is_dir():
        raise ConfigError(f"record {os.fspath(record)!r} is a directory: give a file path (default: FILE.refit)")
    if not path.parent.is_dir():
        raise ConfigError(f"record {os.fspath(record)!r}: directory {str(path.parent)!r} does not exist")
    return path


class _Object(NamedTuple):
    """A fetched object and the blake2b digest its manifest gives it (data b"": no object)."""

    key: str
    data: bytes
    digest: str


def _verified(objects: list[_Object], cause: Exception | None = None) -> None:
    """Check each object's blake2b digest against its manifest (CPU work: ~1 ns per byte, so in
    a worker thread, never on the event loop). `cause`: the failure that called for the check."""
    for o in objects:
        got = object_digest(o.data) if o.data else o.digest
        if got != o.digest:
            raise DigestMismatch(f"{o.key}: blake2b digest {got} != manifest's {o.digest}: corrupt object") from cause


class _Staged(NamedTuple):
    route: Route
    decoded: tuple[np.ndarray | None, np.ndarray, np.ndarray] | None  # None: re-fetch (over budget)


class _Ahead(NamedTuple):
    """Phase 1 done early for one delta object (see `Subscriber.prefetch`)."""

    version: int  # the version the object belongs to
    base: int  # the version whose values `change` was computed from
    size: int
    digest: str  # blake2b of the object
    positions: np.ndarray
    new: np.ndarray  # the values at `positions` after the delta
    change: int  # the chunk digest's change, mod 2**64

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.new.nbytes


class _Pull:
    """One pull: plan routes, verify them, apply them."""

    def __init__(self, sub: Subscriber, m: Manifest, table: TensorTable, local: LocalState,
                 rec: LocalRecord | None = None, doubt: bool = False) -> None:
        self.sub, self.m, self.local = sub, m, local
        self.rec, self.doubt = rec if rec is not None else sub.record, doubt
        self.target = m.version
        streams = [RankStream(table, m.sharding(r), m.chunk_bytes) for r in range(m.world_size)]
        chunks = [c for s in streams for c in s.chunks]
        self.plans = [ChunkPlan(c, streams[c.rank], local) for c in chunks]
        self.todo = [i for i, p in enumerate(self.plans) if _touches(p)]
        self.routes: dict[int, list[Route]] = {}
        self.staged: dict[int, _Staged] = {}
        self.budget = sub.staged_bytes
        self.key: int | None = None
        self.fresh: set[int] = set()  # chunks that hold no version now: loaded from a keyframe in one pass
        self.unheld = False  # verify failed on a chunk that re-hashed to none of the versions the record names

    # -- planning -------------------------------------------------------------------------

    async def _chain_ok(self, start: int, digest: int | None) -> bool:
        """Whether deltas start+1..target all exist with matching geometry and bases."""
        prev = digest
        for v in range(start + 1, self.target + 1):
            m = await self.sub._maybe_manifest(v)
            if m is None or m.base_version is None or geometry(m) != geometry(self.m):
                return False
            if prev is not None and m.base_model_digest != prev:
                raise BaseVersionMismatch(
                    f"version {v} of {self.sub.uri!r} is a delta from a model with digest "
                    f"{m.base_model_digest:016x}, but version {v - 1} has {prev:016x}: refusing the chain"
                )
            prev = m.model_digest
        return True

    async def _keyframe(self) -> int:
        if self.key is None:
            v = self.target
            while True:
                m = await self.sub._maybe_manifest(v)
                if m is None:
                    raise RefitError(f"no keyframe reachable at or below version {self.target} of {self.sub.uri!r}")
                if m.keyframe and geometry(m) == geometry(self.m):
                    break
                v -= 1
            mk = (await self.sub._manifest(v))[0]
            if v < self.target and not await self._chain_ok(v, mk.model_digest):
                raise RefitError(f"versions {v + 1}..{self.target} after keyframe {v} are incomplete")
            self.key = v
        return self.key

    async def plan(self) -> None:
        """Routes per chunk, best first. A chunk is re-hashed when the record may not describe it
        (torn by a killed apply, or in doubt), and then starts from a version its digest matches."""
        rec, sub = self.rec, self.sub
        same = rec.version > 0 and rec.geometry == geometry(self.m) and len(rec.digests) == len(self.m.chunks)
        chain = same and await self._try_chain(rec.version, rec.model_digest)
        torn = same and rec.target is not None
        rehash = torn or (same and self.doubt)
        known = await self._known(chain, torn) if rehash else []
        blank = rec.version == 0  # a joiner, or one killed while joining: its state holds no version
        for i in self.todo:
            routes: list[Route] = []
            owned = self.plans[i].owned
            if rehash and owned:
                h = await sub._cpu(lambda i=i: self.plans[i].digest(self.plans[i].current()))
                routes += [Route("xor", v, h) for v, digests in known if digests[i] == h][:1]
                if not routes:
                    self.fresh.add(i)  # torn: at no version it could build on
            elif chain and not rehash:
                routes.append(Route("xor", rec.version, rec.digests[i] if owned else None))
            if blank:
                self.fresh.add(i)
            if same and chain and (owned or not self.doubt):  # a held-in-part chunk in doubt: keyframe only
                routes.append(Route("set", rec.version, None))
            routes.append(Route("key", -1, None))
            self.routes[i] = routes

    async def _known(self, chain: bool, torn: bool) -> list[tuple[int, list[int]]]:
        """(version, chunk digests) a re-hashed chunk may be at, each with a delta chain to the target."""
        rec, out = self.rec, []
        if chain:
            out.append((rec.version, rec.digests))
        target_m = await self.sub._maybe_manifest(rec.target) if torn and rec.target else None
        if (target_m is not None and rec.target <= self.target and geometry(target_m) == geometry(self.m)
                and await self._try_chain(target_m.version, None)):
            out.append((target_m.version, [c.plain for c in target_m.chunks]))
        if self.doubt:
            out.append((self.target, [c.plain for c in self.m.chunks]))
        return out

    async def _try_chain(self, start: int, digest: int | None) -> bool:
        try:
            return await self._chain_ok(start, digest)
        except BaseVersionMismatch:
            if self.m.keyframe or self.doubt:  # a record in doubt may well name the wrong model: rebuild instead
                return False
            raise

    # -- fetching -------------------------------------------------------------------------

    async def _fetch(self, i: int, route: Route) -> list[_Object]:
        """The objects of a route for chunk i, each size checked against its manifest entry; their
        blake2b digests are checked with the chunk's CPU work (`_verified`), off the event loop."""
        if route.kind == "key":
            route = Route("key", await self._keyframe(), None)
            out = [await self._object(route.start, i, "key")]
            versions = range(route.start + 1, self.target + 1)
        else:
            out, versions = [], range(route.start + 1, self.target + 1)
        what = "over" if route.kind == "set" else "chunk"
        for v in versions:
            out.append(await self._object(v, i, what))
        return out

    async def _object(self, version: int, i: int, what: str) -> _Object:
        m = (await self.sub._manifest(version))[0]
        c = m.chunks[i]
        size, digest = {"chunk": (c.size, c.digest), "key": (c.key_size, c.key_digest),
                        "over": (c.over_size, c.over_digest)}[what]
        if what == "over" and c.kind and not size:
            raise RefitError(f"version {version} chunk {i} has no overwrite object")
        key = chunk_key(self.sub.key_prefix, m, i, what)
        if not size:
            return _Object(key, b"", digest)
        data = await self.sub.store.read(key)
        if len(data) != size:
            raise DataError(f"{key}: object is {len(data)} bytes, the manifest says {size} (truncated?)", key=key,
                            offset=len(data))
        return _Object(key, data, digest)

    # -- CPU work -------------------------------------------------------------------------

    def _key_words(self, i: int, data: bytes, out: np.ndarray | None) -> tuple[np.ndarray, int]:
        """Keyframe chunk i woven into `out` (a fresh array when None), and its digest: one pass."""
        c = self.plans[i].chunk
        planes = codec.full_planes(data, itemsize=c.itemsize, words=c.words, key=object_label(self.key or 0, "key", i))
        words = out if out is not None else np.empty(c.words, WORD[c.itemsize])
        return words, self.plans[i].load(planes, words)

    def _xor_in(self, i: int, words: np.ndarray, deltas: list[bytes], digest: int) -> int:
        """XOR the deltas after keyframe `self.key` into chunk i's whole `words`; return the digest
        moved from `digest` (theirs before) by the changed words only: O(delta), no second pass."""
        pos, val = self._compose(i, "xor", (self.key or 0) + 1, deltas)
        if not len(pos):
            return digest
        old = words[pos]
        new = old ^ val
        words[pos] = new
        return (digest + self.plans[i].change_sum(pos, old, new)) & hashing.MASK

    def _compose(self, i: int, kind: str, first: int, deltas: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The delta objects of versions first, first+1, ... for chunk i as one (positions, values)."""
        c = self.plans[i].chunk
        kinds = (codec.SPARSE_SET,) if kind == "set" else (codec.SPARSE_XOR, codec.DENSE_XOR)
        parts = []
        for k, data in enumerate(deltas):
            if not data:
                continue
            label = object_label(first + k, "chunk", i)
            d = codec.decode(data, kinds=kinds, itemsize=c.itemsize, words=c.words, key=label)
            pos = d.positions if d.positions is not None else np.flatnonzero(d.values)
            parts.append((pos, d.values if d.positions is not None else d.values[pos]))
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, WORD[c.itemsize])
        return (codec.compose_set if kind == "set" else codec.compose_xor)(parts)

    def _load_key(self, i: int, objects: list[_Object]) -> None:
        """Keyframe + later deltas for a chunk that holds no version, in one pass: decompress
        each plane into scratch, weave it straight into the weights (or one array off CPU) while
        hashing it, XOR the deltas in and move the digest by them.

        Only for `fresh` chunks: a mismatch leaves a chunk that held nothing holding nothing
        valid, and the record (at "applying") makes the next pull load it again. So the keyframe
        object's blake2b (as costly as the load) is computed only when the load fails, to name
        a corrupt object; the delta objects' are checked first, as on every other route."""
        plan, want = self.plans[i], self.m.chunks[i].plain
        _verified(objects[1:])
        view = plan.view()
        try:
            words, got = self._key_words(i, objects[0].data, view)
            got = self._xor_in(i, words, [o.data for o in objects[1:]], got)
            if got != want:
                raise DigestMismatch(f"chunk {i} loaded from keyframe v{self.key} has digest {got:016x}, version "
                                     f"{self.target} says {want:016x}: the chunk holds no version; pull again")
        except (DataError, DigestMismatch) as exc:
            _verified(objects[:1], cause=exc)
            raise
        if view is None:
            plan.write(np.arange(plan.chunk.words), words, xor=False)

    def ahead(self, i: int, version: int, base: int, data: bytes) -> _Ahead | None:
        """Phase 1 of an owned chunk's single delta, before its MANIFEST (None: undecodable)."""
        plan = self.plans[i]
        c = plan.chunk
        try:
            d = codec.decode(data, kinds=(codec.SPARSE_XOR, codec.DENSE_XOR), itemsize=c.itemsize, words=c.words,
                             key=object_label(version, "chunk", i))
        except DataError:
            return None  # the pull fetches it again and reports it against the MANIFEST
        pos = d.positions if d.positions is not None else np.flatnonzero(d.values)
        val = d.values if d.positions is not None else d.values[pos]
        old = plan.gather(pos)
        new = old ^ val
        return _Ahead(version, base, len(data), object_digest(data), pos, new, plan.change_sum(pos, old, new))

    def _ready(self, i: int, route: Route) -> tuple[None, np.ndarray, np.ndarray] | None:
        """The prefetched phase 1 of chunk i, when the MANIFEST names that very object."""
        c, plan = self.m.chunks[i], self.plans[i]
        if (route.kind != "xor" or route.start != self.target - 1 or route.digest is None or not plan.owned
                or not c.size):
            return None
        got = self.sub._ahead.get(chunk_key(self.sub.key_prefix, self.m, i))
        if got is None or (got.version, got.base, got.size, got.digest) != (self.target, route.start, c.size, c.digest):
            return None
        if (route.digest + got.change) & ((1 << 64) - 1) != c.plain:
            return None  # the values it read were not our version's: the normal path and its fallbacks decide
        return None, got.positions, got.new

    def _check(self, i: int, route: Route, objects: list[_Object]
               ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Check a route's objects, decode them and check the chunk digest they would produce,
        writing nothing. Returns what `_write` writes: (whole words for a key route, else None;
        positions; values)."""
        plan, want = self.plans[i], self.m.chunks[i].plain
        _verified(objects)
        data = [o.data for o in objects]
        if route.kind == "key":
            base, got_key = self._key_words(i, data[0], None)
            key_plain = self.sub._manifests[self.key][0].chunks[i].plain
            if got_key != key_plain:
                raise DigestMismatch(f"keyframe v{self.key} chunk {i}: digest {got_key:016x} != {key_plain:016x}")
            got = self._xor_in(i, base, data[1:], got_key)
            decoded = base, np.zeros(0, np.int64), np.zeros(0, base.dtype)
        else:
            pos, val = self._compose(i, route.kind, route.start + 1, data)
            decoded = None, pos, val
            if not plan.owned:
                return decoded  # object digests and decoding checked; this rank cannot see the whole chunk
            if route.kind == "set":
                words = plan.read()
                words[pos] = val
                got = plan.digest(words)
            else:
                old = plan.gather(pos)
                new = old ^ val
                got = (route.digest + plan.change_sum(pos, old, new)) & hashing.MASK
                decoded = None, pos, new  # new values: the write is then a plain scatter
        if got != want:
            raise DigestMismatch(
                f"chunk {i} would have digest {got:016x} after applying v{self.target}, the manifest says {want:016x}"
            )
        return decoded

    def _write(self, i: int, route: Route, decoded: tuple[np.ndarray | None, np.ndarray, np.ndarray]) -> None:
        """Write a chunk checked by `_check`: its full words, or its changed words' new values
        (`_check` turned an owned chunk's XOR into new values; others still hold the XOR)."""
        plan = self.plans[i]
        base, pos, val = decoded
        if base is not None:
            plan.write(np.arange(plan.chunk.words), base, xor=False)
        else:
            plan.write(pos, val, xor=route.kind == "xor" and not plan.owned)
        if self.m.keyframe and route.kind != "key" and plan.owned:
            got = plan.digest(plan.current())  # keyframes re-hash in full
            if got != self.m.chunks[i].plain:
                raise DigestMismatch(f"chunk {i} re-hashed to {got:016x} at keyframe v{self.target}, expected "
                                     f"{self.m.chunks[i].plain:016x}: local memory was corrupt; pull again to repair")

    # -- phases ---------------------------------------------------------------------------

    def _one_pass(self, i: int) -> bool:
        """Whether chunk i is loaded from the keyframe in one pass in apply (nothing to verify first)."""
        return i in self.fresh and self.routes[i][0].kind == "key"

    async def verify(self) -> None:
        cpu = self.sub._cpu
        for i in self.todo:  # a joiner's chunks: no per-chunk trip through the workers
            if self._one_pass(i):
                self.staged[i] = _Staged(Route("key", await self._keyframe(), None), None)

        async def stage(i: int) -> _Staged:
            errors: list[Exception] = []
            for route in self.routes[i]:
                ready = self._ready(i, route)
                if ready is not None:
                    return _Staged(route, ready)  # its bytes are already counted in the prefetch budget
                try:
                    objects = await self._fetch(i, route)
                    decoded = await cpu(self._check, i, route, objects)
                except (*_REFUSABLE, RefitError) as exc:
                    errors.append(exc)
                    continue
                if route.kind == "key":
                    route = Route("key", self.key or 0, None)
                size = sum(a.nbytes for a in decoded if a is not None)
                if size > self.budget:
                    return _Staged(route, None)
                self.budget -= size
                return _Staged(route, decoded)
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"fallback also failed: {type(other).__name__}: {other}")
            if self.doubt:
                first.add_note("the local record was not trusted as it stood (its weights file or prefix changed, or "
                               "no weights file was named to check it), so each chunk was re-verified first")
            if i in self.fresh and self.rec.version and self.doubt:
                self.unheld = True
                first.add_note(f"version {self.target} refused: nothing was applied; re-hashed, chunk {i} of the state "
                               f"holds none of the versions it could build on (not version {self.rec.version}, "
                               "which the record names), so only a keyframe can rebuild it: the state holds no "
                               "version, and the subscriber's version is 0 until a pull completes")
            else:
                first.add_note(f"version {self.target} refused: nothing was applied, the state stays at version "
                               f"{self.sub.record.version}")
            raise first

        async def commit(i: int, staged: _Staged) -> None:
            self.staged[i] = staged

        todo = [i for i in self.todo if i not in self.staged]
        await run_ordered(todo, stage, commit, workers=self.sub.workers, window=2 * self.sub.workers)

    async def apply(self) -> None:
        cpu = self.sub._cpu

        async def stage(batch: list[int]) -> None:
            if self._loads(batch[0]):
                loads = [(i, await self._fetch(i, self.staged.pop(i).route)) for i in batch]
                await cpu(self._load_keys, loads)
                return
            (i,) = batch
            st = self.staged.pop(i)
            decoded = st.decoded
            if decoded is None:
                decoded = await cpu(self._check, i, st.route, await self._fetch(i, st.route))
            await cpu(self._write, i, st.route, decoded)

        async def commit(batch: list[int], _: None) -> None:
            pass

        await run_ordered(self._batches(), stage, commit, workers=self.sub.workers, window=2 * self.sub.workers)

    def _batches(self) -> list[list[int]]:
        """The apply's work items: runs of one-pass keyframe chunks, each of up to
        `_KEY_BATCH_BYTES` of model (and of `staged_bytes` over all workers: a worker holds its
        batch's objects at once), handed to a worker thread in one call, so the event loop and the
        thread hand-off cost per batch, not per chunk; every other chunk alone."""
        loads = [i for i in self.todo if self._loads(i)]
        per = min(_KEY_BATCH_BYTES, self.sub.staged_bytes // self.sub.workers) // self.m.chunk_bytes
        per = max(1, min(per, len(loads) // (4 * self.sub.workers)))  # 4+ batches a worker: they end together
        others = [[i] for i in self.todo if not self._loads(i)]
        return [loads[k : k + per] for k in range(0, len(loads), per)] + others

    def check_shared(self) -> None:
        """Re-hash, from memory, the chunks of the tensors that share memory in the target: a module
        that ties an embedding and an LM head which the version holds with other values has the one
        written last in both, and would say it pulled the version. Equal values (a trainer whose
        state_dict copies a tie apart) pass."""
        shared = {t for pair in self.local.shared for t in pair}
        for i, plan in enumerate(self.plans):
            if plan.owned and any(p.tensor in shared for p in plan.parts):
                if plan.digest(plan.current()) != self.m.chunks[i].plain:
                    specs = self.local.table.specs
                    names = ", ".join(f"{specs[a].name!r} and {specs[b].name!r}"
                                      for a, b in self.local.shared)
                    raise ConfigError(
                        f"version {self.target} holds {names} apart, with other values, but they share memory in "
                        "the target (tied weights): the one written last is in both, so the target does not hold "
                        "the version. Untie them in the target (e.g. tie_word_embeddings=False), or publish from "
                        "a model that ties them too")

    def _loads(self, i: int) -> bool:
        """Whether apply loads chunk i from its keyframe in one pass (`_load_key`)."""
        st = self.staged[i]
        return st.decoded is None and st.route.kind == "key" and i in self.fresh

    def _load_keys(self, loads: list[tuple[int, list[_Object]]]) -> None:
        for i, objects in loads:
            self._load_key(i, objects)


def _touches(plan: ChunkPlan) -> bool:
    """Whether this rank holds any element of the chunk (ranges compared when split alike)."""
    for p in plan.parts:
        mine = plan.local.pieces[p.tensor]
        if p.mode != "other" or (mine.a, mine.s, mine.b) != (p.pub.a, p.pub.s, p.pub.b):
            return True
        if mine.lo < p.pub.lo + p.pub.step and p.pub.lo < mine.lo + mine.step:
            return True
    return False
