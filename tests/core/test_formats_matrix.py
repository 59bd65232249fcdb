"""The whole determinism matrix (tests/core/test_determinism.py) for Parquet and gzip sources:
the same tests, collected again here with `config` the Parquet or the gzip copy of the text data,
the image+text config with its images in a Parquet HF `Image` column (pixels digested too), or
the text data with one file as a single gzip member whose share of splits the others take.

Also: the formats give the same documents as the JSONL originals, Parquet reads fetch only the
needed column chunks, and gzip files split where they have members."""

from __future__ import annotations

import anyio
import pytest

from tests.core.test_determinism import (  # noqa: F401  (collected here with this module's `config`)
    baseline,
    test_buffer_capacities,
    test_epochs_to_the_end_and_resume_at_epoch_boundary,
    test_injected_read_latency,
    test_read_ahead_window_does_not_change_order,
    test_refuses_world_that_cannot_keep_order,
    test_resume_on_both_sides_of_the_first_epoch_crossing,
    test_resume_onto_other_world_and_backend,
    test_resume_twice,
    test_world_sizes_and_backends,
)
from zephon_stream.connectors import open_store
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.plan import plan_data
from zephon_stream.operators.sources import make_parser, make_reader
from zephon_stream.testing.determinism import real, run_world


@pytest.fixture(params=["parquet", "gzip", "vision_parquet", "refilled"])
def config(request):
    return request.getfixturevalue(f"{request.param}_config")


def _plan(config):
    async def main():
        stores = []
        for src in config.sources:
            store, _ = open_store(src.uri)
            stores.append(await store.__aenter__())
        return await plan_data(config, stores), stores
    return anyio.run(main)


def _documents(config, source: int) -> list[str]:
    """Every document of `source`, split by split in plan order, through the loader's reader and parser."""
    plan, stores = _plan(config)
    src = plan.sources[source]
    parser = make_parser(config, source, src)

    async def main():
        out = []
        for split in src.splits:
            reader = make_reader(config, source, src, stores[source], split, None, parser.bad)
            async for pos, block in reader.blocks():
                out += [text for _, _, text in parser.parse(reader, pos, block)]
        return out
    return anyio.run(main)


def test_same_documents_as_the_jsonl_originals(config, dataset, vision_parquet_dataset):
    if config.vision is not None:  # the images come out as they went in, byte for byte
        _, images = vision_parquet_dataset
        assert [rec.image for rec in _documents(config, 0)] == images
        return
    _, docs = dataset
    assert _documents(config, 0) == docs["a"]
    assert _documents(config, 1) == docs["b"]


def test_splits_follow_row_groups_and_members(parquet_config, gzip_config):
    parquet, _ = _plan(parquet_config)
    assert parquet.sources[0].format == "parquet"
    assert [s.rows[-1] for s in parquet.sources[0].shards] == [200, 200, 200]
    assert len(parquet.sources[0].splits) > 3  # several row groups per file: several splits
    gz, _ = _plan(gzip_config)
    a, b = gz.sources
    assert [len(s.frames) - 1 for s in a.shards] == [12, 12, 12]  # a member every 17 of 200 lines
    assert len(a.splits) > 3
    assert [len(s.frames) - 1 for s in b.shards] == [1] * 12 and len(b.splits) == 12  # one member: one split
    assert not any(sp.refilled for sp in [*parquet.sources, a, b])  # each shard gave its share


def test_a_single_member_file_leaves_its_share_of_splits_to_the_others(refilled_config):
    a, b = _plan(refilled_config)[0].sources
    assert a.refilled and not b.refilled
    per_shard = [[s.shard for s in a.splits].count(i) for i in range(3)]
    assert per_shard[2] == 1 and per_shard[0] + per_shard[1] + 1 == len(a.splits) and len(a.splits) % 12 == 0


def test_parquet_reads_only_the_needed_column_chunks(parquet_config):
    """Source b's files hold `doc.lang` too: apart from the footer read (the file's last 64 KiB, here
    the whole small file), every read lies inside a `doc.body` chunk."""
    import os

    import pyarrow.parquet as pq

    reads = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def read(self, key, start=0, end=None):
            reads.append((str(self.inner.root / key), start, end))
            return await self.inner.read(key, start, end)

    cfg = parquet_config.replace(sources=parquet_config.sources[1:])
    loader = Loader(cfg, backend="inline", wrap_store=Recording)
    next(iter(loader))
    loader.close()
    allowed = {}
    for key in {k for k, _, _ in reads}:
        meta = pq.read_metadata(key)
        for g in range(meta.num_row_groups):
            for c in range(meta.row_group(g).num_columns):
                chunk = meta.row_group(g).column(c)
                start = min(o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o)
                allowed.setdefault(key, []).append((chunk.path_in_schema, start, start + chunk.total_compressed_size))
    chunks = [r for r in reads if r[2] != os.path.getsize(r[0])]
    outside = [r for r in chunks if not any(p == "doc.body" and a <= r[1] and r[2] <= b for p, a, b in allowed[r[0]])]
    assert chunks and not outside, outside[:3]


def test_parquet_and_gzip_mixed_with_jsonl(parquet_config, gzip_config, config):
    """One config may take Parquet, gzip and JSONL sources side by side, on any dp size."""
    cfg = parquet_config.replace(sources=[parquet_config.sources[0], gzip_config.sources[1]])
    one, _ = run_world(cfg, 1, 6, backend="inline")
    assert real(run_world(cfg, 3, 6, backend="threads")[0]) == real(one)
