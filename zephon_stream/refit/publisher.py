"""Publisher: publish a state_dict (or one rank's shard of it) as the next version of a prefix.

Each publish XORs the new weights against a CPU shadow of the last published ones, chunk by
chunk through the workers, uploads each chunk's delta (plus the full chunk on keyframes, plus an
overwrite object when asked), and only then commits the MANIFEST with a conditional put. The
shadow is the publisher's one extra copy of its shard. A publisher that starts against a prefix
that already has versions, or whose previous publish failed, first pulls the newest version into
its shadow, so a crash never leaves it publishing against a base nobody has.

With several ranks, each writes its chunks and a `part-{rank}` record; whichever rank sees all
parts present commits the MANIFEST (the conditional put settles a tie). All ranks of one publish
must pass the same `session` tag.

Every setting is checked when the publisher is made, and the layout (tensor shapes, chunk count)
before the first object is written, against the limits a reader enforces: a publisher never
commits a version that a subscriber would refuse. A head version that cannot be built on (its
MANIFEST malformed, or its objects missing or corrupt) is not a dead end either: the next
publish is a keyframe after it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping

import anyio
import msgspec
import numpy as np
import torch

from zephon_stream.connectors.base import Store
from zephon_stream.engine.cpu import CpuPolicy, default_threads
from zephon_stream.engine.ordered import resolve_workers, run_ordered
from zephon_stream.errors import (
    AlreadyExists,
    ConfigError,
    DataError,
    DigestMismatch,
    ObjectNotFound,
    RefitError,
    unwrap_groups,
)
from zephon_stream.refit import codec
from zephon_stream.refit import manifest as _manifest
from zephon_stream.refit.hashing import MASK
from zephon_stream.refit.layout import RankStream, Sharding, TensorTable, check_chunk_bytes, check_count
from zephon_stream.refit.local import ChunkPlan, LocalState, tied
from zephon_stream.refit.manifest import (
    ChunkEntry,
    Manifest,
    Part,
    check_publishable,
    decode_part,
    encode_manifest,
    object_digest,
)
from zephon_stream.refit.owner import StoreOwner
from zephon_stream.refit.subscriber import Subscriber, geometry
from zephon_stream.refit.versions import (
    collect_garbage,
    commit_manifest,
    find_latest,
    object_key,
    part_key,
    parts_prefix,
    read_manifest,
    write_latest,
)

__all__ = ["Publisher", "VersionConflict", "VersionInfo", "copy_state"]

log = logging.getLogger(__name__)
# A head that cannot be built on: its MANIFEST malformed or oversized, an object gone or corrupt.
_UNUSABLE = (DataError, RefitError, ObjectNotFound)


_PIECE_BYTES = 64 << 20  # one CPU step of a state copy


class VersionConflict(RefitError):
    """Another publisher committed this version first."""


class VersionInfo(msgspec.Struct, frozen=True):
    """What a publish produced. On a sharded rank the sizes and `model_digest` are that rank's
    share (the MANIFEST's model digest is the sum over ranks), and `committed` is False on a
    rank whose part was written before the other ranks' parts."""

    version: int
    base_version: int | None
    keyframe: bool
    model_digest: int
    model_bytes: int
    delta_bytes: int
    key_bytes: int
    over_bytes: int
    changes: int
    committed: bool = True


class Publisher(StoreOwner):
    """Publish versions of a model under `prefix` (a URI, or a key prefix of `store`)."""

    def __init__(
        self,
        prefix: str,
        *,
        store: Store | None = None,
        sharding: Sharding | None = None,
        keyframe_every: int = 10,
        keep_versions: int = 8,
        chunk_bytes: int = 4 << 20,
        session: str | None = None,
        overwrite: bool = False,
        workers: int | None = None,
        threads: int | None = None,
        level: int = 1,
        lanes: int | None = None,
    ) -> None:
        workers = resolve_workers(workers, lanes, default=4, owner="Publisher")
        check_count("keyframe_every", keyframe_every, 1)
        check_count("keep_versions", keep_versions, 1)
        check_chunk_bytes(chunk_bytes)
        check_count("workers", workers, 1)
        if threads is not None:
            check_count("threads", threads, 1)
        codec.check_level(level)
        self.sharding = sharding or Sharding()
        if self.sharding.world_size > _manifest.MAX_WORLD:
            raise ConfigError(f"world_size={self.sharding.world_size} is over the limit of {_manifest.MAX_WORLD} ranks")
        if self.sharding.world_size > 1 and session is None:
            raise ConfigError("a sharded publisher needs a `session` tag shared by all its ranks (8-32 hex digits)")
        if session is not None and not (isinstance(session, str) and _manifest.ATTEMPT.match(session)):
            raise ConfigError(f"session={session!r} must be 8-32 lowercase hex digits, e.g. secrets.token_hex(8)")
        super().__init__(prefix, store)
        self.keyframe_every, self.keep_versions, self.chunk_bytes = keyframe_every, keep_versions, chunk_bytes
        self.session, self.overwrite, self.workers, self.level = session, overwrite, workers, level
        self._cpu = CpuPolicy(default_threads(workers) if threads is None else threads)
        self._shadow: dict[str, torch.Tensor] | None = None
        self._shadow_version: int | None = None

    def __repr__(self) -> str:
        return f"Publisher({self.uri!r}, sharding={self.sharding}, keyframe_every={self.keyframe_every})"

    async def publish(self, state: Mapping[str, torch.Tensor]) -> VersionInfo:
        """Publish `state` as the next version; returns what was published.

        Tied tensors (names of the same memory, such as an embedding and the LM head that shares
        it) are carried once, under their first name, and the version lists the others as ties:
        a subscriber writes the shared memory once, or copies it into an untied target. Tensors
        that `sharding` splits are carried under every name."""
        aliases = tied(state, keep=list(self.sharding.dims))
        if aliases:
            state = {k: v for k, v in state.items() if k not in aliases}
        table = TensorTable.from_local(state, self.sharding)
        new = LocalState(table, self.sharding, state)
        stream = RankStream(table, self.sharding, self.chunk_bytes)
        check_publishable(table, self.sharding, self.chunk_bytes)
        latest = await find_latest(self.store, self.key_prefix)
        base = await self._base(latest, table, state)
        version = latest + 1
        keyframe = base is None or (version - 1) % self.keyframe_every == 0
        attempt = self.session or secrets.token_hex(8)
        self._shadow_version = None  # dirty until this version is written
        if base is None:  # the first copy of a 1B model takes ~1 s: in the workers, never on the loop
            self._shadow = await copy_state(state, self._shadow or {}, self._cpu, _PIECE_BYTES)
        old = LocalState(table, self.sharding, self._shadow or {})
        world, dims = self.sharding.world_size, self.sharding.dims
        first = sum(len(RankStream(table, Sharding(r, world, dims), self.chunk_bytes).chunks)
                    for r in range(self.sharding.rank))  # chunks of the ranks before this one
        job = _Encode(self, version, attempt, keyframe, base, stream, new, old, first)
        entries = await job.run()
        part = Part(self.sharding.rank, entries, sum(e.changes for e in entries))
        committed = await self._commit(version, attempt, keyframe, base, table, part, aliases)
        self._shadow_version = version
        def total(f):
            return sum(getattr(e, f) for e in entries)
        return VersionInfo(
            version, base.version if base else None, keyframe, sum(e.plain for e in entries) & MASK,
            stream.nbytes, total("size"), total("key_size"), total("over_size"), total("changes"), committed,
        )

    async def _base(self, latest: int, table: TensorTable, state: Mapping[str, torch.Tensor]) -> Manifest | None:
        """The manifest to delta against (None: publish a pure keyframe), resyncing the shadow.

        A head that cannot be built on gives None, so a corrupt head never blocks publishing."""
        if latest == 0:
            return None
        try:
            return await self._resync(latest, table, state)
        except _UNUSABLE as exc:
            log.warning("version %d of %r cannot be built on (%s: %s): publishing a keyframe after it",
                        latest, self.uri, type(exc).__name__, exc)
            self._shadow_version = None
            return None

    async def _resync(self, latest: int, table: TensorTable, state: Mapping[str, torch.Tensor]) -> Manifest | None:
        m, _ = await read_manifest(self.store, self.key_prefix, latest) or (None, None)
        geo = f"{table.digest}/{self.sharding.world_size}/{sorted(self.sharding.dims.items())}/{self.chunk_bytes}"
        if m is None or geometry(m) != geo:
            return None
        if self._shadow_version != latest:
            shadow = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in state.items()}
            sub = Subscriber(self.key_prefix, store=self.store, sharding=self.sharding, workers=self.workers)
            if await sub.pull(shadow) != latest:
                raise RefitError(f"could not bring the publisher's shadow to version {latest} of {self.uri!r}")
            self._shadow, self._shadow_version = shadow, latest
        return m

    async def _commit(self, version: int, attempt: str, keyframe: bool, base: Manifest | None,
                      table: TensorTable, part: Part, aliases: dict[str, str]) -> bool:
        world = self.sharding.world_size
        parts = [part]
        if world > 1:
            await self.store.put(part_key(self.key_prefix, version, part.rank, attempt), encode_manifest(part),
                                 if_none_match=True)
            keys = [part_key(self.key_prefix, version, r, attempt) for r in range(world)]
            present = {o.key for o in await self.store.list(parts_prefix(self.key_prefix, version))}
            if not set(keys) <= present:
                return False
            parts = [decode_part(await _manifest.read_bounded(self.store, k), k) for k in keys]
        chunks = [c for p in parts for c in p.chunks]
        m = Manifest(
            version=version, base_version=base.version if base else None, keyframe=keyframe, attempt=attempt,
            table=table.specs, table_digest=table.digest, world_size=world, split_dims=dict(self.sharding.dims),
            chunk_bytes=self.chunk_bytes, chunks=chunks, model_digest=sum(c.plain for c in chunks) & MASK,
            base_model_digest=base.model_digest if base else None, model_bytes=table.nbytes,
            delta_bytes=sum(c.size for c in chunks), key_bytes=sum(c.key_size for c in chunks),
            over_bytes=sum(c.over_size for c in chunks), changes=sum(p.changes for p in parts), aliases=aliases,
        )
        try:
            await commit_manifest(self.store, self.key_prefix, m)
        except AlreadyExists as exc:
            theirs = await read_manifest(self.store, self.key_prefix, version)
            if theirs is None or theirs[0].attempt != attempt:
                raise VersionConflict(
                    f"version {version} of {self.uri!r} was committed by another publisher first: this publish is "
                    f"void (its objects are unreferenced); publish again to make version {version + 1}"
                ) from exc
            return True
        await write_latest(self.store, self.key_prefix, version)
        await self._gc(version, keyframe)
        return True

    async def _gc(self, version: int, keyframe: bool) -> None:
        newest_key = version
        while not keyframe and newest_key > 1:
            newest_key -= 1
            try:
                got = await read_manifest(self.store, self.key_prefix, newest_key)
            except (DataError, RefitError):
                continue  # an unusable version is no keyframe: look further down, so more is kept
            if got is None:
                return
            keyframe = got[0].keyframe
        await collect_garbage(self.store, self.key_prefix, version, newest_key, self.keep_versions)


