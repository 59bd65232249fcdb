"""The key layout of a refit prefix and the versions in it: the one module that spells a key.

    {prefix}LATEST                      {"version": N}: a hint; MANIFESTs are the truth
    {prefix}v{N}/chunk-{i}.{attempt}    XOR delta of chunk i from v{N-1} (absent: chunk unchanged)
    {prefix}v{N}/key-{i}.{attempt}      full chunk i (keyframes only)
    {prefix}v{N}/over-{i}.{attempt}     positions + new values of chunk i (when published)
    {prefix}v{N}/part-{r}.{attempt}     rank r's chunk table, before the MANIFEST exists
    {prefix}v{N}/MANIFEST               written last, with a conditional put

N, i and r are written in decimal without leading zeros, and only keys spelled that way are read
back: `v01/MANIFEST` or `v١/MANIFEST` (an Arabic-Indic one) is not version 1, and a listing, a
relay and retention treat it as a stranger's object. The attempt tag is per publish session, so
a crashed or losing publisher's leftovers are never read by anybody: only the objects a
committed MANIFEST names exist as far as readers go.

A version exists once its MANIFEST does; versions are contiguous (a publisher makes N+1 on top
of N, garbage collection removes the oldest first), which lets `find_latest` and
`collect_garbage` probe instead of listing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, NamedTuple

import msgspec

from zephon_stream.connectors.base import ObjectInfo, Store
from zephon_stream.errors import DataError, ObjectNotFound, RefitError
from zephon_stream.refit.layout import TensorTable
from zephon_stream.refit.manifest import Manifest, decode_manifest, encode_manifest, read_bounded

__all__ = ["LATEST", "MANIFEST", "OBJECT_KINDS", "ObjectName", "chunk_key", "collect_garbage", "commit_manifest",
           "commit_manifest_bytes", "delete_version", "find_latest", "has_version", "latest_key", "list_versions",
           "manifest_key", "manifest_version", "object_key", "object_label", "parse_object", "part_key",
           "parts_prefix", "read_manifest", "read_manifest_bytes", "read_manifest_raw", "relayed_keys",
           "version_of", "version_prefix", "versions_prefix", "write_latest"]

LATEST = "LATEST"
MANIFEST = "MANIFEST"
OBJECT_KINDS = ("chunk", "key", "over")  # the objects a MANIFEST names, per chunk

# Decimal, no leading zero, ASCII digits only (`\d` takes any script's); 15 digits hold the
# largest version a MANIFEST may declare (2**48), and keep int() far from its digit limit.
_VERSION = r"v([1-9][0-9]{0,14})"
_INDEX = r"(0|[1-9][0-9]{0,17})"
_OBJECT = re.compile(rf"({'|'.join(OBJECT_KINDS)})-{_INDEX}\.([0-9a-f]{{8,32}})")
_VERSION_DIR = re.compile(rf"{_VERSION}/")
_MANIFEST_KEY = re.compile(rf"{_VERSION}/{MANIFEST}")
_RELAYED = re.compile(rf"{_VERSION}/(?:{MANIFEST}|{_OBJECT.pattern})")
_MAX_LATEST_BYTES = 4096


class _Latest(msgspec.Struct):
    version: Annotated[int, msgspec.Meta(ge=1)]


class ObjectName(NamedTuple):
    """An object a MANIFEST may name, parsed from its name inside a version's directory."""

    kind: str  # one of OBJECT_KINDS
    index: int  # the chunk
    attempt: str


# -- building keys ----------------------------------------------------------------------------


def versions_prefix(prefix: str) -> str:
    """The listing prefix that finds every version's keys (among other keys that start with `v`)."""
    return f"{prefix}v"


def version_prefix(prefix: str, version: int) -> str:
    """The directory of one version: every key of it starts so."""
    return f"{prefix}v{version}/"


def manifest_key(prefix: str, version: int) -> str:
    return version_prefix(prefix, version) + MANIFEST


def latest_key(prefix: str) -> str:
    return f"{prefix}{LATEST}"


def object_key(prefix: str, version: int, kind: str, index: int, attempt: str) -> str:
    """The key of chunk `index`'s object of `kind` (see OBJECT_KINDS). With prefix "", the key
    relative to any prefix, as a relay copies it."""
    return f"{version_prefix(prefix, version)}{kind}-{index}.{attempt}"


def chunk_key(prefix: str, m: Manifest, index: int, kind: str = "chunk") -> str:
    """The key of chunk `index`'s object of `kind` in version `m`."""
    return object_key(prefix, m.version, kind, index, m.attempt)


def object_label(version: int, kind: str, index: int) -> str:
    """How a message names chunk `index`'s object of `kind` in `version`, attempt aside."""
    return f"v{version}/{kind}-{index}"


def part_key(prefix: str, version: int, rank: int, attempt: str) -> str:
    return f"{parts_prefix(prefix, version)}{rank}.{attempt}"


def parts_prefix(prefix: str, version: int) -> str:
    """What to list for the part records of `version`."""
    return version_prefix(prefix, version) + "part-"


# -- parsing keys -----------------------------------------------------------------------------


def version_of(rel: str) -> int | None:
    """The version whose directory holds `rel` (a key relative to the prefix), else None."""
    match = _VERSION_DIR.match(rel)
    return int(match.group(1)) if match else None


def manifest_version(rel: str) -> int | None:
    """N when `rel` (relative to the prefix) is exactly `v{N}/MANIFEST`, else None."""
    match = _MANIFEST_KEY.fullmatch(rel)
    return int(match.group(1)) if match else None


