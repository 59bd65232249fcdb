"""Store wrappers for tests: one that hands every call on (to subclass), and seeded read latency."""

from __future__ import annotations

import random

import anyio

from zephon_stream.connectors.base import ObjectInfo, Store, StoreStatistics, overlaps_reads

__all__ = ["LatencyStore", "WithLatency", "WrappedStore"]


class WrappedStore:
    """A store that hands every call to `inner`: subclass it and override the calls to watch or slow."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    @property
    def overlap_reads(self) -> bool:
        return overlaps_reads(self.inner)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.inner.list(prefix)

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return await self.inner.read(key, start, end)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        await self.inner.put(key, data, if_none_match=if_none_match)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def copy(self, src_key: str, dst_key: str) -> None:
        await self.inner.copy(src_key, dst_key)

    def statistics(self) -> StoreStatistics:
        return self.inner.statistics()

    async def aclose(self) -> None:
        await self.inner.aclose()


class LatencyStore(WrappedStore):
    """Wraps a store; every list, head and read first sleeps a seeded random time in `[0, max_ms]`
    milliseconds. Use it to prove that the sample order does not depend on I/O timing.
    Its reads have a latency to hide, so the split readers overlap them (`overlap_reads`).
    """

    overlap_reads = True

    def __init__(self, inner: Store, seed: int = 0, max_ms: float = 5.0) -> None:
        super().__init__(inner)
        self.max_ms = max_ms
        self._rng = random.Random(seed)

    def __repr__(self) -> str:
        return f"LatencyStore({self.inner!r}, max_ms={self.max_ms})"

    async def _delay(self) -> None:
        await anyio.sleep(self._rng.random() * self.max_ms / 1000)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await self._delay()
        return await self.inner.list(prefix)

    async def head(self, key: str) -> ObjectInfo:
        await self._delay()
        return await self.inner.head(key)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        await self._delay()
        return await self.inner.read(key, start, end)


class WithLatency:
    """A picklable `wrap_store` for `Loader(..., wrap_store=WithLatency(seed, max_ms))`."""

    def __init__(self, seed: int = 0, max_ms: float = 5.0) -> None:
        self.seed, self.max_ms = seed, max_ms

    def __call__(self, store: Store) -> Store:
        return LatencyStore(store, self.seed, self.max_ms)
