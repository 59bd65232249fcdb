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

The node orchestrates; each job has its module: `prefix` (prefixes, overlap, stores), `parent`
(reading the parent), `child` (a child's state and writes), `copy` (one sync's copy), `ahead`
(stream-ahead), `retention` (collection at the children), `metrics` (counters, statistics).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio

from zephon_stream.engine.cpu import CpuPolicy, default_threads
from zephon_stream.engine.ordered import resolve_workers
from zephon_stream.errors import (
    BucketNotFound,
    ConfigError,
    ConnectorError,
    ObjectNotFound,
    RefitError,
    ZephonError,
    root_error,
)
from zephon_stream.refit.manifest import Manifest, decode_manifest
from zephon_stream.refit.versions import find_latest, manifest_key, read_manifest_bytes, version_prefix
from zephon_stream.relay.ahead import StreamAhead
from zephon_stream.relay.child import Child
from zephon_stream.relay.copy import Copier, Version
from zephon_stream.relay.metrics import RelayStatistics, SyncReport, Tally, error_kind
from zephon_stream.relay.parent import BAD_MANIFEST, Parent
from zephon_stream.relay.prefix import Prefix, check_disjoint, open_stores
from zephon_stream.relay.retention import Retention

__all__ = ["Relay", "is_mistake"]

log = logging.getLogger(__name__)

_GONE_CHECK_S = 1.0  # how often an idle poll also checks that the newest version seen is still there
#: A poll of the parent unanswered this long (its requests retrying, up to retry_deadline) makes the relay
#: unhealthy until one is answered: /healthz said "ok" for minutes while the parent was down.
POLL_STALL_S = 15.0


@dataclass(frozen=True)
class _Jobs:
    """What an open relay works with, made on entry once the stores are open."""

    parent: Parent
    children: list[Child]
    ahead: StreamAhead
    copier: Copier
    retention: Retention



def is_mistake(exc: BaseException) -> bool:
    """Whether a relay error is a mistake in its settings that retrying cannot mend: a ConfigError
    (a profile that no AWS file holds, an option a store refuses) or a bucket that does not exist
    (its name, endpoint or region is wrong; a missing prefix is not one: a publisher makes it)."""
    return isinstance(exc, (ConfigError, BucketNotFound))