class _Encode:
    """The chunks of one publish, through the workers: encode off the loop, upload, collect in order."""

    def __init__(self, pub: Publisher, version: int, attempt: str, keyframe: bool, base: Manifest | None,
                 stream: RankStream, new: LocalState, old: LocalState, first: int) -> None:
        self.pub, self.version, self.attempt, self.keyframe, self.base = pub, version, attempt, keyframe, base
        self.stream, self.new, self.old, self.first = stream, new, old, first
        self.entries: list[ChunkEntry] = []

    async def run(self) -> list[ChunkEntry]:
        async def commit(j: int, entry: ChunkEntry) -> None:
            self.entries.append(entry)

        await run_ordered(range(len(self.stream.chunks)), self._stage, commit,
                          workers=self.pub.workers, window=2 * self.pub.workers)
        return self.entries

    async def _stage(self, j: int) -> ChunkEntry:
        entry, objects = await self.pub._cpu(self._encode, j)
        i = self.first + j
        # A fresh random attempt makes every key new by construction, so a plain PUT is safe and
        # cheaper (SeaweedFS takes ~20 ms for a conditional PUT, ~4 ms for a plain one). A shared
        # `session` tag is the user's promise; the condition catches two groups that reuse one
        # before either overwrites the other's chunks.
        shared = self.pub.session is not None
        for what, data in objects.items():
            key = object_key(self.pub.key_prefix, self.version, what, i, self.attempt)
            await self.pub.store.put(key, data, if_none_match=shared)
        return entry

    def _encode(self, j: int) -> tuple[ChunkEntry, dict[str, bytes]]:
        chunk = self.stream.chunks[j]
        new_plan, old_plan = ChunkPlan(chunk, self.stream, self.new), ChunkPlan(chunk, self.stream, self.old)
        new = new_plan.view()
        new = new if new is not None else new_plan.read()
        objects: dict[str, bytes] = {}
        fields: dict[str, object] = {}
        plain = None
        if self.base is not None:
            view = old_plan.view()
            old = view if view is not None else old_plan.read()
            obj, pos, x = codec.encode_xor(old, new, self.pub.level)
            now = new[pos]
            dense = 2 * len(pos) > len(new)  # e.g. fp32 weights under Adam: nearly every word changes
            if dense and not self.keyframe:  # one contiguous hash beats mixing old and new at each position
                plain = new_plan.digest(new)  # (a keyframe keeps the delta's sum: it checks the shadow)
            else:
                was = self.base.chunks[self.first + j].plain
                plain = (was + new_plan.change_sum(pos, now ^ x, now)) & MASK
            if obj is not None:
                objects["chunk"] = obj
                kind = codec.SPARSE_XOR if obj[4] == codec.SPARSE_XOR else codec.DENSE_XOR
                fields.update(kind=kind, size=len(obj), digest=object_digest(obj), changes=len(pos))
                if self.pub.overwrite:
                    over = codec.encode_sparse(codec.SPARSE_SET, len(new), pos, now, self.pub.level)
                    objects["over"] = over
                    fields.update(over_size=len(over), over_digest=object_digest(over))
            if view is not None and dense:
                np.copyto(view, new)  # the unchanged words are equal already: a copy, not a scatter
            elif view is not None:
                view[pos] = now
            else:
                old_plan.write(pos, now, xor=False)
        if self.keyframe:
            full = new_plan.digest(new)
            if plain is not None and plain != full:
                raise DigestMismatch(f"chunk {self.first + j}: the publisher's shadow drifted from version "
                                     f"{self.version - 1} (delta digest {plain:016x}, full {full:016x})")
            plain = full
            key = codec.encode_dense(codec.FULL, np.ascontiguousarray(new), self.pub.level)
            objects["key"] = key
            fields.update(key_size=len(key), key_digest=object_digest(key))
        entry = ChunkEntry(chunk.rank, chunk.offset, chunk.length, chunk.itemsize, plain=plain, **{"kind": 0, **fields})
        return entry, objects


