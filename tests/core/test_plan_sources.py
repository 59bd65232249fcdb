"""Planning a config's sources: at the same time, with the result and the errors of one after another."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import pytest

from zephon_stream import ConfigError, Loader, SourceConfig
from zephon_stream.loader.plan import open_stores, plan_data
from zephon_stream.testing.stores import WrappedStore


class Watched(WrappedStore):
    """Every list sleeps `ms`, every read 10 ms; the lists, and the reads, in flight across all
    watched stores are counted."""

    in_flight = peak = reads = peak_reads = 0

    def __init__(self, inner, ms: float) -> None:
        super().__init__(inner)
        self.ms = ms

    async def list(self, prefix: str = ""):
        Watched.in_flight += 1
        Watched.peak = max(Watched.peak, Watched.in_flight)
        try:
            await anyio.sleep(self.ms / 1000)
            return await self.inner.list(prefix)
        finally:
            Watched.in_flight -= 1

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        Watched.reads += 1
        Watched.peak_reads = max(Watched.peak_reads, Watched.reads)
        try:
            await anyio.sleep(0.01)
            return await self.inner.read(key, start, end)
        finally:
            Watched.reads -= 1


def _plan(cfg, ms):
    async def go():
        async with AsyncExitStack() as stack:
            stores = await open_stores(cfg, stack)
            return await plan_data(cfg, [Watched(s, m) for s, m in zip(stores, ms, strict=True)])
    Watched.in_flight = Watched.peak = Watched.reads = Watched.peak_reads = 0
    return anyio.run(go)


def _sources(dataset, names):
    root, _ = dataset
    return [SourceConfig(name=f"{n}{i}", uri=f"file://{root}/{n}/") for i, n in enumerate(names)]


def test_sources_are_planned_at_once_and_kept_in_config_order(config, dataset):
    cfg = config.replace(sources=_sources(dataset, "abab"))
    plan = _plan(cfg, [90, 30, 70, 50])  # the first listed last
    assert Watched.peak == 4
    assert [sp.name for sp in plan.sources] == ["a0", "b1", "a2", "b3"]
    assert plan == _plan(cfg, [30, 90, 50, 70])  # shards, splits and the fingerprint, whatever the timing


def test_the_sources_share_one_bound_on_the_shards_planned_at_once(config, dataset, monkeypatch):
    """A shard's plan may hold a scan of 8-16 MiB: sources at once must not multiply them."""
    from zephon_stream.operators import read

    monkeypatch.setattr(read, "PLAN_WORKERS", 3)
    cfg = config.replace(sources=_sources(dataset, "abab"))
    plan = _plan(cfg, [5, 5, 5, 5])
    assert Watched.peak == 4 and 2 <= Watched.peak_reads <= 3
    assert sum(len(sp.shards) for sp in plan.sources) > 3  # more shards than the bound


def test_the_error_is_the_first_failing_sources_however_the_plans_overlap(config, dataset, tmp_path):
    root, _ = dataset
    (tmp_path / "empty1").mkdir()
    (tmp_path / "empty3").mkdir()
    sources = _sources(dataset, "abab")
    sources[1] = SourceConfig(name="e1", uri=f"file://{tmp_path}/empty1/")
    sources[3] = SourceConfig(name="e3", uri=f"file://{tmp_path}/empty3/")
    cfg = config.replace(sources=sources)
    for ms in ([0, 50, 0, 0], [0, 0, 0, 50], [50, 50, 50, 0]):  # e3 fails first in time, or e1 does
        with pytest.raises(ConfigError, match=r"^source 'e1': no "):
            _plan(cfg, ms)


def test_warnings_come_in_config_order_whichever_source_finishes_first(config, dataset, caplog):
    cfg = config.replace(lanes=64, global_batch_size=64, sources=_sources(dataset, "abab"))
    with caplog.at_level("WARNING", logger="zephon_stream.loader"):
        _plan(cfg, [90, 30, 70, 10])
    warned = [r.getMessage().split()[1] for r in caplog.records if "splits for 64 lanes" in r.getMessage()]
    assert warned == ["'b1'", "'b3'"]  # b3 finishes first; a's sources have splits enough


def test_a_uri_that_names_one_object_says_so(config) -> None:
    # an s3:// (or memory://) uri is a prefix: one naming a shard listed nothing under it, and the
    # message said the folder "holds no object"
    from zephon_stream.connectors import memory_store

    memory_store("one-object").objects["data/part 0.jsonl"] = b'{"text": "a document"}\n'
    src = SourceConfig(name="x", uri="memory://one-object/data/part 0.jsonl")
    with pytest.raises(ConfigError, match=r"source 'x': memory://one-object/data/part 0.jsonl names one object, not a "
                                          r"folder \(a prefix\) of shards: give the prefix it is under, "
                                          r"memory://one-object/data/, to read every shard there"):
        next(iter(Loader(config.replace(sources=[src]), backend="inline")))