class Relay:
    """Copy the versions of `parent` into every child, in order. An async context manager.

    `sync()` copies what is pending now (the `--once` of the CLI); `run()` polls the parent and
    syncs whenever a version appears, until `stop` is set. `workers` objects are copied at once
    (`lanes` is its deprecated name); `threads` hash them (default: one per worker, at most one
    per core).
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
        wrong = [f"{name}={value} (must be {want})" for name, value, ok, want in (
            ("workers", workers, workers >= 1, ">= 1"), ("poll_interval", poll_interval, poll_interval > 0, "> 0"),
            ("max_batch", max_batch, max_batch >= 1, ">= 1"),
            ("keep_versions", keep_versions, keep_versions is None or keep_versions >= 1,
             ">= 1 (unset: the parent's retention)"),
            ("threads", threads, threads is None or threads >= 1, ">= 1")) if not ok]
        if wrong:  # each wrong one, named (all five were listed); keep_versions 0 mirrored the parent, silently
            raise RefitError(f"invalid relay settings: {', '.join(wrong)}")
        self.parent = parent if isinstance(parent, Prefix) else Prefix(parent)
        self.child_prefixes = [c if isinstance(c, Prefix) else Prefix(c) for c in children]
        check_disjoint(self.parent, self.child_prefixes)
        self.workers, self.poll_interval, self.keep_versions = workers, poll_interval, keep_versions
        self.verify_existing, self.stream_ahead, self.max_batch = verify_existing, stream_ahead, max_batch
        self.resync_interval, self.max_backoff = resync_interval, max_backoff
        self._cpu = CpuPolicy(default_threads(workers) if threads is None else threads)
        self._tally = Tally()
        self._stack = AsyncExitStack()
        self._open: _Jobs | None = None
        self._gone_checked = -math.inf  # when an idle poll last checked the newest version seen (see `_news`)
        self._polling_since: float | None = None  # when the poll under way began (None: none is)
        self._poll_failed = False  # the last poll failed: unhealthy until one is answered (or a sync succeeds)

    def __repr__(self) -> str:
        return f"Relay({self.parent.name!r} -> {[c.name for c in self.child_prefixes]})"

    async def __aenter__(self) -> Relay:
        try:
            (pstore, pkey), *ends = open_stores([self.parent, *self.child_prefixes], self._stack)
        except BaseException:
            await self._stack.aclose()
            raise
        parent = Parent(self.parent, pstore, pkey, self._cpu, self._tally)
        children = [Child(p, store, key, parent, self._tally)
                    for p, (store, key) in zip(self.child_prefixes, ends, strict=True)]
        ahead = StreamAhead(parent, children, self._tally, self.workers)
        copier = Copier(parent, ahead, self._tally, verify_existing=self.verify_existing)
        self._open = _Jobs(parent, children, ahead, copier, Retention(parent, self.keep_versions))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    @property
    def _jobs(self) -> _Jobs:
        if self._open is None:
            raise RefitError(f"{self!r} is not open: use `async with Relay(...) as relay:`")
        return self._open

    # -- the daemon loop ---------------------------------------------------------------------

    async def run(self, stop: anyio.Event | None = None) -> None:
        """Sync, then poll the parent every `poll_interval` and sync when a version appears,
        after an error (with exponential backoff) and every `resync_interval`. Returns once
        `stop` is set (between syncs; cancel the caller's scope to stop mid-sync).

        Errors are counted and retried, except a mistake in the first sync (`is_mistake`: a profile
        that no AWS file holds, an option a store refuses, a bucket that does not exist): it is
        raised, since retrying cannot mend it and a relay that starts misconfigured should fail its
        deployment, not run unhealthy."""
        stop = stop or anyio.Event()
        ahead = self._jobs.ahead
        backoff, due, full_at, first = self.poll_interval, 0.0, 0.0, True
        async with anyio.create_task_group() as group:  # copies of objects ahead of their MANIFEST
            ahead.attach(group)
            while not stop.is_set():
                now = time.monotonic()
                if now >= due or now >= full_at:
                    if now >= full_at:
                        self.forget()
                        full_at = now + self.resync_interval
                    await ahead.settle()  # let them land first: no object is read twice
                    report = await self.sync()
                    if first and (fatal := [e for e in report.errors if is_mistake(e)]):
                        raise fatal[0]
                    first = False
                    backoff = self.poll_interval if report.ok else min(2 * backoff, self.max_backoff)
                    due = math.inf if report.ok else time.monotonic() + backoff
                    continue
                with anyio.move_on_after(self.poll_interval):
                    await stop.wait()
                if not stop.is_set() and await _unless_set(stop, self._news):
                    due = 0.0
            ahead.attach(None)
            group.cancel_scope.cancel()

    async def _news(self) -> bool:
        """One request: a publisher's next version exists once its MANIFEST does. With
        `stream_ahead`, a LIST of the next version, whose objects are copied as they appear.

        Without a next version, at most once every `_GONE_CHECK_S` seconds, a second request: is
        the parent's newest version as the relay last saw it still there? A publisher that
        published and collected past it between two polls (fast versions, a small `keep_versions`)
        has taken the next one away too, and only a sync (LATEST) finds the newer ones: the
        children jump to its newest keyframe within a second, not at the next resync
        (`resync_interval`, a minute), which a relay polling for `latest + 1` alone waited for,
        saying it was healthy and had no lag. So is a parent started again, once its new run has
        collected the version of that number."""
        self._tally.polls += 1
        self._polling_since = time.monotonic()
        try:
            news = await self._poll()
        except ConnectorError as exc:
            self._poll_failed = True  # the parent is unreachable: say so now, not at the next resync
            self._tally.error("poll", exc)
            return False
        finally:
            self._polling_since = None
        self._poll_failed = False
        return news

    async def _poll(self) -> bool:
        parent, ahead = self._jobs.parent, self._jobs.ahead
        if await (ahead.poll(parent.latest + 1) if self.stream_ahead else parent.exists(parent.latest + 1)):
            return True
        now = time.monotonic()
        if parent.latest == 0 or now < self._gone_checked + _GONE_CHECK_S:
            return False
        self._gone_checked = now  # at most once a second: a relay polling every 10 ms makes 1% more requests
        return not await parent.exists(parent.latest)

    def forget(self) -> None:
        """Drop what the relay believes about the children's newest versions, so the next sync asks."""
        for c in self._open.children if self._open is not None else ():
            c.latest = c.digest = None

    # -- one sync ----------------------------------------------------------------------------

    async def sync(self) -> SyncReport:
        """Copy every version pending now to every child; errors are counted and reported, not raised."""
        jobs = self._jobs
        report = SyncReport(committed={c.name: [] for c in jobs.children})
        self._tally.syncs += 1
        for c in jobs.children:
            c.failed = None
        try:
            while True:
                try:
                    if not await self._pass(report):
                        break
                except BaseException as exc:
                    err = root_error(exc) if isinstance(exc, BaseExceptionGroup) else exc  # a task group's
                    if not isinstance(err, ZephonError) or not await self._jumps_broken():
                        if err is exc:
                            raise
                        raise err from None  # from a task group: its error alone
                    report.errors.append(err)  # counted, and the next pass restarts past it (a cron's --once too)
                    self._tally.error(error_kind(err), err)
        except ZephonError as exc:
            report.errors.append(exc)
            self._tally.error(error_kind(exc), exc)
        report.errors += [c.failed for c in jobs.children if c.failed is not None]
        self._tally.healthy = report.ok
        if report.ok:
            self._tally.last_success = time.time()
            self._poll_failed = False
        report.parent_latest = jobs.parent.latest
        return report

    async def _pass(self, report: SyncReport) -> bool:
        """Copy up to `max_batch` pending versions. Returns whether to go on."""
        jobs = self._jobs
        parent, children = jobs.parent, jobs.children
        latest = await parent.refresh()
        live = [c for c in children if c.failed is None]
        async with anyio.create_task_group() as tg:
            for c in live:
                tg.start_soon(self._locate, c)
        starts = {c: await self._start(c, latest) for c in live}
        starts = {c: s for c, s in starts.items() if s is not None}
        if starts:
            first = min(starts.values())
            plan, stop = await self._plan(first, min(latest, first + self.max_batch - 1), starts)
            await jobs.copier.copy(plan, report, self.workers)
            if stop is not None:
                raise stop
        await jobs.retention.collect(children)
        parent.forget_below(min((c.latest or 0 for c in children), default=0))
        jobs.ahead.forget_upto(parent.latest)
        return bool(starts) and any(c.failed is None and (c.latest or 0) < latest for c in children)

    async def _jumps_broken(self) -> bool:
        """Whether a child waits at a version the parent holds a corrupt object of (`Parent.broken`),
        with a keyframe after it: the next pass restarts the child there (`_start`)."""
        parent = self._jobs.parent
        waiting = [c.latest + 1 for c in self._jobs.children if c.failed is None and c.latest is not None]
        stuck = [v for v in waiting if v in parent.broken]
        return bool(stuck) and await parent.newest_keyframe(parent.latest) > min(stuck)

    async def _locate(self, c: Child) -> None:
        """Find the child's newest version when not known, and check it is the parent's version."""
        if c.latest is not None:
            return
        parent = self._jobs.parent
        c.latest = latest = await c.call(find_latest(c.store, c.key))
        if latest and latest > parent.latest:  # a racing relay may have copied a newer one
            await parent.catch_up()
        if not latest or latest > parent.latest:
            if latest and latest > parent.latest:
                c.fail(RefitError(f"child {c.name} is at version {latest}, ahead of its parent "
                                  f"{parent.name} at {parent.latest}: the parent was started again (a trainer "
                                  "restarted on a wiped prefix), or another tree feeds the child; to follow the "
                                  "parent's new run, empty the child prefix"))
            return
        try:
            theirs = await read_manifest_bytes(c.store, c.key, latest)
        except ObjectNotFound:
            return  # collected under us: find_latest again next time
        except ZephonError as exc:  # unreachable, or oversized: this child's problem alone
            c.fail(exc)
            return
        try:
            c.digest = decode_manifest(theirs, manifest_key(c.key, latest))[0].model_digest  # checked in `_start`
        except BAD_MANIFEST:
            c.digest = None
        ours = await parent.manifest(latest)
        if ours is not None and ours[0] != theirs:
            c.fail(RefitError(f"version {latest} at child {c.name} is not the parent's version {latest} "
                              f"({parent.name}): the parent was started again (a trainer restarted on a wiped "
                              "prefix), or another tree feeds the child; to follow the parent's new run, empty "
                              "the child prefix, else give each tree its own prefix"))

    def _continues(self, c: Child, after: Manifest) -> bool:
        """Whether the parent's version after the child's newest builds on the child's model (a delta
        from it, as far as the digests say). Checked at every pass, not only when the child is looked
        up: a daemon knows its child's version, and the parent may have started again since, and
        collected the version of that number (then nothing else tells)."""
        if c.digest is None or c.latest is None or not after.follows_another(c.latest, c.digest):
            return True
        c.fail(RefitError(f"version {after.version} at the parent {self._jobs.parent.name} is a delta from "
                          f"another model (digest {after.base_model_digest:016x}) than version {c.latest} at child "
                          f"{c.name} ({c.digest:016x}): the parent was started again (a trainer restarted on a "
                          "wiped prefix), or another tree feeds the child; to follow the parent's new run, empty "
                          "the child prefix, else give each tree its own prefix"))
        return False

    async def _start(self, c: Child, latest: int) -> int | None:
        """The first version the child takes: the next one, or the parent's newest keyframe."""
        parent = self._jobs.parent
        have = c.latest or 0
        if c.failed is not None or have >= latest:
            return None
        if have + 1 in parent.broken:  # an object of it is corrupt at the parent: a keyframe after it is the way on
            key = await parent.newest_keyframe(latest)
            if key <= have + 1:
                return have + 1  # none yet: `_plan` stops at it and reports it, until the publisher writes one
            log.warning("version %d has a corrupt object at the parent and is never relayed: restarting child %s at "
                        "the keyframe after it, version %d", have + 1, c.name, key,
                        extra={"event": "child_jump", "child": c.name, "child_latest": have, "keyframe": key})
            c.oldest = None
            return key
        try:
            if (after := await parent.manifest(have + 1)) is not None:
                # the parent's versions are contiguous: the chain have+1..latest is intact, if it goes on from here
                return have + 1 if not have or self._continues(c, after[1]) else None
        except BAD_MANIFEST:
            return have + 1  # there but bad: `_plan` stops at it and reports it
        key = await parent.newest_keyframe(latest)
        if have:  # an empty child starting at the keyframe is every new child's first sync: not a warning
            log.warning("child behind the parent's garbage collection: restarting it at the newest keyframe",
                        extra={"event": "child_jump", "child": c.name, "child_latest": have, "keyframe": key})
        else:
            log.info("new child: starting it at the parent's newest keyframe",
                     extra={"event": "child_start", "child": c.name, "keyframe": key})
        c.oldest = None  # sweep the versions left below the gap
        return key

    async def _plan(self, first: int, last: int,
                    starts: dict[Child, int]) -> tuple[list[Version], ZephonError | None]:
        """The versions first..last up to the first whose MANIFEST is bad or gone, and that error:
        like a bad object, a bad MANIFEST stops the copy at its version, after the ones before it."""
        parent = self._jobs.parent
        plan: list[Version] = []
        stop: ZephonError | None = None
        for v in range(first, last + 1):
            try:
                got = await parent.manifest(v)
            except BAD_MANIFEST as exc:
                stop = exc
                break
            if got is None:
                stop = ObjectNotFound(f"version {v} of {parent.name} disappeared while relaying it "
                                      "(collected by its publisher?); retrying")
                break
            plan.append(Version(v, got[0], got[1], [c for c, s in starts.items() if s <= v]))
        async with anyio.create_task_group() as tg:
            for ver in plan:
                for c in ver.children:
                    tg.start_soon(self._list_present, ver, c)
        return plan, stop

    @staticmethod
    async def _list_present(ver: Version, c: Child) -> None:
        infos = await c.call(c.store.list(version_prefix(c.key, ver.version)))
        ver.present[c] = {o.key[len(c.key):]: o.size for o in infos or ()}

    # -- statistics --------------------------------------------------------------------------

    def statistics(self) -> RelayStatistics:
        """The relay's counters now. `healthy`: the last sync met no error, and the parent answers its
        polls (the last one did not fail, and none has waited `POLL_STALL_S` for an answer)."""
        t, now, jobs = self._tally, time.monotonic(), self._open
        latest = jobs.parent.latest if jobs is not None else 0
        children = [c.statistics(jobs.parent, now) for c in jobs.children] if jobs is not None else []
        waited = now - self._polling_since if self._polling_since is not None else 0.0
        stalled = waited > POLL_STALL_S
        last_error = (f"the parent {self.parent.name} has not answered a poll for {waited:.0f} s (retrying)"
                      if stalled else t.last_error)
        return RelayStatistics(self.parent.name, latest, t.healthy and not self._poll_failed and not stalled,
                               t.polls, t.syncs, t.versions, t.objects, t.bytes, t.ahead, dict(t.errors), last_error,
                               t.last_success, children)


async def _unless_set(stop: anyio.Event, call: Callable[[], Awaitable[bool]]) -> bool | None:
    """`await call()`, cancelled (None) once `stop` is set: a poll reads only, and one retrying an
    unreachable parent (up to retry_deadline) held a SIGTERM for the whole grace."""
    result = None
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        result = await call()
        tg.cancel_scope.cancel()
    return result
