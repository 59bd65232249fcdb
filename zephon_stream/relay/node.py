"""Relay node: copy every committed version of a parent prefix into child prefixes, in order.

    parent ──read each object once, check its blake2b──┬──> child 1   (PUT, or server-side copy)
                                                       └──> child 2   ...
    per version, in order: its objects, then v{N}/MANIFEST (conditional PUT), then LATEST

A child prefix is a refit prefix like any other: a Subscriber, or the next relay of a tree
(root -> region -> zone), reads it without knowing the tree. Objects keep their keys and the
MANIFEST is copied byte for byte, so a version means the same thing at every level.

One sync runs on the refit engine: the objects of the pending versions spread over `workers`
(at most `workers` objects in memory, whatever the model size), and the sequencer commits each
version's MANIFEST once every object before it is in place. With `stream_ahead`, the daemon
polls the next version with a LIST and copies its objects while the publisher is still writing
them (each checked against the MANIFEST once it exists), so the link works during the encode.

- Never a partial version: the MANIFEST is the last write of a version at a child.
- Killed at any point and restarted, the relay lists what a child already holds of a version and
  copies only the rest; objects already there are read back from the child and checked against
  their digests (`verify_existing`), never read again from the parent.
- Racing relays on one child both write the same objects under the same keys; the MANIFEST's
  conditional put decides, and the loser finds the same bytes there.
- A parent object with a wrong size or digest, or a MANIFEST that is malformed or over the size
  limit (never read whole), is written nowhere: the versions before it commit, that version and
  the ones after it wait, the error is counted, and the next sync retries.
- A child whose next version the parent already collected restarts at the parent's newest
  keyframe; when the chain is intact it gets every delta, and its subscribers compose them.
- Versions the parent has collected are collected at the children too (MANIFEST first), or
  under `keep_versions` when that is given, never the child's newest keyframe. Only keys a relay
  writes are deleted: `v{N}/MANIFEST` and the objects a MANIFEST names, right under the child.
- A relay never writes or deletes under its parent: a child that is, holds or lies inside the
  parent or another child, however spelled (`Prefix.location`), is refused before anything runs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import anyio
import anyio.abc
import msgspec

from zephon_stream.errors import (
    AlreadyExists,
    ConfigError,
    ConnectorError,
    DataError,
    DigestMismatch,
    ObjectNotFound,
    RefitError,
    ZephonError,
    root_error,
)
from zephon_stream.connectors import open_store, parse_uri
from zephon_stream.connectors.base import Store
from zephon_stream.connectors.location import Location, location
from zephon_stream.engine.cpu import CpuPolicy, default_threads
from zephon_stream.engine.ordered import resolve_workers, run_ordered
from zephon_stream.refit.manifest import Manifest, object_digest
from zephon_stream.refit.versions import (
    commit_manifest_bytes,
    delete_version,
    find_latest,
    has_version,
    manifest_key,
    object_key,
    parse_object,
    read_manifest_bytes,
    read_manifest_raw,
    relayed_keys,
    version_of,
    version_prefix,
    versions_prefix,
    write_latest,
)

__all__ = ["ChildStatistics", "Prefix", "Relay", "RelayStatistics", "SyncReport", "check_disjoint", "prometheus_text"]

log = logging.getLogger(__name__)
_BAD_MANIFEST = (DataError, RefitError)  # a MANIFEST that is there but unusable: malformed, oversized


class Prefix:
    """A refit prefix and how to reach it: a URI plus its store's options (endpoint, region,
    credentials...), or a key prefix of an open `store`. Options never show in a repr or a log."""

    def __init__(self, uri: str, *, store: Store | None = None, **options: Any) -> None:
        if store is None:
            parse_uri(uri)  # a bad URI fails here, not at the first sync
        self.uri, self.store, self.options = uri, store, options

    @property
    def name(self) -> str:
        """The URI, and the endpoint's host when one is given (never its user info)."""
        endpoint = self.options.get("endpoint_url")
        host = urlparse(str(endpoint)).netloc.rpartition("@")[2] if endpoint else ""
        return f"{self.uri}@{host}" if host else self.uri

    def __repr__(self) -> str:
        return f"Prefix({self.name!r})"

    def _identity(self) -> object:
        """Equal for prefixes one store object can serve (same scheme, bucket, endpoint, credentials)."""
        if self.store is not None:
            return id(self.store)
        scheme, location, _ = parse_uri(self.uri)
        return scheme, location, tuple(sorted((k, repr(v)) for k, v in self.options.items()))

    def location(self) -> Location:
        """Where the prefix's objects live, whatever the spelling (see `connectors.location`)."""
        return location(self.uri, self.options, self.store)


