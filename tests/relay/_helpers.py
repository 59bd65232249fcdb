"""Helpers of the relay tests: what a watcher checks at a child prefix, and bounded waits."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from tests.refit._helpers import assert_same, model, raw, step, zeros_like  # noqa: F401  (re-exported)
from zephon_stream import ObjectNotFound
from zephon_stream.connectors.base import Store
from zephon_stream.refit.manifest import decode_manifest
from zephon_stream.refit.versions import chunk_key, list_versions, manifest_key, version_prefix


async def committed(store: Store, prefix: str) -> list[int]:
    """Versions with a MANIFEST under `prefix`, ascending."""
    return await list_versions(store, prefix)


async def assert_no_partial_version(store: Store, prefix: str) -> list[int]:
    """Every version visible under `prefix` has every object its MANIFEST names, at its size.

    A version whose MANIFEST is gone by the time an object is found missing was being
    garbage-collected (MANIFEST first), which is allowed. Returns the versions checked.
    """
    seen = []
    for v in await committed(store, prefix):
        key = manifest_key(prefix, v)
        try:
            m, _ = decode_manifest(await store.read(key), key)
        except ObjectNotFound:
            continue
        have = {o.key: o.size for o in await store.list(version_prefix(prefix, v))}
        want = {chunk_key(prefix, m, i, what): size for i, c in enumerate(m.chunks)
                for what, size in (("chunk", c.size), ("key", c.key_size), ("over", c.over_size)) if size}
        wrong = {k: (s, have.get(k)) for k, s in want.items() if have.get(k) != s}
        if wrong:
            try:
                await store.head(key)
            except ObjectNotFound:
                continue  # collected while we looked
            raise AssertionError(f"partial version {v} visible under {prefix}: {len(wrong)} objects "
                                 f"missing or short, e.g. {next(iter(wrong.items()))}")
        seen.append(v)
    return seen


async def until(check: Callable[[], Awaitable[bool]], *, timeout: float = 30.0, every: float = 0.01) -> None:
    """Poll `check` until it holds, at most `timeout` seconds."""
    with anyio.fail_after(timeout):
        while not await check():
            await anyio.sleep(every)


def snapshot(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}
