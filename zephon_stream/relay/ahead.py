"""Stream-ahead: copy a version's objects while its publisher is still writing them.

    poll: LIST v{N+1}/ at the parent --> MANIFEST there? the version exists: sync
                                     --> else each new object: read once, hash, write to every child

Objects copied ahead stay invisible at the children (no MANIFEST names them yet). Their size,
digest and the children that got them are kept, and the sync checks them against the MANIFEST
once it exists: a match is not read again, a mismatch (another publish attempt, a damaged copy)
is replaced. At most `workers` objects are copied ahead at once; a sync waits for the copies in
flight to land first (`settle`), so no object is read twice.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import anyio
import anyio.abc

from zephon_stream.errors import ObjectNotFound, ZephonError
from zephon_stream.refit.manifest import object_digest
from zephon_stream.refit.versions import manifest_key, parse_object, version_of, version_prefix
from zephon_stream.relay.child import Child
from zephon_stream.relay.metrics import Tally
from zephon_stream.relay.parent import Parent

__all__ = ["Ahead", "StreamAhead"]

log = logging.getLogger(__name__)


class Ahead(NamedTuple):
    """An object copied ahead of its MANIFEST: its size and digest, and the children it reached."""

    size: int
    digest: str
    children: frozenset[Child]


class StreamAhead:
    """The objects copied ahead, keyed by their key relative to the prefix."""

    def __init__(self, parent: Parent, children: list[Child], tally: Tally, workers: int) -> None:
        self.parent, self.children, self.tally = parent, children, tally
        self._copied: dict[str, Ahead] = {}
        self._limit = anyio.CapacityLimiter(workers)
        self._inflight: set[str] = set()
        self._settled = anyio.Event()
        self._group: anyio.abc.TaskGroup | None = None  # set while the daemon runs

    def attach(self, group: anyio.abc.TaskGroup | None) -> None:
        """Run copies in `group` (the daemon's), or none at all (None)."""
        self._group = group

    def lookup(self, rel: str) -> Ahead | None:
        return self._copied.get(rel)

    async def poll(self, version: int) -> bool:
        """One LIST of `version` at the parent: whether its MANIFEST is there. If not, start a copy
        of each of its objects not copied yet. Store errors other than ObjectNotFound pass through."""
        parent = self.parent
        try:
            infos = await parent.store.list(version_prefix(parent.key, version))
        except ObjectNotFound:
            return False
        if any(o.key == manifest_key(parent.key, version) for o in infos):
            return True
        skip = len(version_prefix(parent.key, version))
        for info in infos:
            if parse_object(info.key[skip:]) is not None:
                self._start(info.key[len(parent.key):])
        return False

    def _start(self, rel: str) -> None:
        if rel in self._copied or rel in self._inflight or self._group is None:
            return
        if not self._inflight:
            self._settled = anyio.Event()
        self._inflight.add(rel)
        self._group.start_soon(self._copy, rel)

    async def settle(self) -> None:
        """Return once no copy ahead is in flight."""
        while self._inflight:
            await self._settled.wait()

    async def _copy(self, rel: str) -> None:
        try:
            async with self._limit:
                await self._copy_now(rel)
        finally:
            self._inflight.discard(rel)
            if not self._inflight:
                self._settled.set()

    async def _copy_now(self, rel: str) -> None:
        try:
            data = await self.parent.read(rel)
        except ZephonError as exc:
            log.debug("copy ahead of %s stopped: %s", rel, exc)
            return
        digest = await self.parent.cpu(object_digest, data)
        written: set[Child] = set()

        async def write(c: Child) -> None:
            if await c.write_ahead(rel, data):
                written.add(c)

        async with anyio.create_task_group() as tg:
            for c in self.children:
                tg.start_soon(write, c)
        self._copied[rel] = Ahead(len(data), digest, frozenset(written))
        self.tally.ahead += 1

    def forget_upto(self, latest: int) -> None:
        """Drop what was copied ahead of versions up to `latest`: their MANIFESTs are known now."""
        self._copied = {k: v for k, v in self._copied.items() if (version_of(k) or 0) > latest}
