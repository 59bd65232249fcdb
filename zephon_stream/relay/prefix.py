"""The prefixes of a relay: how each is reached, that none overlaps another, and their stores.

A relay writes and deletes under its children, so a child that is, holds or lies inside the
parent or another child, however spelled, is refused before anything runs (`check_disjoint`,
on `connectors.location`). Prefixes one store object can serve (one scheme, bucket, endpoint and
credentials) share it (`open_stores`), so a copy between them can stay on the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlparse

from zephon_stream.connectors import open_store, parse_uri
from zephon_stream.connectors.base import Store
from zephon_stream.connectors.location import Location, location
from zephon_stream.errors import ConfigError

__all__ = ["Prefix", "check_disjoint", "open_stores"]


class Prefix:
    """A refit prefix and how to reach it: a URI plus its store's options (endpoint, region,
    credentials...), or a key prefix of an open `store`. Options never show in a repr or a log."""

    def __init__(self, uri: str, *, store: Store | None = None, **options: Any) -> None:
        if store is None:
            parse_uri(uri)  # a bad URI fails here, not at the first sync
        self.uri, self.store, self.options = uri, store, options

    @property
    def name(self) -> str:
        """The URI, and the endpoint's host when one is given (never its user info)."""
        endpoint = self.options.get("endpoint_url")
        host = urlparse(str(endpoint)).netloc.rpartition("@")[2] if endpoint else ""
        return f"{self.uri}@{host}" if host else self.uri

    def __repr__(self) -> str:
        return f"Prefix({self.name!r})"

    def store_identity(self) -> object:
        """Equal for prefixes one store object can serve (same scheme, bucket, endpoint, credentials)."""
        if self.store is not None:
            return id(self.store)
        scheme, where, _ = parse_uri(self.uri)
        return scheme, where, tuple(sorted((k, repr(v)) for k, v in self.options.items()))

    def location(self) -> Location:
        """Where the prefix's objects live, whatever the spelling (see `connectors.location`)."""
        return location(self.uri, self.options, self.store)


def check_disjoint(parent: Prefix, children: Sequence[Prefix]) -> None:
    """Refuse children that overlap the parent or each other, wherever the spellings differ.

    A relay writes under each child and deletes there (retention), so a child that is, holds or
    sits inside its parent, or another child, would lose data. Raises ConfigError naming both."""
    seen = [(parent, parent.location())]
    for child in children:
        here = child.location()
        for other, there in seen:
            relation = here.relation(there)
            if relation is not None:
                role = "its parent" if other is parent else "another child"
                raise ConfigError(
                    f"relay child {child.name} ({here}) {relation} {role} {other.name} ({there}): a relay "
                    "writes and deletes under its children, so a child must not overlap the parent or "
                    "another child; give each child its own prefix outside the others")
        seen.append((child, here))


def open_stores(prefixes: Sequence[Prefix], stack: AsyncExitStack) -> list[tuple[Store, str]]:
    """(store, key prefix) of each prefix: a given store as it is, else one store per identity,
    opened here and closed by `stack`."""
    opened: dict[object, Store] = {}
    out = []
    for p in prefixes:
        if p.store is not None:
            out.append((p.store, p.uri))
            continue
        ident = p.store_identity()
        if ident not in opened:
            store, key = open_store(p.uri, **p.options)
            stack.push_async_callback(store.aclose)
            opened[ident] = store
        else:  # same bucket and endpoint: one store, and copies stay server-side
            key = parse_uri(p.uri)[2]
        out.append((opened[ident], key))
    return out
