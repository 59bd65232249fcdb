"""Reading and writing the versions under a prefix: LATEST, MANIFESTs, and garbage collection."""

from __future__ import annotations

import os
import re
from typing import Annotated

import msgspec

from zephon_stream.errors import DataError, ObjectNotFound, RefitError
from zephon_stream.connectors import open_store, parse_uri
from zephon_stream.connectors.base import Store
from zephon_stream.refit.layout import TensorTable
from zephon_stream.refit.manifest import Manifest, decode_manifest, encode_manifest, read_bounded

__all__ = ["collect_garbage", "commit_manifest", "find_latest", "list_versions", "prefix_identity", "read_manifest",
           "write_latest"]

_VDIR = re.compile(r"^v(\d+)/")


class _Latest(msgspec.Struct):
    version: Annotated[int, msgspec.Meta(ge=1)]


_MAX_LATEST_BYTES = 4096


def prefix_identity(prefix: str, store: Store | None = None) -> str:
    """A canonical name for where a prefix's versions live, to bind a local record to it.

    For a URI: the resolved directory of a file:// prefix (symlinks, `..` and `//` resolved),
    else scheme, bucket and key prefix as the store addresses them. For a `store` object given
    directly, the object itself (within this process only: a record from another process is
    then re-verified once).
    """
    if store is not None:
        return f"{type(store).__qualname__}@{id(store):x}/{prefix}"
    scheme, location, key = parse_uri(prefix)
    if scheme == "file":
        return f"file://{os.path.realpath(location)}/"
    return f"{scheme}://{location}/{key}"


async def read_manifest(store: Store, prefix: str, version: int) -> tuple[Manifest, TensorTable] | None:
    """The checked manifest of `version`, or None when the version does not exist.

    A MANIFEST that is over the size limit (RefitError) or malformed (DataError) is refused
    after reading at most the limit + 1 bytes.
    """
    key = f"{prefix}v{version}/MANIFEST"
    try:
        data = await read_bounded(store, key)
    except ObjectNotFound:
        return None
    m, table = decode_manifest(data, key)
    if m.version != version:
        raise DataError(f"{key}: manifest says version {m.version}", key=key)
    return m, table


async def _exists(store: Store, prefix: str, version: int) -> bool:
    try:
        await store.head(f"{prefix}v{version}/MANIFEST")
    except ObjectNotFound:
        return False
    return True


async def list_versions(store: Store, prefix: str) -> list[int]:
    """Every committed version (one with a MANIFEST), ascending."""
    out = set()
    for info in await store.list(f"{prefix}v"):
        rel = info.key[len(prefix) :]
        match = _VDIR.match(rel)
        if match and rel == f"v{match.group(1)}/MANIFEST":
            out.add(int(match.group(1)))
    return sorted(out)


async def find_latest(store: Store, prefix: str) -> int:
    """The newest committed version (0 if none): LATEST as a hint, then probing forward.

    LATEST is only a hint: one that is unreadable, not a positive int, or names a version
    with no MANIFEST is ignored, and the versions found by listing are used instead.
    """
    hint = await _latest_hint(store, prefix)
    if hint is None or not await _exists(store, prefix, hint):
        versions = await list_versions(store, prefix)
        return versions[-1] if versions else 0
    while await _exists(store, prefix, hint + 1):
        hint += 1
    return hint


async def _latest_hint(store: Store, prefix: str) -> int | None:
    try:
        return msgspec.json.decode(await read_bounded(store, f"{prefix}LATEST", _MAX_LATEST_BYTES), type=_Latest).version
    except (ObjectNotFound, RefitError, msgspec.DecodeError):
        return None


async def write_latest(store: Store, prefix: str, version: int) -> None:
    await store.put(f"{prefix}LATEST", msgspec.json.encode(_Latest(version)))


async def commit_manifest(store: Store, prefix: str, m: Manifest) -> None:
    """The conditional put that makes a version exist. Raises AlreadyExists if it lost."""
    await store.put(f"{prefix}v{m.version}/MANIFEST", encode_manifest(m), if_none_match=True)


async def collect_garbage(store: Store, prefix: str, latest: int, newest_key: int, keep: int) -> list[int]:
    """Delete versions older than both the last `keep` and the newest keyframe. Returns them.

    Each doomed version loses its MANIFEST first, so it stops existing before its chunks go.
    Versions above `latest` (a publisher may be writing one) are never touched.
    """
    floor = min(newest_key, latest - keep + 1)
    doomed = []
    while floor - len(doomed) > 1 and await _exists(store, prefix, floor - len(doomed) - 1):
        doomed.append(floor - len(doomed) - 1)  # versions are contiguous: probe down, never list them all
    for v in doomed:
        await store.delete(f"{prefix}v{v}/MANIFEST")
        for info in await store.list(f"{prefix}v{v}/"):
            await store.delete(info.key)
    return doomed



class StoreOwner:
    """An async context manager that opens its prefix's store unless one was given, and closes
    only a store it opened itself. Users set `_uri`, `_store` and `_prefix` before entering."""

    _uri: str
    _store: Store | None
    _prefix: str

    async def __aenter__(self):  # noqa: ANN204  (returns the subclass)
        if self._store is None:
            self._store, self._prefix = open_store(self._uri)
            self._owned = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        if getattr(self, "_owned", False) and self._store is not None:
            await self._store.aclose()

    @property
    def store(self) -> Store:
        if self._store is None:
            name = type(self).__name__
            raise RefitError(f"{self!r} is not open: use `async with {name}(...) as {name[:3].lower()}:`")
        return self._store
