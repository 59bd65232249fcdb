"""A restore reads a checkpoint's documents by position: only the bytes of the documents its draws
ask for (`SplitReader.lines_at`, `loader.reread.Documents`), and resumes into the same order."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import anyio
import msgspec
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.conftest import Config, SourceConfig, make_docs
from zephon_stream.connectors.local import LocalStore
from zephon_stream.formats.jsonl_zst import seek_table, write_jsonl_shards
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.reread import Documents
from zephon_stream.loader.state import LoaderState
from zephon_stream.operators.read import BadRecords, Parser, ShardPlan, Split, SplitReader, plan_shard
from zephon_stream.testing.determinism import run_world
from zephon_stream.testing.stores import WrappedStore


class Recording(WrappedStore):
    """Records every ranged read `(key, start, end)`."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.reads: list[tuple[str, int, int | None]] = []

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self.reads.append((key, start, end))
        return await self.inner.read(key, start, end)


@pytest.fixture(scope="module")
def seekable(tmp_path_factory) -> Path:
    """Source c: JSONL.zst with seek tables (frames of about 1 KiB); source d: plain JSONL."""
    root = tmp_path_factory.mktemp("seekable")
    rng = random.Random(11)
    write_jsonl_shards([(str(i), t) for i, t in enumerate(make_docs(rng, 500, 80))], root / "c", name="c",
                       shards=3, compress="zst", frame_bytes=1024)
    write_jsonl_shards([(str(i), t) for i, t in enumerate(make_docs(rng, 300, 40))], root / "d", name="d", shards=2)
    return root


# ---- SplitReader.lines_at ----------------------------------------------------------------------

def _scan(reader: SplitReader) -> dict[int, bytes]:
    """Every record the split owns, by a scan from its start: offset -> its line."""
    async def main() -> dict[int, bytes]:
        out = {}
        async for pos, block in reader.blocks():
            for off, n, _ in Parser("text", "error").parse(reader, pos, block):
                out[off] = block[off - pos:off - pos + n]
        return out
    return anyio.run(main)


def _shard(root: Path, key: str, store=None) -> tuple[Recording, ShardPlan]:
    store = Recording(store or LocalStore(root))
    info = anyio.run(store.inner.head, key)
    return store, anyio.run(plan_shard, store, info)


