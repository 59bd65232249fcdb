"""An in-memory object store: a fast fake for tests."""

from __future__ import annotations

import hashlib

from zephon_stream.connectors.base import ObjectInfo, StoreStatistics
from zephon_stream.errors import AlreadyExists, ObjectNotFound

__all__ = ["MemoryStore"]


class MemoryStore:
    """Objects in a dict. Each named instance is shared through `memory://NAME/` URIs."""

    overlap_reads = False  # a read is a slice: nothing to hide behind another one

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self._requests = 0
        self._bytes_read = 0
        self._bytes_written = 0

    def __repr__(self) -> str:
        return f"MemoryStore({len(self.objects)} objects)"

    def _info(self, key: str) -> ObjectInfo:
        data = self.objects[key]
        return ObjectInfo(key=key, size=len(data), etag=hashlib.md5(data, usedforsecurity=False).hexdigest())

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._requests += 1
        return [self._info(k) for k in sorted(self.objects) if k.startswith(prefix)]

    async def head(self, key: str) -> ObjectInfo:
        self._requests += 1
        if key not in self.objects:
            raise ObjectNotFound(f"no object {key!r} in memory store")
        return self._info(key)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self._requests += 1
        try:
            data = self.objects[key][start:end]
        except KeyError as exc:
            raise ObjectNotFound(f"no object {key!r} in memory store") from exc
        self._bytes_read += len(data)
        return data

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        self._requests += 1
        if if_none_match and key in self.objects:
            raise AlreadyExists(f"object {key!r} already exists in memory store")
        self.objects[key] = bytes(data)
        self._bytes_written += len(data)

    async def delete(self, key: str) -> None:
        self._requests += 1
        self.objects.pop(key, None)

    async def copy(self, src_key: str, dst_key: str) -> None:
        await self.put(dst_key, await self.read(src_key))

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            requests=self._requests, bytes_read=self._bytes_read, bytes_written=self._bytes_written
        )

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> MemoryStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass
