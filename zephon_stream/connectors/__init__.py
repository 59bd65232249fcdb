"""Object stores behind one small async interface, and URI parsing.

URIs: `file:///abs/dir/` (local directory), `memory://NAME/prefix/` (in-process fake),
`s3://bucket/prefix/` (S3 or any S3-compatible endpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote, urlparse

from .._exceptions import ConfigError
from .base import ObjectInfo, Store, StoreStatistics
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["LocalStore", "MemoryStore", "ObjectInfo", "Store", "StoreStatistics", "open_store", "register_scheme"]

_MEMORY: dict[str, MemoryStore] = {}
_SCHEMES: dict[str, Callable[..., Store]] = {}


def memory_store(name: str) -> MemoryStore:
    """The process-wide memory store called `name` (created on first use)."""
    return _MEMORY.setdefault(name, MemoryStore())


def register_scheme(scheme: str, factory: Callable[..., Store]) -> None:
    """Make `open_store` build stores for `scheme://bucket/prefix` URIs with `factory(bucket, **options)`."""
    _SCHEMES[scheme] = factory


def open_store(uri: str, **options: object) -> tuple[Store, str]:
    """Parse `uri` into (store, key prefix). The prefix is '' or ends with '/'."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URI {uri!r} names host {parsed.netloc!r}: use file:///absolute/path/")
        return LocalStore(unquote(parsed.path)), ""
    prefix = parsed.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    if parsed.scheme == "memory":
        return memory_store(parsed.netloc), prefix
    if parsed.scheme == "s3" and "s3" not in _SCHEMES:
        from . import s3 as _s3  # noqa: F401  (registers the scheme)
    if parsed.scheme in _SCHEMES:
        if not parsed.netloc:
            raise ConfigError(f"URI {uri!r} has no bucket: use {parsed.scheme}://bucket/prefix/")
        return _SCHEMES[parsed.scheme](parsed.netloc, **options), prefix
    raise ConfigError(f"unsupported URI scheme in {uri!r}: use file://, s3:// or memory://")
