"""Retention at the children: the parent's collection mirrored, or `keep_versions` of their own.

A child that has caught up with its parent loses the versions below a floor: the parent's oldest
version (or the newest `keep_versions`), and never its newest keyframe. A version goes MANIFEST
first, so it stops existing before its objects do. Only the keys a relay writes are deleted
(`refit.versions.relayed_keys`): whatever else lies under a child is not the relay's.
"""

from __future__ import annotations

import logging

from zephon_stream.errors import ZephonError
from zephon_stream.refit.versions import delete_version, relayed_keys, version_prefix, versions_prefix
from zephon_stream.relay.child import Child
from zephon_stream.relay.parent import Parent

__all__ = ["Retention"]

log = logging.getLogger(__name__)


class Retention:
    """Collects old versions at the children of `parent`."""

    def __init__(self, parent: Parent, keep_versions: int | None) -> None:
        self.parent, self.keep_versions = parent, keep_versions
        self._parent_oldest: int | None = None

    async def collect(self, children: list[Child]) -> None:
        """Collect at every child that holds the parent's newest version (a child's error fails it alone)."""
        if self.keep_versions is None:
            await self._find_parent_oldest()
        for c in children:
            if c.failed is None and c.latest and c.latest == self.parent.latest:  # caught up: mirror it
                try:
                    await self._collect(c)
                except ZephonError as exc:
                    c.fail(exc)

    async def _find_parent_oldest(self) -> None:
        """The parent's oldest version: versions are contiguous, so probe up from the last one known."""
        latest = self.parent.latest
        lo = self._parent_oldest or 1
        if self._parent_oldest is None:  # first time: binary search for the lowest that exists
            hi = latest
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if await self.parent.exists(mid) else (mid + 1, hi)
        while lo < latest and not await self.parent.exists(lo):
            lo += 1
        self._parent_oldest = lo

    async def _collect(self, c: Child) -> None:
        latest = c.latest or 0
        key = await self.parent.newest_keyframe(latest)
        if self.keep_versions is not None:
            floor = min(key, latest - self.keep_versions + 1)
        else:
            floor = min(key, self._parent_oldest or 1)
        if c.oldest is None:
            await self._sweep(c, floor)
        elif c.oldest < floor:
            for v in range(c.oldest, floor):
                listed = await c.store.list(version_prefix(c.key, v))
                await self._delete(c, v, relayed_keys(c.key, listed).get(v, []))
        c.oldest = max(c.oldest or 1, floor)

    async def _sweep(self, c: Child, floor: int) -> None:
        """Every relayed object below `floor`, found by listing (after a restart or a jump: versions
        may have gaps, and a crashed collection may have left objects without a MANIFEST)."""
        doomed = relayed_keys(c.key, await c.store.list(versions_prefix(c.key)))
        for v in sorted(v for v in doomed if v < floor):
            await self._delete(c, v, doomed[v])
        c.oldest = floor

    async def _delete(self, c: Child, version: int, keys: list[str]) -> None:
        await delete_version(c.store, c.key, version, keys)
        if keys:
            c.collected += 1
            log.info("version collected", extra={"event": "version_collected", "child": c.name,
                                                 "version": version})
