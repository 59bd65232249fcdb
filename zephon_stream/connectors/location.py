"""Where a prefix's objects live, whatever the spelling: one canonical `Location` per place.

    location("file:///data/./w//")                  file:///data/w/          (symlinks resolved too)
    location("s3://b//p/", {"endpoint_url": "HTTP://H:80/"})   s3://b/p/ at http://h:80
    location("p/", store=some_store)                 MemoryStore@7f3a.../p/   (this process only)

Two spellings of one place give equal locations (and equal text), so a relay can refuse a child
that overlaps its parent, and a subscriber's local record can name the prefix it came from.
Credentials and region are left out: they change who reads, not what is there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from zephon_stream.connectors import LocalStore, memory_store, parse_uri
from zephon_stream.connectors.base import Store

__all__ = ["Location", "location"]


@dataclass(frozen=True)
class Location:
    """A canonical place for objects: `path` within `space` (a directory tree, one bucket of one
    endpoint, or one store object). Two locations overlap when they share a space and one path
    starts the other. `str()` is a stable text of both (equal texts, equal locations)."""

    space: tuple[object, ...]
    path: str  # '/'-separated; ends with '/' unless it is a raw key prefix such as "p" (then "p*")
    text: str = field(compare=False)

    def __str__(self) -> str:
        return self.text

    def relation(self, other: Location) -> str | None:
        """How this location stands to `other`: "is", "lies inside", "contains", or None (disjoint)."""
        if self.space != other.space:
            return None
        if self.path == other.path:
            return "is"
        if self.path.startswith(other.path):
            return "lies inside"
        return "contains" if other.path.startswith(self.path) else None


def location(uri: str, options: Mapping[str, object] | None = None, store: Store | None = None) -> Location:
    """The location of `uri` opened with store `options`, or of key prefix `uri` in `store`.

    file://: the resolved directory (symlinks, `..`, `//` and `localhost` undone); s3://: the
    endpoint (as the store resolves it), bucket and normalised key; memory:// and a given store:
    the store object and normalised key. A given LocalStore is the directory it holds.
    """
    if store is not None:
        if isinstance(store, LocalStore):
            return _directory(str(store.root), uri)
        key = _key(uri)
        return Location(("store", id(store)), key, f"{type(store).__qualname__}@{id(store):x}/{key}")
    scheme, where, key = parse_uri(uri)
    if scheme == "file":
        return _directory(where, "")
    if scheme == "memory":
        return Location(("store", id(memory_store(where))), _key(key), f"memory://{where}/{_key(key)}")
    endpoint = _endpoint((options or {}).get("endpoint_url"))
    return Location((scheme, endpoint, where), _key(key), f"{scheme}://{where}/{_key(key)} at {endpoint}")


def _key(key: str) -> str:
    """A key prefix with empty, `.` and `..` segments resolved. S3 itself keeps `a//b` and `a/../b`
    as literal keys, but some S3-compatible servers and HTTP clients fold them, so two spellings
    that may reach the same objects are treated as one (a refusal, never a deletion)."""
    parts: list[str] = []
    for part in key.split("/"):
        if part == "..":
            parts = parts[:-1]
        elif part not in ("", "."):
            parts.append(part)
    tail = "/" if parts and (key.endswith("/") or key.rsplit("/", 1)[-1] in ("", ".", "..")) else ""
    return "/".join(parts) + tail


def _directory(root: str, key: str) -> Location:
    """The real directory of `key` under local `root` (which need not exist yet)."""
    head, _, tail = key.rpartition("/")
    real = os.path.realpath(os.path.join(root, head)).rstrip(os.sep) + "/"
    return Location(("file",), real + tail, f"file://{real}{tail}")


def _endpoint(url: object) -> str:
    """An endpoint URL as the S3 store resolves it (option, then the AWS environment variables),
    with case, default port, user info and a trailing '/' dropped; "aws" for AWS itself."""
    url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        return "aws"
    parts = urlsplit(str(url))
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    host = parts.hostname or parts.netloc.lower()
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"
