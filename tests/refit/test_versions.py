"""The key layout of a prefix: keys built and parsed by one module, versions listed strictly."""

from __future__ import annotations

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream.connectors import MemoryStore
from zephon_stream.connectors.base import ObjectInfo
from zephon_stream.refit.versions import (
    OBJECT_KINDS,
    ObjectName,
    find_latest,
    list_versions,
    manifest_key,
    manifest_version,
    object_key,
    parse_object,
    part_key,
    relayed_keys,
    version_of,
    write_latest,
)

ATTEMPT = "0123abcd"


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 48), st.integers(0, 1 << 40), st.sampled_from(OBJECT_KINDS))
def test_keys_parse_back(version: int, index: int, kind: str) -> None:
    assert manifest_version(manifest_key("", version)) == version
    assert version_of(object_key("", version, kind, index, ATTEMPT)) == version
    name = object_key("", version, kind, index, ATTEMPT).partition("/")[2]
    assert parse_object(name) == ObjectName(kind, index, ATTEMPT)


# Keys a publisher never writes: not version 1 (or any version) to anybody who reads a listing.
STRANGERS = ["v01/MANIFEST", "v0/MANIFEST", "v\u0661/MANIFEST", "v1x/MANIFEST", "v1/MANIFEST.bak",
             "v1/x/MANIFEST", "vault/MANIFEST", "V1/MANIFEST", " v1/MANIFEST", "v" + "9" * 5000 + "/MANIFEST"]


def test_leading_zeros_and_other_spellings_are_no_version() -> None:
    for rel in STRANGERS:
        assert manifest_version(rel) is None, rel
    for rel in ("v01/chunk-1.0123abcd", "v\u0661/chunk-1.0123abcd", "v" + "1" * 5000 + "/x"):
        assert version_of(rel) is None, rel
    for name in ("chunk-01.0123abcd", "chunk-\u0661.0123abcd", "chunk-1.0123ABCD", "chunk-1.0123abc",
                 "part-1.0123abcd", "chunk-1.0123abcd/x", "chunk--1.0123abcd"):
        assert parse_object(name) is None, name


def test_listing_finds_only_exact_manifest_keys() -> None:
    async def main() -> None:
        store = MemoryStore()
        for rel in [*STRANGERS, "v2/MANIFEST", "v10/MANIFEST", "v10/chunk-0.0123abcd"]:
            await store.put(f"p/{rel}", b"")
        assert await list_versions(store, "p/") == [2, 10]
        assert await find_latest(store, "p/") == 10  # no LATEST: the listing decides
        await write_latest(store, "p/", 1)  # a hint naming no MANIFEST is ignored
        assert await find_latest(store, "p/") == 10

    anyio.run(main)


def test_relayed_keys_are_manifests_and_named_objects_only() -> None:
    keys = ["c/v1/MANIFEST", "c/v1/chunk-0.0123abcd", "c/v1/key-12.0123abcd", "c/v01/MANIFEST",
            "c/v2/chunk-01.0123abcd", "c/v2/notes.txt", part_key("c/", 2, 0, ATTEMPT), "c/v3/sub/MANIFEST",
            "d/v1/MANIFEST", "c/v4/over-3.0123abcd"]
    infos = [ObjectInfo(k, 1, "e") for k in keys]
    assert relayed_keys("c/", infos) == {1: ["c/v1/MANIFEST", "c/v1/chunk-0.0123abcd", "c/v1/key-12.0123abcd"],
                                         4: ["c/v4/over-3.0123abcd"]}