def test_lines_at_gives_each_record_as_the_scan_does_decoding_only_its_frames(seekable, monkeypatch) -> None:
    store, shard = _shard(seekable / "c", "c-00001.jsonl.zst")
    assert len(shard.content) == len(shard.frames) > 8, "a seek table with decompressed sizes"
    decoded: list[tuple[int, int]] = []
    decode = SplitReader._decode_frames
    monkeypatch.setattr(SplitReader, "_decode_frames", lambda r, a, b, data: decoded.append((a, b)) or decode(
        r, a, b, data))
    last = len(shard.frames) - 1
    for split in (Split(0, 0, last // 3), Split(0, last // 3, last)):
        records = _scan(SplitReader(store, shard, split, 1 << 20))
        assert len(records) > 20
        for offset, line in records.items():
            store.reads.clear()
            decoded.clear()
            got = anyio.run(SplitReader(store, shard, split, 1 << 20).lines_at, {offset: len(line)})
            assert got == {offset: line}
            [(a, b)] = decoded  # the frames that hold the record, and the one with the byte before it
            assert b - a <= 2 and shard.content[a] <= shard.content[split.start] + offset < shard.content[b + 1]
            frames = [r for r in store.reads if r[1:] == (shard.frames[a], shard.frames[b + 1])]
            headers = [r for r in store.reads if r not in frames]
            assert len(frames) == 1 and all(r[2] <= shard.frames[a] for r in headers)
            assert len(headers) == (a > split.start), "small frames: their headers in one read"
            assert {f for f in range(split.start, a)} <= {f for r in headers for f in range(last)
                                                          if r[1] <= shard.frames[f] and shard.frames[f] + 4 <= r[2]}


def test_lines_at_gives_the_records_it_passed_over_and_nothing_that_is_not_a_record(seekable) -> None:
    store, shard = _shard(seekable / "c", "c-00000.jsonl.zst")
    split = Split(0, 2, 6)
    records = _scan(SplitReader(store, shard, split, 1 << 20))
    offsets = sorted(records)
    first = offsets[len(offsets) // 2]
    reader = SplitReader(store, shard, split, 1 << 20)
    got = anyio.run(reader.lines_at, {first: len(records[first])}, offsets)
    assert first in got and len(got) > 1 and all(records[o] == line for o, line in got.items())
    wrong = {first + 1: 10, -5: 3, 10**9: 3}  # inside a record, before and past the split
    assert anyio.run(reader.lines_at, wrong) == {}
    after = _scan(SplitReader(store, shard, Split(0, 6, 9), 1 << 20))
    assert anyio.run(reader.lines_at, {min(after) + shard.content[6] - shard.content[2]: 5}) == {}, "not owned"


def test_lines_at_for_plain_jsonl_reads_the_record_and_the_byte_before(seekable) -> None:
    store, shard = _shard(seekable / "d", "d-00000.jsonl")
    split = Split(0, shard.size // 3, 2 * shard.size // 3)
    records = _scan(SplitReader(store, shard, split, 1 << 20))
    for offset, line in list(records.items())[:20]:
        store.reads.clear()
        assert anyio.run(SplitReader(store, shard, split, 1 << 20).lines_at, {offset: len(line)}) == {offset: line}
        assert store.reads == [("d-00000.jsonl", split.start + offset - 1, split.start + offset + len(line))]
    assert anyio.run(SplitReader(store, shard, split, 1 << 20).lines_at, {min(records) + 1: 4}) == {}


def _frames_without_sizes(path: Path, lines: list[bytes], content_size: bool) -> ShardPlan:
    cctx = zstandard.ZstdCompressor(write_content_size=content_size)
    frames = [cctx.compress(b"".join(lines[i:i + 5])) for i in range(0, len(lines), 5)]
    path.write_bytes(b"".join(frames) + seek_table([(len(f), len(b"".join(lines[i * 5:i * 5 + 5])))
                                                     for i, f in enumerate(frames)]))
    return anyio.run(plan_shard, LocalStore(path.parent), anyio.run(LocalStore(path.parent).head, path.name))


def test_lines_at_declines_where_only_a_scan_knows_the_offsets(tmp_path) -> None:
    lines = [msgspec.json.encode({"text": f"document {i} " * (i % 7 + 1)}) + b"\n" for i in range(40)]
    store = LocalStore(tmp_path)
    shard = _frames_without_sizes(tmp_path / "nosize.jsonl.zst", lines, content_size=False)
    split = Split(0, 0, len(shard.frames) - 1)
    records = _scan(SplitReader(store, shard, split, 1 << 20))
    late = max(records)
    assert anyio.run(SplitReader(store, shard, split, 1 << 20).lines_at, {late: len(records[late])}) is None
    shard = _frames_without_sizes(tmp_path / "sized.jsonl.zst", lines, content_size=True)
    assert anyio.run(SplitReader(store, shard, split, 1 << 20).lines_at, {late: len(records[late])}) == {
        late: records[late]}
    lying = msgspec.structs.replace(shard, content=[c + (3 if i >= 2 else 0) for i, c in enumerate(shard.content)])
    assert anyio.run(SplitReader(store, lying, split, 1 << 20).lines_at, {late + 3: len(records[late])}) is None
    skipping = SplitReader(store, shard, split, 1 << 20, bad=BadRecords("skip"))
    assert anyio.run(skipping.lines_at, {late: len(records[late])}) is None, "a skipped frame may have moved it"
    (tmp_path / "g.jsonl.gz").write_bytes(gzip.compress(b"".join(lines)))
    gz = anyio.run(plan_shard, store, anyio.run(store.head, "g.jsonl.gz"))
    assert anyio.run(SplitReader(store, gz, Split(0, 0, len(gz.frames) - 1), 1 << 20).lines_at, {0: 5}) is None


# ---- the loader: same order, no scans, only the first draws' documents before the first batch ---------

def _config(dataset, seekable: Path) -> Config:
    root, _ = dataset
    return Config(seed=5, lanes=4, seq_len=64, global_batch_size=4, tokenizer=str(root / "tokenizer.json"),
                  shuffle_window=16, split_bytes=4096, sample_batch=2,
                  sources=[SourceConfig(name="c", uri=f"file://{seekable}/c/", weight=0.7),
                           SourceConfig(name="d", uri=f"file://{seekable}/d/", weight=0.3)])


class Asked:
    """Counts what `Documents` reads: the refs asked for, and the scans from a split's start."""

    def __init__(self, monkeypatch) -> None:
        self.refs = self.scans = 0
        read, scan = Documents.read, Documents._scan

        async def counted_read(docs, refs):
            self.refs += len(refs)
            return await read(docs, refs)

        async def counted_scan(docs, *args):
            self.scans += 1
            return await scan(docs, *args)

        monkeypatch.setattr(Documents, "read", counted_read)
        monkeypatch.setattr(Documents, "_scan", counted_scan)


@pytest.mark.parametrize("backend", ["inline", "threads"])
def test_a_restore_by_position_resumes_into_the_uninterrupted_order(dataset, seekable, monkeypatch, backend):
    cfg = _config(dataset, seekable).replace(backend=backend)
    full, _ = run_world(cfg, 1, 70)
    first, states = run_world(cfg, 1, 40)
    windows = sum(len(ls.shuffle.window) for ls in LoaderState.from_dict(states[0]).lane_states)
    assert windows >= 3 * cfg.shuffle_window, "windows that are (nearly) full"
    asked = Asked(monkeypatch)
    loader = Loader(cfg)
    loader.load_state_dict(states[0])
    it = iter(loader)
    next(it)
    assert asked.refs < windows / 2, (asked.refs, windows)  # the first draws' documents, not the windows
    it.close()
    rest, _ = run_world(cfg, 1, 30, resume=states)
    assert first + rest == full
    assert asked.scans == 0, "JSONL and zstd with seek tables: every document found by its position"
    assert asked.refs >= windows, "and every window document read by the end"


def test_a_restore_of_zstd_without_a_seek_table_scans_and_resumes_the_same(config, monkeypatch) -> None:
    full, _ = run_world(config, 1, 24)
    first, states = run_world(config, 1, 12)
    asked = Asked(monkeypatch)
    rest, _ = run_world(config, 1, 12, resume=states)
    assert first + rest == full
    assert asked.scans > 0, "source b has no seek table: its splits are scanned"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1 << 30), cuts=st.integers(2, 14), newline_at_end=st.booleans())
def test_lines_at_agrees_with_the_scan_where_frames_cut_records_anywhere(tmp_path, seed, cuts, newline_at_end):
    """Frames cut at any byte (as fixed-size writers cut them), records across frames and splits,
    a last record without a newline: every record a split's scan finds, `lines_at` finds alike."""
    rng = random.Random(seed)
    lines = [msgspec.json.encode({"text": "w" * rng.randint(0, 300)}) + b"\n" for _ in range(rng.randint(1, 30))]
    data = b"".join(lines)[:None if newline_at_end else -1]
    bounds = sorted({0, len(data), *(rng.randint(1, max(1, len(data) - 1)) for _ in range(cuts))})
    parts = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    frames = [cctx.compress(p) for p in parts]
    path = tmp_path / f"cut-{seed}-{cuts}.jsonl.zst"
    path.write_bytes(b"".join(frames) + seek_table([(len(f), len(p)) for f, p in zip(frames, parts)]))
    store = LocalStore(tmp_path)
    shard = anyio.run(plan_shard, store, anyio.run(store.head, path.name))
    last = len(shard.frames) - 1
    edges = sorted({0, last, *(rng.randint(0, last) for _ in range(2))})
    for a, b in zip(edges, edges[1:]):
        if a == b:
            continue
        records = _scan(SplitReader(store, shard, Split(0, a, b), 1 << 20))
        for offset, line in records.items():
            got = anyio.run(SplitReader(store, shard, Split(0, a, b), 1 << 20).lines_at, {offset: len(line)})
            assert got == {offset: line}, (a, b, offset)
        inside = [o + 1 for o in records if len(records[o]) > 2]
        assert anyio.run(SplitReader(store, shard, Split(0, a, b), 1 << 20).lines_at, {o: 2 for o in inside}) == {}


def test_header_reads_group_close_frames_and_stay_small() -> None:
    frames = [0, 100, 200, 300, 100_000, 100_050, 2_000_000, 2_000_010, 3_000_000]
    shard = ShardPlan("k.jsonl.zst", frames[-1], "e", frames, content=list(range(0, 9 * 10, 10)))
    reader = SplitReader(None, shard, Split(0, 0, 8), 1 << 20)
    assert reader._header_groups([0, 1, 2, 3, 4, 5, 6, 7]) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert reader._header_groups([0, 2, 5]) == [[0, 2], [5]]