def check_disjoint(parent: Prefix, children: Sequence[Prefix]) -> None:
    """Refuse children that overlap the parent or each other, wherever the spellings differ.

    A relay writes under each child and deletes there (retention), so a child that is, holds or
    sits inside its parent, or another child, would lose data. Raises ConfigError naming both."""
    seen = [(parent, parent.location())]
    for child in children:
        here = child.location()
        for other, there in seen:
            relation = here.relation(there)
            if relation is not None:
                role = "its parent" if other is parent else "another child"
                raise ConfigError(
                    f"relay child {child.name} ({here}) {relation} {role} {other.name} ({there}): a relay "
                    "writes and deletes under its children, so a child must not overlap the parent or "
                    "another child; give each child its own prefix outside the others")
        seen.append((child, here))


class ChildStatistics(msgspec.Struct, frozen=True):
    """One child prefix: where it stands and what the relay wrote to it."""

    name: str
    latest: int
    lag_versions: int
    lag_seconds: float
    versions_relayed: int
    objects_written: int
    objects_skipped: int  # already there and verified (a restart, or a racing relay)
    server_side_copies: int
    bytes_written: int
    manifests_raced: int  # MANIFEST already put by a racing relay, with the same bytes
    versions_collected: int
    errors: int
    last_error: str


class RelayStatistics(msgspec.Struct, frozen=True):
    """The relay node: polls, syncs, parent reads, errors by kind, and every child."""

    parent: str
    parent_latest: int
    healthy: bool  # the last sync met no error
    polls: int
    syncs: int
    versions_relayed: int
    objects_read: int
    bytes_read: int
    objects_ahead: int  # copied while their version was still being published (`stream_ahead`)
    errors: dict[str, int]
    last_error: str
    last_success_unix: float
    children: list[ChildStatistics]


