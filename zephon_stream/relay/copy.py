"""One sync's copy of a plan of versions: objects staged on workers, versions committed in order.

    items:  v7 chunk-0 .. v7 key-3, v7 (commit), v8 chunk-0 .. v8 (commit), ...
    stage (workers, any order): what does each child hold of the object? read it from the parent
                                once, checked, only if some child lacks it; write it to those
    commit (sequencer, in order): v{N}/MANIFEST at each child (conditional put), then LATEST

At most `2 * workers` objects are between the feeder and their commit, whatever the model size.
A stage error (a corrupt or truncated parent object) is held until the sequencer reaches it
(`run_ordered(defer_errors=True)`): the versions before it commit, that one and the ones after it
wait. A child's store error fails that child alone for the rest of the sync.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import anyio

from zephon_stream.engine.ordered import run_ordered
from zephon_stream.errors import AlreadyExists, RefitError, ZephonError
from zephon_stream.refit.manifest import Manifest
from zephon_stream.refit.versions import (
    commit_manifest_bytes,
    object_key,
    read_manifest_bytes,
    write_latest,
)
from zephon_stream.relay.ahead import StreamAhead
from zephon_stream.relay.child import Child
from zephon_stream.relay.metrics import SyncReport, Tally
from zephon_stream.relay.parent import Parent, verified

__all__ = ["Copier", "Item", "Version", "items_of"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Version:
    """A version to copy: its MANIFEST as stored and as checked, the children that take it, and
    what each of them holds of it already (relative key -> size)."""

    version: int
    raw: bytes
    manifest: Manifest
    children: list[Child]
    present: dict[Child, dict[str, int]] = field(default_factory=dict)
    ready: float = 0.0  # monotonic time its last object was in place at every child


@dataclass(frozen=True, eq=False)
class Item:
    """One object of a version (key relative to the prefix, size, digest), or with `rel` "" the
    version's commit marker."""

    version: Version
    rel: str = ""
    size: int = 0
    digest: str = ""


def items_of(plan: list[Version]) -> list[Item]:
    """Every object each version's MANIFEST names, then the version's commit marker, in order."""
    items: list[Item] = []
    for ver in plan:
        m = ver.manifest
        for i, ch in enumerate(m.chunks):
            for kind, size, digest in (("chunk", ch.size, ch.digest), ("key", ch.key_size, ch.key_digest),
                                       ("over", ch.over_size, ch.over_digest)):
                if size:
                    items.append(Item(ver, object_key("", ver.version, kind, i, m.attempt), size, digest))
        items.append(Item(ver))
    return items


class Copier:
    """Copies plans of versions from `parent` to the children each version names."""

    def __init__(self, parent: Parent, ahead: StreamAhead, tally: Tally, *, verify_existing: bool) -> None:
        self.parent, self.ahead, self.tally, self.verify_existing = parent, ahead, tally, verify_existing

    async def copy(self, plan: list[Version], report: SyncReport, workers: int) -> None:
        async def commit(item: Item, _: None) -> None:
            if not item.rel:
                await self._commit(item.version, report)

        await run_ordered(items_of(plan), self._stage, commit, workers=workers, window=2 * workers,
                          defer_errors=True)

    # -- one object, on a worker --------------------------------------------------------------

    async def _stage(self, item: Item) -> None:
        if not item.rel:
            return
        todo: list[tuple[Child, bool]] = []
        for c in item.version.children:
            state = await self._at_child(c, item, item.version.present.get(c, {}))
            if c.failed is None and state != "ok":
                todo.append((c, state == "bad"))
        if not todo:
            return
        data = await self.parent.read_checked(item.rel, item.size, item.digest, item.version.version)
        async with anyio.create_task_group() as tg:
            for c, replace in todo:
                tg.start_soon(functools.partial(c.write, item.rel, data, replace=replace))

    async def _at_child(self, c: Child, item: Item, present: dict[str, int]) -> str:
        """"ok" (there and verified), "absent", or "bad" (there, but not these bytes: replace it)."""
        if c.failed is not None or item.rel not in present:
            return "absent"
        if present[item.rel] != item.size:
            return "bad"
        ahead = self.ahead.lookup(item.rel)
        if ahead is not None and c in ahead.children:
            if (ahead.size, ahead.digest) != (item.size, item.digest):
                return "bad"
        elif self.verify_existing:
            data = await c.call(c.store.read(c.key + item.rel))
            if data is None or not await verified(self.parent.cpu, data, item.size, item.digest):
                return "bad"
        c.skipped += 1
        return "ok"

    # -- the sequencer: one version at a time, in order ---------------------------------------

    async def _commit(self, ver: Version, report: SyncReport) -> None:
        ver.ready = time.monotonic()
        async with anyio.create_task_group() as tg:
            for c in ver.children:
                if c.failed is None:
                    tg.start_soon(self._commit_child, c, ver, report)

    async def _commit_child(self, c: Child, ver: Version, report: SyncReport) -> None:
        try:
            try:
                await commit_manifest_bytes(c.store, c.key, ver.version, ver.raw)
            except AlreadyExists:
                if await read_manifest_bytes(c.store, c.key, ver.version) != ver.raw:
                    raise RefitError(f"{c.name} already has a different version {ver.version}: "
                                     "another tree feeds this child; give each tree its own prefix") from None
                c.raced += 1
            visible = time.monotonic()
            await write_latest(c.store, c.key, ver.version)
        except ZephonError as exc:
            c.fail(exc)
            return
        c.latest, c.digest = ver.version, ver.manifest.model_digest
        c.versions += 1
        self.tally.versions += 1
        report.committed[c.name].append(ver.version)
        seen, now = self.parent.seen_at(ver.version), time.monotonic()
        log.info("version relayed", extra={
            "event": "version_committed", "child": c.name, "version": ver.version,
            "keyframe": ver.manifest.keyframe, "lag_s": round(now - seen, 6) if seen else None,
            "copy_s": round(ver.ready - seen, 6) if seen else None, "commit_s": round(now - ver.ready, 6),
            "manifest_s": round(visible - ver.ready, 6),
        })
