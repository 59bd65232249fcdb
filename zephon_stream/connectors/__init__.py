"""Object stores behind one small async interface, and URI parsing.

URIs: `file:///abs/dir/` (local directory), `memory://NAME/prefix/` (in-process fake),
`s3://bucket/prefix/` (S3 or any S3-compatible endpoint).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from urllib.parse import unquote, urlparse

from zephon_stream.connectors.base import ObjectInfo, Store, StoreStatistics
from zephon_stream.connectors.local import LocalStore
from zephon_stream.connectors.memory import MemoryStore
from zephon_stream.errors import ConfigError

__all__ = ["LocalStore", "MemoryStore", "ObjectInfo", "Store", "StoreStatistics", "folder_uri", "missing_locally",
           "open_store", "parse_uri", "register_scheme"]

_MEMORY: dict[str, MemoryStore] = {}
_SCHEMES: dict[str, Callable[..., Store]] = {}


def memory_store(name: str) -> MemoryStore:
    """The process-wide memory store called `name` (created on first use)."""
    return _MEMORY.setdefault(name, MemoryStore())


def register_scheme(scheme: str, factory: Callable[..., Store]) -> None:
    """Make `open_store` build stores for `scheme://bucket/prefix` URIs with `factory(bucket, **options)`."""
    _SCHEMES[scheme] = factory


def parse_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, location, key prefix): the location is a directory (file://), a store name
    (memory://) or a bucket; the prefix is '' or ends with '/' (always '' for file://)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URI {uri!r} names host {parsed.netloc!r}: use file:///absolute/path/")
        return "file", unquote(parsed.path), ""
    if parsed.scheme not in ("memory", "s3", *_SCHEMES):
        raise ConfigError(f"unsupported URI scheme in {uri!r}: use file://, s3:// or memory://")
    if not parsed.netloc:
        raise ConfigError(f"URI {uri!r} has no bucket: use {parsed.scheme}://bucket/prefix/")
    prefix = parsed.path.lstrip("/")
    return parsed.scheme, parsed.netloc, prefix + "/" if prefix and not prefix.endswith("/") else prefix


def missing_locally(uri: str) -> bool:
    """Whether `uri` (a URI, or a plain local path) names a local path that does not exist: a
    mistyped folder, which a store lists as empty. False for other stores."""
    if "://" not in uri:
        return not os.path.exists(uri)
    scheme, location, _ = parse_uri(uri)
    return scheme == "file" and not os.path.exists(location)


def folder_uri(text: str) -> str:
    """A prefix as given on a command line: a URI as it is, or a local folder's path as its file://
    URI (as a source's path in a loader config is)."""
    if "://" in text:
        return text
    from pathlib import Path

    return Path(text).resolve().as_uri() + "/"


def open_store(uri: str, **options: object) -> tuple[Store, str]:
    """Parse `uri` into (store, key prefix). The prefix is '' or ends with '/'."""
    scheme, location, prefix = parse_uri(uri)
    if scheme == "file":
        return LocalStore(location), ""
    if scheme == "memory":
        return memory_store(location), prefix
    if scheme == "s3" and "s3" not in _SCHEMES:  # aiobotocore is imported for the first s3:// URI only
        from zephon_stream.connectors.s3 import S3Store

        register_scheme("s3", S3Store)
    return _SCHEMES[scheme](location, **options), prefix
