"""The one small async interface every object store implements.

Keys are '/'-separated and relative to the store's root (a directory, or a bucket).
`list(prefix)` returns objects sorted by key. `read(key, start, end)` is a ranged read of
`[start, end)` (`end=None` means to the end). `put(..., if_none_match=True)` is a conditional
create that raises `AlreadyExists` when the key exists. A store that can also copy from another
store without the bytes passing through this process implements `ServerSideCopy`.

A store may say, with a class attribute `overlap_reads`, whether ranged reads of one object gain
from being in flight together: true for a store with a round trip per request (S3), false for
local files and memory, whose reads take microseconds and which the OS reads ahead itself; there
the loader's split readers read one part at a time (`read_ahead` is for the former). A store that
does not say is taken to gain (`overlaps_reads`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

__all__ = ["ObjectInfo", "ServerSideCopy", "Store", "StoreStatistics", "overlaps_reads"]


class ObjectInfo(msgspec.Struct, frozen=True):
    """One object: its key, size in bytes, and a version tag (ETag, or mtime for files)."""

    key: str
    size: int
    etag: str


class StoreStatistics(msgspec.Struct, frozen=True):
    """Counters of one store since it was opened."""

    requests: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    retries: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0


@runtime_checkable
class Store(Protocol):
    """An object store: local directory, memory, or S3."""

    async def list(self, prefix: str = "") -> list[ObjectInfo]: ...

    async def head(self, key: str) -> ObjectInfo: ...

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None: ...

    async def delete(self, key: str) -> None: ...

    async def copy(self, src_key: str, dst_key: str) -> None: ...

    def statistics(self) -> StoreStatistics: ...

    async def aclose(self) -> None: ...


def overlaps_reads(store: object) -> bool:
    """Whether ranged reads of one object from `store` should overlap (its `overlap_reads`; True
    when it does not say): the split readers then keep `read_ahead` of them in flight."""
    return bool(getattr(store, "overlap_reads", True))


@runtime_checkable
class ServerSideCopy(Protocol):
    """A store that copies objects from some other stores on the server (S3: another bucket of the
    same endpoint, with the same credentials). `isinstance(store, ServerSideCopy)` says it may;
    `copies_from(source)` whether it can from that store."""

    def copies_from(self, source: object) -> bool: ...

    async def copy_from(self, source: Store, src_key: str, dst_key: str) -> None: ...
