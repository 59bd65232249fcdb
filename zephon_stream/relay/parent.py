"""The parent prefix as a relay reads it: its versions, their MANIFESTs, its objects checked.

A relay never writes under its parent. It reads each MANIFEST once (cached until every child
has that version), remembers which versions are keyframes down to the newest one, and reads each
object with its size and blake2b checked against the MANIFEST before anybody gets it.
"""

from __future__ import annotations

import time

from zephon_stream.connectors.base import Store
from zephon_stream.engine.cpu import CpuPolicy
from zephon_stream.errors import DataError, DigestMismatch, RefitError, ZephonError
from zephon_stream.refit.manifest import Manifest, object_digest
from zephon_stream.refit.versions import find_latest, has_version, read_manifest_raw
from zephon_stream.relay.metrics import Tally
from zephon_stream.relay.prefix import Prefix

__all__ = ["BAD_MANIFEST", "Parent", "verified"]

BAD_MANIFEST = (DataError, RefitError)  # a MANIFEST that is there but unusable: malformed, oversized


async def verified(cpu: CpuPolicy, data: bytes, size: int, digest: str) -> bool:
    """Whether `data` is the object a MANIFEST names by `size` and blake2b `digest` (hashed off the loop)."""
    return len(data) == size and await cpu(object_digest, data) == digest


class Parent:
    """The parent's store and key prefix, its newest version (`latest`), and what is cached of it."""

    def __init__(self, prefix: Prefix, store: Store, key: str, cpu: CpuPolicy, tally: Tally) -> None:
        self.prefix, self.store, self.key, self.cpu, self.tally = prefix, store, key, cpu, tally
        self.latest = 0
        self._manifests: dict[int, tuple[bytes, Manifest]] = {}
        self._is_key: dict[int, bool] = {}  # whether a version is a keyframe, down to the newest one
        self._seen: dict[int, float] = {}  # version -> monotonic time the relay first saw it
        self._seen_upto = 0
        self.broken: set[int] = set()  # versions with an object that can never be relayed (corrupt)

    @property
    def name(self) -> str:
        return self.prefix.name

    async def refresh(self) -> int:
        """Find the newest version (LATEST, then probing), noting when each new one was first seen."""
        self.latest = await find_latest(self.store, self.key)
        now = time.monotonic()
        for v in range(self._seen_upto + 1, self.latest + 1):
            self._seen[v] = now
        self._seen_upto = max(self._seen_upto, self.latest)
        return self.latest

    async def catch_up(self) -> None:
        """Look again for a newer version (a racing relay may have copied one to a child already)."""
        self.latest = max(self.latest, await find_latest(self.store, self.key))

    def seen_at(self, version: int) -> float | None:
        """The monotonic time `version` was first seen, while it is still of interest."""
        return self._seen.get(version)

    async def exists(self, version: int) -> bool:
        return await has_version(self.store, self.key, version)

    async def manifest(self, version: int) -> tuple[bytes, Manifest] | None:
        """The raw and checked MANIFEST of `version` (cached), or None if absent; BAD_MANIFEST if unusable."""
        if version < 1:
            return None
        if version not in self._manifests:
            got = await read_manifest_raw(self.store, self.key, version)
            if got is None:
                return None
            self._manifests[version] = got[:2]
        return self._manifests[version]

    async def newest_keyframe(self, latest: int) -> int:
        """The newest keyframe at or below `latest` whose MANIFEST is good (a bad one above it
        waits in the copy plan, after the good versions before it)."""
        bad: ZephonError | None = None
        for v in range(latest, 0, -1):
            if v not in self._is_key:
                try:
                    got = await self.manifest(v)
                except BAD_MANIFEST as exc:
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
        raise RefitError(f"no keyframe at or below version {latest} of {self.name}: the parent "
                         "collected it (or its publisher is mid-collection); retrying later")

    async def read(self, rel: str) -> bytes:
        """Object `rel` (relative to the prefix) as it is, counted as a parent read."""
        data = await self.store.read(self.key + rel)
        self.tally.read(len(data))
        return data

    async def read_checked(self, rel: str, size: int, digest: str, version: int) -> bytes:
        """Object `rel` with its size and digest checked; one re-read on a mismatch (a flipped bit
        in flight), then the error: the version is not propagated."""
        key = self.key + rel
        for _ in range(2):
            data = await self.read(rel)
            if await verified(self.cpu, data, size, digest):
                return data
        if len(data) != size:
            err: ZephonError = DataError(f"{key} at the parent is {len(data)} bytes, its MANIFEST says {size} "
                                         "(truncated?): version not relayed", key=key, offset=len(data))
        else:
            err = DigestMismatch(f"{key} at the parent has blake2b {object_digest(data)}, its MANIFEST says "
                                 f"{digest}: corrupt object, version {version} not relayed")
        self.broken.add(version)  # read twice, wrong twice: the relay jumps a newer keyframe over it
        raise err

    def forget_below(self, floor: int) -> None:
        """Drop the MANIFESTs below `floor` and the first-seen times up to it: every child has them."""
        for v in [v for v in self._manifests if v < floor]:
            del self._manifests[v]
        for v in [v for v in self._seen if v <= floor]:
            del self._seen[v]
        self.broken = {v for v in self.broken if v >= floor}