@dataclass
class SyncReport:
    """What one `sync()` did: versions committed per child name, and the errors it met."""

    parent_latest: int = 0
    committed: dict[str, list[int]] = field(default_factory=dict)
    errors: list[ZephonError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass
class _Child:
    prefix: Prefix
    store: Store
    key: str
    same_store: bool  # the parent's store, or a bucket its endpoint and credentials reach: copy server-side
    latest: int | None = None  # None: not known yet (find_latest on the next sync)
    oldest: int | None = None  # None: sweep by listing before the next collection
    failed: ZephonError | None = None  # in this sync: skip the rest
    versions: int = 0
    objects: int = 0
    skipped: int = 0
    copies: int = 0
    bytes: int = 0
    raced: int = 0
    collected: int = 0
    errors: int = 0
    last_error: str = ""


@dataclass
class _Version:
    version: int
    raw: bytes
    manifest: Manifest
    children: list[int]  # indexes of the children that take it
    present: dict[int, dict[str, int]]  # child -> relative key -> size, already at the child
    ready: float = 0.0  # monotonic time its last object was in place at every child


@dataclass(frozen=True, eq=False)
class _Item:
    version: _Version
    rel: str = ""  # "": the version's commit marker
    size: int = 0
    digest: str = ""


class Relay:
    """Copy the versions of `parent` into every child, in order. An async context manager.

    `sync()` copies what is pending now (the `--once` of the CLI); `run()` polls the parent and
    syncs whenever a version appears, until `stop` is set.
    """

    def __init__(
        self,
        parent: Prefix | str,
        children: Sequence[Prefix | str],
        *,
        workers: int | None = None,
        threads: int | None = None,
        poll_interval: float = 1.0,
        keep_versions: int | None = None,
        verify_existing: bool = True,
        stream_ahead: bool = False,
        max_batch: int = 16,
        resync_interval: float = 60.0,
        max_backoff: float = 30.0,
        lanes: int | None = None,
    ) -> None:
        workers = resolve_workers(workers, lanes, default=8, owner="Relay")
        if not children:
            raise RefitError("a relay needs at least one child prefix (--to)")
        if workers < 1 or poll_interval <= 0 or max_batch < 1 or (keep_versions or 1) < 1 or (threads is not None and threads < 1):
            raise RefitError(f"invalid relay settings: workers={workers}, poll_interval={poll_interval}, "
                             f"max_batch={max_batch}, keep_versions={keep_versions}, threads={threads}")
        self.parent = parent if isinstance(parent, Prefix) else Prefix(parent)
        self.child_prefixes = [c if isinstance(c, Prefix) else Prefix(c) for c in children]
        check_disjoint(self.parent, self.child_prefixes)
        self.workers, self.poll_interval, self.keep_versions = workers, poll_interval, keep_versions
        self.verify_existing, self.stream_ahead, self.max_batch = verify_existing, stream_ahead, max_batch
        self.resync_interval, self.max_backoff = resync_interval, max_backoff
        self._cpu = CpuPolicy(default_threads(workers) if threads is None else threads)
        self._stack = AsyncExitStack()
        self._children: list[_Child] = []
        self._manifests: dict[int, tuple[bytes, Manifest]] = {}
        self._is_key: dict[int, bool] = {}  # whether a parent version is a keyframe, down to the newest one
        self._seen: dict[int, float] = {}  # version -> monotonic time the relay first saw it
        self._seen_upto = 0
        self._ahead: dict[str, tuple[int, str, frozenset[int]]] = {}  # key -> size, digest, children written
        self._ahead_count = 0
        self._ahead_group: anyio.abc.TaskGroup | None = None  # set while `run` runs
        self._ahead_limit = anyio.CapacityLimiter(workers)
        self._inflight: set[str] = set()
        self._settled = anyio.Event()
        self._parent_latest = 0
        self._parent_oldest: int | None = None
        self._polls = self._syncs = self._versions = self._objects = self._bytes = 0
        self._errors: dict[str, int] = {}
        self._last_error, self._last_success, self._healthy = "", 0.0, True

    def __repr__(self) -> str:
        return f"Relay({self.parent.name!r} -> {[c.name for c in self.child_prefixes]})"

    async def __aenter__(self) -> Relay:
        opened: dict[object, tuple[Store, Prefix]] = {}
        try:
            for p in [self.parent, *self.child_prefixes]:
                if p.store is not None:
                    store, key = p.store, p.uri
                else:
                    ident = p._identity()
                    if ident in opened:  # same bucket and endpoint: one store, and copies stay server-side
                        store, key = opened[ident][0], parse_uri(p.uri)[2]
                    else:
                        store, key = open_store(p.uri, **p.options)
                        self._stack.push_async_callback(store.aclose)
                    opened[ident] = (store, p)
                if p is self.parent:
                    self._pstore, self._pkey = store, key
                else:
                    copies_from = getattr(store, "copies_from", None)  # S3: another bucket, same endpoint
                    server_side = store is self._pstore or bool(copies_from and copies_from(self._pstore))
                    self._children.append(_Child(p, store, key, same_store=server_side))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    # -- the daemon loop ---------------------------------------------------------------------

    async def run(self, stop: anyio.Event | None = None) -> None:
        """Sync, then poll the parent every `poll_interval` and sync when a version appears,
        after an error (with exponential backoff) and every `resync_interval`. Returns once
        `stop` is set (between syncs; cancel the caller's scope to stop mid-sync)."""
        stop = stop or anyio.Event()
        backoff, due, full_at = self.poll_interval, 0.0, 0.0
        async with anyio.create_task_group() as ahead:  # copies of objects ahead of their MANIFEST
            self._ahead_group = ahead
            while not stop.is_set():
                now = time.monotonic()
                if now >= due or now >= full_at:
                    if now >= full_at:
                        self._forget()
                        full_at = now + self.resync_interval
                    while self._inflight:  # let them land first: no object is read twice
                        await self._settled.wait()
                    report = await self.sync()
                    backoff = self.poll_interval if report.ok else min(2 * backoff, self.max_backoff)
                    due = math.inf if report.ok else time.monotonic() + backoff
                    continue
                with anyio.move_on_after(self.poll_interval):
                    await stop.wait()
                if not stop.is_set() and await self._news():
                    due = 0.0
            self._ahead_group = None
            ahead.cancel_scope.cancel()

    async def _news(self) -> bool:
        """One request: a publisher's next version exists once its MANIFEST does. With
        `stream_ahead`, a LIST of the next version, whose objects are copied as they appear."""
        self._polls += 1
        nxt = self._parent_latest + 1
        try:
            if not self.stream_ahead:
                await self._pstore.head(manifest_key(self._pkey, nxt))
                return True
            infos = await self._pstore.list(version_prefix(self._pkey, nxt))
        except ObjectNotFound:
            return False
        except ConnectorError as exc:
            self._error("poll", exc)
            return False
        if any(o.key == manifest_key(self._pkey, nxt) for o in infos):
            return True
        skip = len(version_prefix(self._pkey, nxt))
        todo = [o.key[len(self._pkey):] for o in infos if parse_object(o.key[skip:]) is not None]
        for rel in todo:
            if rel not in self._ahead and rel not in self._inflight and self._ahead_group is not None:
                if not self._inflight:
                    self._settled = anyio.Event()
                self._inflight.add(rel)
                self._ahead_group.start_soon(self._copy_ahead, rel)
        return False

    async def _copy_ahead(self, rel: str) -> None:
        """Copy one object of a version still being published. It stays invisible at the children
        (no MANIFEST names it yet); its digest is kept, to be checked against the MANIFEST later."""
        try:
            await self._copy_ahead_now(rel)
        finally:
            self._inflight.discard(rel)
            if not self._inflight:
                self._settled.set()

    async def _copy_ahead_now(self, rel: str) -> None:
        async with self._ahead_limit:
            try:
                data = await self._pstore.read(self._pkey + rel)
            except ZephonError as exc:
                log.debug("copy ahead of %s stopped: %s", rel, exc)
                return
            self._objects += 1
            self._bytes += len(data)
            digest = await self._cpu(object_digest, data)
            written: set[int] = set()

            async def write(i: int, c: _Child) -> None:
                try:
                    if c.same_store:
                        await self._server_copy(c, rel)
                    else:
                        await c.store.put(c.key + rel, data, if_none_match=True)
                except ZephonError as exc:  # AlreadyExists included: the sync checks such objects itself
                    log.debug("copy ahead of %s to %s stopped: %s", rel, c.prefix.name, exc)
                    return
                written.add(i)

            async with anyio.create_task_group() as tg:
                for i, c in enumerate(self._children):
                    tg.start_soon(write, i, c)
            self._ahead[rel] = (len(data), digest, frozenset(written))
            self._ahead_count += 1

    def _forget(self) -> None:
        """Drop what the relay believes about the children's newest versions, so the next sync asks."""
        for c in self._children:
            c.latest = None

    # -- one sync ----------------------------------------------------------------------------

    async def sync(self) -> SyncReport:
        """Copy every version pending now to every child; errors are counted and reported, not raised."""
        report = SyncReport(committed={c.prefix.name: [] for c in self._children})
        self._syncs += 1
        for c in self._children:
            c.failed = None
        try:
            try:
                while await self._pass(report):
                    pass
            except BaseExceptionGroup as group:  # from a task group: report its ZephonError alone
                raise root_error(group) from None
        except ZephonError as exc:
            report.errors.append(exc)
            self._error(_kind(exc), exc)
        for c in self._children:
            if c.failed is not None:
                report.errors.append(c.failed)
        self._healthy = report.ok
        if report.ok:
            self._last_success = time.time()
        report.parent_latest = self._parent_latest
        return report

    async def _pass(self, report: SyncReport) -> bool:
        """Copy up to `max_batch` pending versions. Returns whether to go on."""
        latest = await find_latest(self._pstore, self._pkey)
        self._parent_latest = latest
        now = time.monotonic()
        for v in range(self._seen_upto + 1, latest + 1):
            self._seen[v] = now
        self._seen_upto = max(self._seen_upto, latest)
        live = [i for i, c in enumerate(self._children) if c.failed is None]
        async with anyio.create_task_group() as tg:
            for i in live:
                tg.start_soon(self._locate, self._children[i])
        starts = {i: await self._start(self._children[i], latest) for i in live}
        starts = {i: s for i, s in starts.items() if s is not None}
        if starts:
            first = min(starts.values())
            plan, stop = await self._plan(first, min(latest, first + self.max_batch - 1), starts)
            await self._copy(plan, report)
            if stop is not None:
                raise stop
        await self._collect_all()
        self._prune()
        return bool(starts) and any(c.failed is None and (c.latest or 0) < latest for c in self._children)

    async def _locate(self, c: _Child) -> None:
        """Find the child's newest version when not known, and check it is the parent's version."""
        if c.latest is not None:
            return
        c.latest = latest = await self._child_call(c, find_latest(c.store, c.key))
        if latest and latest > self._parent_latest:  # a racing relay may have copied a newer one
            self._parent_latest = max(self._parent_latest, await find_latest(self._pstore, self._pkey))
        if not latest or latest > self._parent_latest:
            if latest and latest > self._parent_latest:
                self._fail(c, RefitError(
                    f"child {c.prefix.name} is at version {latest}, ahead of its parent "
                    f"{self.parent.name} at {self._parent_latest}: is it fed by another tree?"))
            return
        try:
            theirs = await read_manifest_bytes(c.store, c.key, latest)
        except ObjectNotFound:
            return  # collected under us: find_latest again next time
        except ZephonError as exc:  # unreachable, or oversized: this child's problem alone
            self._fail(c, exc)
            return
        ours = await self._manifest(latest)
        if ours is not None and ours[0] != theirs:
            self._fail(c, RefitError(f"version {latest} at child {c.prefix.name} is not the parent's version "
                                     f"{latest} ({self.parent.name}): the child is fed by another tree; "
                                     "give it its own prefix"))

    async def _start(self, c: _Child, latest: int) -> int | None:
        """The first version the child takes: the next one, or the parent's newest keyframe."""
        have = c.latest or 0
        if c.failed is not None or have >= latest:
            return None
        try:
            if await self._manifest(have + 1) is not None:
                return have + 1  # the parent's versions are contiguous: the chain have+1..latest is intact
        except _BAD_MANIFEST:
            return have + 1  # there but bad: `_plan` stops at it and reports it
        key = await self._newest_keyframe(latest)
        log.warning("child behind the parent's garbage collection: restarting it at the newest keyframe",
                    extra={"event": "child_jump", "child": c.prefix.name, "child_latest": have,
                           "keyframe": key})
        c.oldest = None  # sweep the versions left below the gap
        return key

    async def _newest_keyframe(self, latest: int) -> int:
        """The newest keyframe at or below `latest` whose MANIFEST is good (a bad one above it
        waits in `_plan`, after the good versions before it)."""
        bad: ZephonError | None = None
        for v in range(latest, 0, -1):
            if v not in self._is_key:
                try:
                    got = await self._manifest(v)
                except _BAD_MANIFEST as exc:
                    bad = bad or exc
                    continue
                if got is None:
                    break
                self._is_key[v] = got[1].keyframe
            if self._is_key[v]:
                for old in [k for k in self._is_key if k < v]:
                    del self._is_key[old]
                return v
        if bad is not None:
            raise bad
        raise RefitError(f"no keyframe at or below version {latest} of {self.parent.name}: the parent "
                         "collected it (or its publisher is mid-collection); retrying later")

    async def _manifest(self, version: int) -> tuple[bytes, Manifest] | None:
        """The parent's raw and checked MANIFEST of `version` (cached), or None if absent."""
        if version < 1:
            return None
        if version not in self._manifests:
            got = await read_manifest_raw(self._pstore, self._pkey, version)
            if got is None:
                return None
            self._manifests[version] = got[:2]
        return self._manifests[version]

    async def _plan(self, first: int, last: int,
                    starts: dict[int, int]) -> tuple[list[_Version], ZephonError | None]:
        """The versions first..last up to the first whose MANIFEST is bad or gone, and that error:
        like a bad object, a bad MANIFEST stops the copy at its version, after the ones before it."""
        plan: list[_Version] = []
        stop: ZephonError | None = None
        for v in range(first, last + 1):
            try:
                got = await self._manifest(v)
            except _BAD_MANIFEST as exc:
                stop = exc
                break
            if got is None:
                stop = ObjectNotFound(f"version {v} of {self.parent.name} disappeared while relaying it "
                                      "(collected by its publisher?); retrying")
                break
            takers = [i for i, s in starts.items() if s <= v]
            plan.append(_Version(v, got[0], got[1], takers, {}))
        async with anyio.create_task_group() as tg:
            for ver in plan:
                for i in ver.children:
                    tg.start_soon(self._list_present, ver, i)
        return plan, stop

    async def _list_present(self, ver: _Version, i: int) -> None:
        c = self._children[i]
        infos = await self._child_call(c, c.store.list(version_prefix(c.key, ver.version)))
        ver.present[i] = {o.key[len(c.key):]: o.size for o in infos or ()}

    async def _copy(self, plan: list[_Version], report: SyncReport) -> None:
        items: list[_Item] = []
        for ver in plan:
            m = ver.manifest
            for i, ch in enumerate(m.chunks):
                for what, size, digest in (("chunk", ch.size, ch.digest), ("key", ch.key_size, ch.key_digest),
                                           ("over", ch.over_size, ch.over_digest)):
                    if size:
                        items.append(_Item(ver, object_key("", ver.version, what, i, m.attempt), size, digest))
            items.append(_Item(ver))

        async def commit(item: _Item, _: None) -> None:
            if not item.rel:
                await self._commit(item.version, report)

        # a bad object stops the copy at its version, after the versions before it are committed
        await run_ordered(items, self._stage, commit, workers=self.workers, window=2 * self.workers, defer_errors=True)

    # -- one object, on a lane ----------------------------------------------------------------

    async def _stage(self, item: _Item) -> None:
        if not item.rel:
            return
        todo: list[tuple[_Child, bool]] = []
        for i in item.version.children:
            c = self._children[i]
            state = await self._at_child(c, item, item.version.present.get(i, {}))
            if c.failed is None and state != "ok":
                todo.append((c, state == "bad"))
        if not todo:
            return
        data = await self._read_parent(item)
        async with anyio.create_task_group() as tg:
            for c, replace in todo:
                tg.start_soon(self._write, c, item, data, replace)

    async def _at_child(self, c: _Child, item: _Item, present: dict[str, int]) -> str:
        """"ok" (there and verified), "absent", or "bad" (there, but not these bytes: replace it)."""
        if c.failed is not None or item.rel not in present:
            return "absent"
        if present[item.rel] != item.size:
            return "bad"
        ahead = self._ahead.get(item.rel)
        if ahead is not None and self._children.index(c) in ahead[2]:
            if ahead[:2] != (item.size, item.digest):
                return "bad"
        elif self.verify_existing:
            data = await self._child_call(c, c.store.read(c.key + item.rel))
            if data is None or not await self._verified(data, item):
                return "bad"
        c.skipped += 1
        return "ok"

    async def _verified(self, data: bytes, item: _Item) -> bool:
        if len(data) != item.size:
            return False
        return await self._cpu(object_digest, data) == item.digest

    async def _read_parent(self, item: _Item) -> bytes:
        """The object from the parent, its size and digest checked; one re-read on a mismatch
        (a flipped bit in flight), then the error: the version is not propagated."""
        key = self._pkey + item.rel
        for attempt in (1, 2):
            data = await self._pstore.read(key)
            self._objects += 1
            self._bytes += len(data)
            if await self._verified(data, item):
                return data
        if len(data) != item.size:
            raise DataError(f"{key} at the parent is {len(data)} bytes, its MANIFEST says {item.size} "
                            "(truncated?): version not relayed", key=key, offset=len(data))
        raise DigestMismatch(f"{key} at the parent has blake2b {object_digest(data)}, its MANIFEST says "
                             f"{item.digest}: corrupt object, version {item.version.version} not relayed")

    async def _server_copy(self, c: _Child, rel: str) -> None:
        if c.store is self._pstore:
            await c.store.copy(self._pkey + rel, c.key + rel)
        else:  # another bucket on the parent's endpoint, with the same credentials
            await c.store.copy(self._pkey + rel, c.key + rel, src_bucket=self._pstore.bucket)  # type: ignore[call-arg,attr-defined]

    async def _write(self, c: _Child, item: _Item, data: bytes, replace: bool) -> None:
        if c.failed is not None:
            return
        try:
            if c.same_store:
                await self._server_copy(c, item.rel)
                c.copies += 1
            else:
                await c.store.put(c.key + item.rel, data, if_none_match=not replace)
                c.bytes += len(data)
            c.objects += 1
        except AlreadyExists:
            c.skipped += 1  # a racing relay wrote it, after checking the same digest
        except ConnectorError as exc:
            self._fail(c, exc)

    # -- the sequencer: one version at a time, in order ---------------------------------------

    async def _commit(self, ver: _Version, report: SyncReport) -> None:
        ver.ready = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i in ver.children:
                if self._children[i].failed is None:
                    tg.start_soon(self._commit_child, self._children[i], ver, report)

    async def _commit_child(self, c: _Child, ver: _Version, report: SyncReport) -> None:
        try:
            try:
                await commit_manifest_bytes(c.store, c.key, ver.version, ver.raw)
            except AlreadyExists:
                if await read_manifest_bytes(c.store, c.key, ver.version) != ver.raw:
                    raise RefitError(f"{c.prefix.name} already has a different version {ver.version}: "
                                     "another tree feeds this child; give each tree its own prefix") from None
                c.raced += 1
            visible = time.monotonic()
            await write_latest(c.store, c.key, ver.version)
        except ZephonError as exc:
            self._fail(c, exc)
            return
        c.latest = ver.version
        c.versions += 1
        self._versions += 1
        report.committed[c.prefix.name].append(ver.version)
        seen, now = self._seen.get(ver.version), time.monotonic()
        log.info("version relayed", extra={
            "event": "version_committed", "child": c.prefix.name, "version": ver.version,
            "keyframe": ver.manifest.keyframe, "lag_s": round(now - seen, 6) if seen else None,
            "copy_s": round(ver.ready - seen, 6) if seen else None, "commit_s": round(now - ver.ready, 6),
            "manifest_s": round(visible - ver.ready, 6),
        })

    # -- garbage collection, mirrored ----------------------------------------------------------

    async def _collect_all(self) -> None:
        if self.keep_versions is None:
            await self._find_parent_oldest()
        for c in self._children:
            if c.failed is None and c.latest and c.latest == self._parent_latest:  # caught up: mirror it
                try:
                    await self._collect(c)
                except ZephonError as exc:
                    self._fail(c, exc)

    async def _find_parent_oldest(self) -> None:
        """The parent's oldest version: versions are contiguous, so probe up from the last one known."""
        latest = self._parent_latest
        lo = self._parent_oldest or 1
        if self._parent_oldest is None:  # first time: binary search for the lowest that exists
            hi = latest
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if await self._exists(mid) else (mid + 1, hi)
        while lo < latest and not await self._exists(lo):
            lo += 1
        self._parent_oldest = lo

    async def _exists(self, version: int) -> bool:
        return await has_version(self._pstore, self._pkey, version)

    async def _collect(self, c: _Child) -> None:
        latest = c.latest or 0
        key = await self._newest_keyframe(latest)
        if self.keep_versions is not None:
            floor = min(key, latest - self.keep_versions + 1)
        else:
            floor = min(key, self._parent_oldest or 1)
        if c.oldest is None:
            await self._sweep(c, floor)
        elif c.oldest < floor:
            for v in range(c.oldest, floor):
                listed = await c.store.list(version_prefix(c.key, v))
                await self._delete_version(c, v, relayed_keys(c.key, listed).get(v, []))
        c.oldest = max(c.oldest or 1, floor)

    async def _sweep(self, c: _Child, floor: int) -> None:
        """Every relayed object below `floor`, found by listing (after a restart or a jump: versions
        may have gaps, and a crashed collection may have left objects without a MANIFEST)."""
        doomed = relayed_keys(c.key, await c.store.list(versions_prefix(c.key)))
        for v in sorted(v for v in doomed if v < floor):
            await self._delete_version(c, v, doomed[v])
        c.oldest = floor

    async def _delete_version(self, c: _Child, version: int, keys: list[str]) -> None:
        await delete_version(c.store, c.key, version, keys)
        if keys:
            c.collected += 1
            log.info("version collected", extra={"event": "version_collected", "child": c.prefix.name,
                                                 "version": version})

    def _prune(self) -> None:
        floor = min((c.latest or 0 for c in self._children), default=0)
        for v in [v for v in self._manifests if v < floor]:
            del self._manifests[v]
        for v in [v for v in self._seen if v <= floor]:
            del self._seen[v]
        latest = self._parent_latest
        self._ahead = {k: v for k, v in self._ahead.items() if (version_of(k) or 0) > latest}

    # -- errors and statistics -----------------------------------------------------------------

    async def _child_call(self, c: _Child, call: Any) -> Any:
        try:
            return await call
        except ConnectorError as exc:
            self._fail(c, exc)
            return None

    def _fail(self, c: _Child, exc: ZephonError) -> None:
        if c.failed is None:
            c.failed = exc
            c.errors += 1
            c.last_error = str(exc)
            c.latest = None  # ask it again next time
            self._error(f"child:{_kind(exc)}", exc, child=c.prefix.name)

    def _error(self, kind: str, exc: BaseException, **fields: Any) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + 1
        self._last_error = str(exc)
        log.error("%s", exc, extra={"event": "error", "kind": kind, **fields})

    def statistics(self) -> RelayStatistics:
        now = time.monotonic()
        children = []
        for c in self._children:
            have = c.latest or 0
            lag = max(0, self._parent_latest - have)
            seen = self._seen.get(have + 1) if lag else None
            children.append(ChildStatistics(
                c.prefix.name, have, lag, round(now - seen, 6) if seen else 0.0, c.versions, c.objects,
                c.skipped, c.copies, c.bytes, c.raced, c.collected, c.errors, c.last_error,
            ))
        return RelayStatistics(self.parent.name, self._parent_latest, self._healthy, self._polls, self._syncs,
                               self._versions, self._objects, self._bytes, self._ahead_count,
                               dict(self._errors), self._last_error, self._last_success, children)


def _kind(exc: BaseException) -> str:
    return {DigestMismatch: "digest", DataError: "data", ObjectNotFound: "not_found"}.get(
        type(exc), "connector" if isinstance(exc, ConnectorError) else "refit")


_METRICS = [
    ("versions_relayed_total", "counter", "versions committed at a child", "versions_relayed"),
    ("objects_written_total", "counter", "objects written to a child (PUT or copy)", "objects_written"),
    ("objects_skipped_total", "counter", "objects already at a child and verified", "objects_skipped"),
    ("server_side_copies_total", "counter", "objects copied inside one store", "server_side_copies"),
    ("bytes_written_total", "counter", "object bytes uploaded to a child", "bytes_written"),
    ("manifests_raced_total", "counter", "MANIFESTs a racing relay put first", "manifests_raced"),
    ("versions_collected_total", "counter", "versions deleted at a child", "versions_collected"),
    ("child_errors_total", "counter", "errors writing to a child", "errors"),
    ("child_latest_version", "gauge", "newest version committed at a child", "latest"),
    ("lag_versions", "gauge", "versions the child is behind its parent", "lag_versions"),
    ("lag_seconds", "gauge", "age of the oldest version the child still lacks", "lag_seconds"),
]


def prometheus_text(s: RelayStatistics) -> str:
    """The statistics in the Prometheus text exposition format (version 0.0.4)."""
    out: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        out.extend([f"# HELP zephon_relay_{name} {doc}", f"# TYPE zephon_relay_{name} {kind}"])
        out.extend(f"zephon_relay_{name}{labels} {_number(value)}" for labels, value in samples)

    parent = f'{{parent="{_label(s.parent)}"}}'
    metric("up", "gauge", "1 when the last sync met no error", [("", int(s.healthy))])
    metric("parent_latest_version", "gauge", "newest version at the parent", [(parent, s.parent_latest)])
    metric("polls_total", "counter", "polls of the parent for a new version", [("", s.polls)])
    metric("syncs_total", "counter", "syncs run", [("", s.syncs)])
    metric("objects_read_total", "counter", "objects read from the parent", [("", s.objects_read)])
    metric("bytes_read_total", "counter", "object bytes read from the parent", [("", s.bytes_read)])
    metric("objects_ahead_total", "counter", "objects copied while their version was being published",
           [("", s.objects_ahead)])
    metric("errors_total", "counter", "errors by kind",
           [(f'{{kind="{_label(k)}"}}', n) for k, n in sorted(s.errors.items())])
    metric("last_success_timestamp_seconds", "gauge", "unix time of the last sync without errors",
           [("", s.last_success_unix)])
    for name, kind, doc, attr in _METRICS:
        metric(name, kind, doc, [(f'{{child="{_label(c.name)}"}}', getattr(c, attr)) for c in s.children])
    return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