async def copy_state(state: Mapping[str, torch.Tensor], into: dict[str, torch.Tensor],
                     cpu: Callable, piece_bytes: int) -> dict[str, torch.Tensor]:
    """Copy `state` to CPU tensors, reusing `into`'s where name, shape and dtype match.

    Each piece of at most `piece_bytes` is one CPU step through `cpu` (a CpuPolicy): the copy
    never holds the event loop, and a thread is never busy for long with one piece."""
    out = {}
    ties = tied(state)
    for name, t in state.items():
        if name in ties:  # tied tensors stay tied in the copy: one buffer, copied once
            continue
        t = t.detach()
        dst = into.get(name)
        if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
            dst = torch.empty(t.shape, dtype=t.dtype)  # pages are touched by the copy, in a thread
        out[name] = dst
    with unwrap_groups():  # a failed copy is raised as itself, not as a group
        async with anyio.create_task_group() as tg:
            for name, t in state.items():
                if name in ties:
                    continue
                src, dst = t.detach(), out[name]
                if not src.is_contiguous() or src.numel() == 0:
                    tg.start_soon(cpu, dst.copy_, src)
                    continue
                flat_src, flat_dst = src.reshape(-1), dst.view(-1)
                step = max(1, piece_bytes // src.element_size())
                for lo in range(0, src.numel(), step):
                    tg.start_soon(cpu, flat_dst[lo : lo + step].copy_, flat_src[lo : lo + step])
    return {name: out[ties.get(name, name)] for name in state}
