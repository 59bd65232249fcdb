"""The data plan: every source listed, cut into splits and fingerprinted once per run, and the
stores that serve the sources (S3 sources share one client pool)."""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack
from typing import Any

import anyio
import msgspec

from zephon_stream.connectors import open_store, parse_uri
from zephon_stream.connectors.base import Store
from zephon_stream.engine.ordered import run_ordered
from zephon_stream.errors import in_source
from zephon_stream.loader.config import Config
from zephon_stream.operators import read
from zephon_stream.operators.read import SourcePlan, plan_source

__all__ = ["DataPlan", "SourceData", "old_split_digest", "open_stores", "plan_data"]


class SourceData(msgspec.Struct, frozen=True, array_like=True):
    """One source's data as a checkpoint remembers it, to name what changed: its shards, their
    bytes, and the digest of their keys, sizes and ETags."""

    shards: int
    nbytes: int
    digest: str

    def describe(self) -> str:
        return f"{self.shards} shard{'s' if self.shards != 1 else ''} of {self.nbytes:,} bytes"


class DataPlan(msgspec.Struct, frozen=True):
    """Every source's shards and splits, and the data fingerprint (with each source's part)."""

    sources: list[SourcePlan]
    fingerprint: str
    by_source: dict[str, SourceData] = {}


SOURCES_AT_ONCE = 8  # sources planned at once (their shards: PLAN_WORKERS at once in all)


async def plan_data(config: Config, stores: list[Store]) -> DataPlan:
    """List and split every source of `config` (read through `stores`, one per source).

    Sources are planned at the same time (a mixture of many sources starts in the latency of
    its slowest, not in the sum of them all); a failure is that of the first failing source in
    the config's order, as if they had been planned one after another."""
    sources: list[SourcePlan] = []
    shards_at_once = anyio.CapacityLimiter(read.PLAN_WORKERS)  # shared: a shard's scan holds up to 16 MiB

    async def plan(i: int) -> SourcePlan:
        src, store = config.sources[i], stores[i]
        field, kind = (src.messages_field, "messages") if src.messages_field is not None else (src.text_field, "text")
        with in_source(src.name, src.uri):
            return await plan_source(store, parse_uri(src.uri)[2], src.name, src.uri, field,
                                     config.lanes, config.split_bytes, config.on_bad_record,
                                     images=src.image_field is not None, max_record=config.max_record_bytes,
                                     image_field=src.image_field, text_kind=kind, tools_field=src.tools_field,
                                     documents_field=src.documents_field, limiter=shards_at_once)

    async def keep(_: int, sp: SourcePlan) -> None:
        read.warn_coarse(sp, config.lanes, config.max_epochs)  # in the config's order, whichever source finished first
        sources.append(sp)

    if len(stores) != len(config.sources):
        raise ValueError(f"{len(config.sources)} sources and {len(stores)} stores")
    await run_ordered(range(len(stores)), plan, keep, workers=SOURCES_AT_ONCE, window=SOURCES_AT_ONCE,
                      defer_errors=True)
    h, by_source = hashlib.sha256(), {}
    for sp in sources:
        listing = _listing(sp, sp.refilled)
        h.update(listing)
        by_source[sp.name] = SourceData(len(sp.shards), sum(s.size for s in sp.shards),
                                        hashlib.sha256(listing).hexdigest()[:16])
    return DataPlan(sources, h.hexdigest()[:32], by_source)


def _listing(sp: SourcePlan, refilled: bool) -> bytes:
    """What a source's data digest is taken of: its shards' keys, sizes and ETags, and a mark where
    its splits are not split plan 2's (`SourcePlan.refilled`): the same listing then has another
    digest, and a checkpoint written over the old splits is refused (the sources whose splits did
    not change keep their digests, and their checkpoints resume)."""
    return msgspec.msgpack.encode([sp.name, [(s.key, s.size, s.etag) for s in sp.shards]]
                                  + (["splits: a coarse shard's share refilled"] if refilled else []))


def old_split_digest(sp: SourcePlan) -> str | None:
    """A refilled source's data digest as a version before the refill gave it (None if not refilled):
    a checkpoint with that digest was written over the same data, cut into other splits."""
    return hashlib.sha256(_listing(sp, False)).hexdigest()[:16] if sp.refilled else None


async def open_stores(config: Config, stack: AsyncExitStack, wrap: Any = None, *, planned: bool = False) -> list[Store]:
    """Open (and register for closing) one store per source, wrapped by `wrap(store)` if given.

    `planned`: the data was planned through these endpoints already (a worker's stores), so an S3
    outage is ridden out from the first request, not only once the endpoint has answered here.

    S3 sources share one client pool: one client per endpoint and credentials, entered once and
    closed once, and one limiter on the requests in flight across all sources.
    """
    stores = []
    pool = None
    for src in config.sources:
        opts: dict[str, Any] = {k: v for k, v in (("endpoint_url", src.endpoint_url), ("region", src.region),
                                                  ("addressing_style", src.addressing_style),
                                                  ("profile", src.profile)) if v is not None}
        if parse_uri(src.uri)[0] == "s3":
            opts.update(connect_timeout=src.connect_timeout, read_timeout=src.read_timeout,
                        max_attempts=src.max_attempts, retry_deadline=src.retry_deadline, answered=planned)
            if pool is None:
                from zephon_stream.connectors.s3 import S3ClientPool

                pool = await stack.enter_async_context(S3ClientPool())
            opts["pool"] = pool
        store, _ = open_store(src.uri, **opts)
        store = await stack.enter_async_context(store)
        stores.append(wrap(store) if wrap else store)
    return stores
