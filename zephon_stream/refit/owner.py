"""The store behind a publisher or subscriber: opened from its URI on entry, unless one was given."""

from __future__ import annotations

from typing import Self

from zephon_stream.connectors import open_store
from zephon_stream.connectors.base import Store
from zephon_stream.errors import RefitError

__all__ = ["StoreOwner"]


class StoreOwner:
    """An async context manager over the prefix `uri` (a URI, or a key prefix of a given `store`).

    It opens the URI's store on entry unless a store was given, and closes only a store it opened.
    `key_prefix` is where the versions live inside the store ("" or ending in '/').
    """

    def __init__(self, uri: str, store: Store | None) -> None:
        self.uri = uri
        self._store = store
        self._key_prefix = uri if store is not None else ""
        self._owned = False

    async def __aenter__(self) -> Self:
        if self._store is None:
            self._store, self._key_prefix = open_store(self.uri)
            self._owned = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._owned and self._store is not None:
            store, self._store, self._owned = self._store, None, False  # closed: entering again reopens it
            await store.aclose()

    @property
    def is_open(self) -> bool:
        """Whether it has a store: entered, or given one."""
        return self._store is not None

    @property
    def store(self) -> Store:
        if self._store is None:
            name = type(self).__name__
            raise RefitError(f"{self!r} is not open: use `async with {name}(...) as {name[:3].lower()}:`")
        return self._store

    @property
    def key_prefix(self) -> str:
        return self._key_prefix
