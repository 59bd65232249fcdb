"""One child prefix of a relay: where it stands, how objects reach it, and what it was given.

An object reaches a child by a PUT of the bytes the relay read (checked) from the parent, or, when
the child's store can copy from the parent's on the server (the same store, or a
`ServerSideCopy` store that accepts the parent's), by a server-side copy. A child's first error
in a sync stops the rest of that sync for it alone (`fail`); the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from zephon_stream.connectors.base import ServerSideCopy, Store
from zephon_stream.errors import AlreadyExists, ConnectorError, ZephonError
from zephon_stream.relay.metrics import ChildStatistics, Tally, error_kind
from zephon_stream.relay.parent import Parent
from zephon_stream.relay.prefix import Prefix

__all__ = ["Child"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Child:
    """A child's store and key prefix, its newest version as far as the relay knows, its counters."""

    def __init__(self, prefix: Prefix, store: Store, key: str, parent: Parent, tally: Tally) -> None:
        self.prefix, self.store, self.key, self.tally = prefix, store, key, tally
        self._source, self._source_key = parent.store, parent.key
        # the parent's store itself, or a store that reaches the parent's bucket: copy on the server
        other = store is not self._source and isinstance(store, ServerSideCopy)
        self._server_copy: ServerSideCopy | None = store if other and store.copies_from(self._source) else None
        self.server_side = store is self._source or self._server_copy is not None
        self.latest: int | None = None  # None: not known yet (find it on the next sync)
        self.digest: int | None = None  # the model digest of version `latest` there, where known
        self.oldest: int | None = None  # None: sweep by listing before the next collection
        self.failed: ZephonError | None = None  # in this sync: skip the rest
        self.versions = self.objects = self.skipped = self.copies = self.bytes = 0
        self.raced = self.collected = self.errors = 0
        self.last_error = ""

    @property
    def name(self) -> str:
        return self.prefix.name

    def __repr__(self) -> str:
        return f"Child({self.name!r}, latest={self.latest})"

    def fail(self, exc: ZephonError) -> None:
        """The child's first error of this sync: counted, logged, and the child skipped until the next."""
        if self.failed is None:
            self.failed = exc
            self.errors += 1
            self.last_error = str(exc)
            self.latest = self.digest = None  # ask it again next time
            self.tally.error(f"child:{error_kind(exc)}", exc, child=self.name)

    async def call(self, call: Awaitable[T]) -> T | None:
        """`await call`, or None after a store error, which fails the child."""
        try:
            return await call
        except ConnectorError as exc:
            self.fail(exc)
            return None

    async def write(self, rel: str, data: bytes, *, replace: bool) -> None:
        """Put object `rel` (checked bytes from the parent), or copy it on the server. `replace`:
        a wrong object is there; else the put is conditional, and one found there was put by a
        racing relay after checking the same digest."""
        if self.failed is not None:
            return
        try:
            if self.server_side:
                await self.copy_on_server(rel)
                self.copies += 1
            else:
                await self.store.put(self.key + rel, data, if_none_match=not replace)
                self.bytes += len(data)
            self.objects += 1
        except AlreadyExists:
            self.skipped += 1
        except ConnectorError as exc:
            self.fail(exc)

    async def write_ahead(self, rel: str, data: bytes) -> bool:
        """Put or copy object `rel` of a version not yet committed: whether it landed. Any error
        (AlreadyExists included) is left to the sync, which checks such objects itself."""
        try:
            if self.server_side:
                await self.copy_on_server(rel)
            else:
                await self.store.put(self.key + rel, data, if_none_match=True)
        except ZephonError as exc:
            log.debug("copy ahead of %s to %s stopped: %s", rel, self.name, exc)
            return False
        return True

    async def copy_on_server(self, rel: str) -> None:
        if self._server_copy is None:  # the parent's own store
            await self.store.copy(self._source_key + rel, self.key + rel)
        else:
            await self._server_copy.copy_from(self._source, self._source_key + rel, self.key + rel)

    def statistics(self, parent: Parent, now: float) -> ChildStatistics:
        """Where the child stands against `parent`, lag in seconds counted from when the first
        version it lacks was first seen."""
        have = self.latest or 0
        lag = max(0, parent.latest - have)
        seen = parent.seen_at(have + 1) if lag else None
        return ChildStatistics(
            self.name, have, lag, round(now - seen, 6) if seen else 0.0, self.versions,
            self.objects, self.skipped, self.copies, self.bytes, self.raced, self.collected, self.errors,
            self.last_error,
        )