def parse_object(name: str) -> ObjectName | None:
    """`name` (relative to a version's directory) as an object a MANIFEST may name, else None."""
    match = _OBJECT.fullmatch(name)
    return ObjectName(match.group(1), int(match.group(2)), match.group(3)) if match else None


def relayed_keys(prefix: str, infos: Iterable[ObjectInfo]) -> dict[int, list[str]]:
    """The listed keys a relay writes under `prefix`, by version: `v{N}/MANIFEST` and the objects a
    MANIFEST may name, directly under the prefix. Whatever else a listing finds there (another
    prefix's files, a user's notes, part records) is not the relay's to delete."""
    out: dict[int, list[str]] = {}
    for info in infos:
        match = _RELAYED.fullmatch(info.key[len(prefix):]) if info.key.startswith(prefix) else None
        if match:
            out.setdefault(int(match.group(1)), []).append(info.key)
    return out


# -- versions in a store ----------------------------------------------------------------------


async def read_manifest_bytes(store: Store, prefix: str, version: int) -> bytes:
    """The MANIFEST of `version` as stored, read bounded (RefitError over the limit, ObjectNotFound)."""
    return await read_bounded(store, manifest_key(prefix, version))


async def read_manifest_raw(store: Store, prefix: str, version: int) -> tuple[bytes, Manifest, TensorTable] | None:
    """The MANIFEST of `version` as stored and as checked, or None when the version does not exist.

    A MANIFEST that is over the size limit (RefitError) or malformed (DataError) is refused
    after reading at most the limit + 1 bytes.
    """
    key = manifest_key(prefix, version)
    try:
        data = await read_bounded(store, key)
    except ObjectNotFound:
        return None
    m, table = decode_manifest(data, key)
    if m.version != version:
        raise DataError(f"{key}: manifest says version {m.version}", key=key)
    return data, m, table


async def read_manifest(store: Store, prefix: str, version: int) -> tuple[Manifest, TensorTable] | None:
    """The checked manifest of `version`, or None when the version does not exist (see `read_manifest_raw`)."""
    got = await read_manifest_raw(store, prefix, version)
    return None if got is None else (got[1], got[2])


async def has_version(store: Store, prefix: str, version: int) -> bool:
    """Whether `version` exists (its MANIFEST does), with one HEAD."""
    try:
        await store.head(manifest_key(prefix, version))
    except ObjectNotFound:
        return False
    return True


async def list_versions(store: Store, prefix: str) -> list[int]:
    """Every committed version (one with a MANIFEST at its exact key), ascending."""
    found = (manifest_version(info.key[len(prefix):]) for info in await store.list(versions_prefix(prefix)))
    return sorted({v for v in found if v is not None})


async def find_latest(store: Store, prefix: str) -> int:
    """The newest committed version (0 if none): LATEST as a hint, then probing forward.

    LATEST is only a hint: one that is unreadable, not a positive int, or names a version
    with no MANIFEST is ignored, and the versions found by listing are used instead.
    """
    hint = await _latest_hint(store, prefix)
    if hint is None or not await has_version(store, prefix, hint):
        versions = await list_versions(store, prefix)
        return versions[-1] if versions else 0
    while await has_version(store, prefix, hint + 1):
        hint += 1
    return hint


async def _latest_hint(store: Store, prefix: str) -> int | None:
    try:
        data = await read_bounded(store, latest_key(prefix), _MAX_LATEST_BYTES)
        return msgspec.json.decode(data, type=_Latest).version
    except (ObjectNotFound, RefitError, msgspec.DecodeError):
        return None


async def write_latest(store: Store, prefix: str, version: int) -> None:
    await store.put(latest_key(prefix), msgspec.json.encode(_Latest(version)))


async def commit_manifest(store: Store, prefix: str, m: Manifest) -> None:
    """The conditional put that makes a version exist. Raises AlreadyExists if it lost."""
    await commit_manifest_bytes(store, prefix, m.version, encode_manifest(m))


async def commit_manifest_bytes(store: Store, prefix: str, version: int, data: bytes) -> None:
    """`commit_manifest` of a MANIFEST as stored (a relay copies it byte for byte)."""
    await store.put(manifest_key(prefix, version), data, if_none_match=True)


# -- garbage collection -----------------------------------------------------------------------


async def delete_version(store: Store, prefix: str, version: int, keys: Iterable[str] | None = None) -> None:
    """Delete `version`: its MANIFEST first, so it stops existing before its objects go, then
    `keys` (default: every key listed in its directory)."""
    manifest = manifest_key(prefix, version)
    await store.delete(manifest)
    if keys is None:
        keys = [info.key for info in await store.list(version_prefix(prefix, version))]
    for key in keys:
        if key != manifest:
            await store.delete(key)


async def collect_garbage(store: Store, prefix: str, latest: int, newest_key: int, keep: int) -> list[int]:
    """Delete versions older than both the last `keep` and the newest keyframe. Returns them.

    Versions above `latest` (a publisher may be writing one) are never touched.
    """
    floor = min(newest_key, latest - keep + 1)
    doomed = []
    while floor - len(doomed) > 1 and await has_version(store, prefix, floor - len(doomed) - 1):
        doomed.append(floor - len(doomed) - 1)  # versions are contiguous: probe down, never list them all
    for v in doomed:
        await delete_version(store, prefix, v)
    return doomed
