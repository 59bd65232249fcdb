"""How sources are cut into splits: k * lanes splits of about equal bytes, so small data does not make
lanes read the same epoch's documents together, and lanes end an epoch together (issue 14)."""

from __future__ import annotations

import gzip
import hashlib
import logging
import random
import re

import msgspec
import pytest

from tests.core.conftest import make_docs, write_jsonl
from zephon_stream.errors import IncompatibleState
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.plan import old_split_digest
from zephon_stream.loader.state import LoaderState
from zephon_stream.operators.read import ShardPlan, SourcePlan, _plan_splits, plan_splits, warn_coarse
from zephon_stream.testing.determinism import batch_records


def _bytes(shards: list[ShardPlan], splits) -> list[int]:
    return [(shards[s.shard].frames[s.end] - shards[s.shard].frames[s.start]) if shards[s.shard].frames
            else s.end - s.start for s in splits]


def test_jsonl_splits_are_a_multiple_of_lanes_and_equal():
    shards = [ShardPlan("a", 250_000, ""), ShardPlan("b", 90_000, ""), ShardPlan("c", 7_000, "")]
    for lanes, split_bytes in ((12, 1 << 20), (12, 10_000), (5, 30_000)):
        splits = plan_splits(shards, lanes, split_bytes)
        sizes = _bytes(shards, splits)
        assert len(splits) % lanes == 0 and sum(sizes) == 347_000
        cut = [n for n, sp in zip(sizes, splits) if sp.shard < 2]  # shard c is smaller than one split: it is one
        assert max(sizes) <= split_bytes and max(cut) <= 1.3 * min(cut), sizes


def test_frames_cut_at_the_nearest_boundary_and_a_coarse_shard_leaves_its_share_to_the_others():
    fine = ShardPlan("f.zst", 0, "", list(range(0, 100_001, 1_000)))  # 100 frames of 1 KB
    coarse = ShardPlan("c.zst", 0, "", [0, 40_000, 80_000])  # 2 frames
    splits = plan_splits([fine, coarse], 12, 1 << 20)
    sizes = _bytes([fine, coarse], splits)
    assert [s.shard for s in splits].count(1) == 2  # it cannot be cut finer than its frames
    # its share was 12 * 80/180 = 5: the 3 it cannot give go to the fine shard (split plan 2 gave 7 + 2)
    assert sum(sizes) == 180_000 and len(splits) == 10 + 2
    assert max(sizes[:-2]) - min(sizes[:-2]) <= 1_000
    assert _plan_splits([fine, coarse], 12, 1 << 20)[1], "not split plan 2's splits: marked"
    for shards in ([fine], [fine, ShardPlan("j.jsonl", 50_000, "")], [coarse]):  # nothing to refill
        assert not _plan_splits(shards, 12, 1 << 20)[1]


def test_a_shard_that_cannot_give_its_share_refills_until_none_can():
    """Two coarse shards of uneven frames and one single-member gzip among JSONL shards: every
    shard that cannot be cut into its share keeps what it gives, the others share the rest, and a
    source gives k * lanes splits while its other shards can be cut."""
    gz = ShardPlan("g.jsonl.gz", 300_000, "", [0, 300_000])  # one member: one split
    uneven = ShardPlan("u.zst", 0, "", [0, 1_000, 2_000, 150_000])  # 3 frames, one of them most of it
    shards = [ShardPlan("a.jsonl", 200_000, ""), gz, uneven, ShardPlan("b.jsonl", 20_000, "")]
    for lanes in (5, 12, 16):
        splits, refilled = _plan_splits(shards, lanes, 1 << 20)
        per_shard = [[s.shard for s in splits].count(i) for i in range(4)]
        assert len(splits) % lanes == 0 and refilled, (lanes, per_shard)
        assert per_shard[1] == 1 and 1 <= per_shard[2] <= 3 and min(per_shard) >= 1, per_shard
        covered = [(s.start, s.end) for s in splits if s.shard == 0]
        assert covered[0][0] == 0 and covered[-1][1] == 200_000 and all(
            a[1] == b[0] for a, b in zip(covered, covered[1:]))  # the refilled shard is still cut whole
    only = [gz, ShardPlan("h.jsonl.gz", 10_000, "", [0, 10_000])]  # nothing can be cut: fewer splits
    assert len(plan_splits(only, 12, 1 << 20)) == 2


def test_one_gzip_file_beside_jsonl_gives_every_lane_a_split_of_its_own(tmp_path, dataset, caplog):
    """A `.jsonl.gz` written by gzip is one member: its share of 12 splits used to be lost, so
    11 lanes read 12 lanes' worth and a batch held the same samples twice."""
    root, _ = dataset
    docs = make_docs(random.Random(11), 400, 40)
    (tmp_path / "m").mkdir()
    write_jsonl(tmp_path / "m" / "a.jsonl", docs[:220])
    write_jsonl(tmp_path / "g.jsonl", docs[220:])
    (tmp_path / "m" / "b.jsonl.gz").write_bytes(gzip.compress((tmp_path / "g.jsonl").read_bytes()))
    cfg = Config(seed=5, lanes=12, seq_len=32, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                 shuffle_window=0, sources=[SourceConfig(name="mixed", uri=f"file://{tmp_path}/m/")])
    loader = Loader(cfg, backend="inline")
    with caplog.at_level(logging.WARNING, logger="zephon_stream.loader"):
        for b, batch in enumerate(loader):
            records = batch_records(batch)
            assert len({r[4] for r in records}) == len(records), f"batch {b} repeats a sample"
            if b == 5:
                break
    plan = loader.data_plan.sources[0]
    assert len(plan.splits) == 12 and plan.refilled
    assert not [r for r in caplog.records if "splits for 12 lanes" in r.getMessage()]
    state = loader.state_dict()
    # as the version before the refill wrote it: the same listing, with its old digests
    older = LoaderState.from_dict(state)
    listing = msgspec.msgpack.encode([plan.name, [(s.key, s.size, s.etag) for s in plan.shards]])
    old_digest = old_split_digest(plan)
    assert old_digest == hashlib.sha256(listing).hexdigest()[:16] != loader.data_plan.by_source["mixed"].digest
    header = msgspec.structs.replace(
        older.header, data_fingerprint=hashlib.sha256(listing).hexdigest()[:32],
        data_sources={"mixed": msgspec.structs.replace(older.header.data_sources["mixed"], digest=old_digest)})
    again = Loader(cfg, backend="inline")
    again.load_state_dict({**state, "meta": msgspec.msgpack.encode(header)})
    with pytest.raises(IncompatibleState, match="written by an older zephon-stream, which cut source 'mixed' into "
                                                "other splits.*start fresh"):
        next(iter(again))
    resumed = Loader(cfg, backend="inline")  # a checkpoint of this version resumes
    resumed.load_state_dict(state)
    assert next(iter(resumed))["step"] == 6


def _small_source(tmp_path, dataset, zst: bool, frame_docs: int = 7) -> Config:
    root, _ = dataset
    docs = make_docs(random.Random(3), 90, 40)
    (tmp_path / "s").mkdir()
    for i in range(3):  # 3 small shards: fewer than 12 lanes
        write_jsonl(tmp_path / "s" / f"s-{i}.jsonl{'.zst' if zst else ''}", docs[i * 30:(i + 1) * 30], zst=zst,
                    frame_docs=frame_docs)
    return Config(seed=5, lanes=12, seq_len=32, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                  shuffle_window=4, sources=[SourceConfig(name="small", uri=f"file://{tmp_path}/s/")])


def test_few_shards_give_no_identical_samples_in_a_batch(tmp_path, dataset):
    cfg = _small_source(tmp_path, dataset, zst=False)
    loader = Loader(cfg, backend="inline")
    for b, batch in enumerate(loader):
        records = batch_records(batch)
        assert len({r[4] for r in records}) == len(records), f"batch {b} repeats a sample"
        if b == 3:
            break
    assert len(loader.data_plan.sources[0].splits) == 12


def test_coarse_frames_warn_once_naming_the_source(tmp_path, dataset, caplog):
    cfg = _small_source(tmp_path, dataset, zst=True, frame_docs=15)  # 2 frames a shard: 6 splits at most
    with caplog.at_level(logging.WARNING, logger="zephon_stream.loader"):
        next(iter(Loader(cfg, backend="inline")))
    warned = [r.getMessage() for r in caplog.records if "splits for 12 lanes" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "source 'small' has 6 splits for 12 lanes: its zstd frames or gzip members cannot be cut "
        "finer, so lanes read the same splits at about the same time: one batch can hold the same samples "
        "several times; rewrite it with smaller frames: `zephon shard --frame-size` (256KiB by default), e.g. "), warned
    # not 64KiB, which gave this small source one frame a shard: the smallest, and too few bytes for 12 lanes
    assert re.search(r"e\.g\. 1KiB \(its 3,\d\d\d bytes are too few to give each of 12 lanes a split\)$",
                     warned[0]), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zephon_stream.loader"):  # one epoch: the other lanes pad
        next(iter(Loader(cfg.replace(max_epochs=1), backend="inline")))
    warned = [r.getMessage() for r in caplog.records if "splits for 12 lanes" in r.getMessage()]
    assert len(warned) == 1 and "cannot be cut finer, so 6 of its lanes have no split in an epoch and give padding " \
                                "while the others read; rewrite it with smaller frames" in warned[0], warned


def test_lanes_end_an_epoch_together(config):
    """One epoch of a JSONL source (cut at any byte, so its splits are equal): every lane's last real
    sample is within a few steps of the others', and padding from ended lanes is a small share.
    (A zstd source can be no finer than its frames: its lanes end within about one frame group.)"""
    cfg = config.replace(max_epochs=1, sources=[config.sources[0]])
    last: dict[int, int] = {}
    tokens = positions = 0
    for batch in Loader(cfg, backend="threads"):
        for lane, n in zip(batch["lanes"].tolist(), batch["num_tokens"].tolist()):
            if n:
                last[lane] = batch["step"]
        tokens += int(batch["num_tokens"].sum())
        positions += batch["input_ids"].numel()
    ends = sorted(last.values())
    assert len(ends) == cfg.lanes
    assert ends[-1] - ends[0] <= 0.15 * ends[-1], ends
    assert 1 - tokens / positions < 0.1


def test_zstd_splits_balance_decompressed_bytes_when_the_seek_table_says_them():
    """Half the frames compress 4x better (code, say): equal compressed bytes would give some lanes
    4x the text of others; the seek table's decompressed sizes balance the text instead."""
    sizes = [4_000 if f < 24 else 1_000 for f in range(48)]  # compressed: the second half 4x better
    frames = [0]
    for n in sizes:
        frames.append(frames[-1] + n)
    content = [40_000 * f for f in range(49)]  # each frame holds 40 KB of text
    shard = ShardPlan("s.zst", frames[-1], "", frames, content=content)
    splits = plan_splits([shard], 12, 1 << 30)
    text = [content[s.end] - content[s.start] for s in splits]
    assert len(splits) == 12 and min(text) == max(text) == 160_000
    blind = plan_splits([msgspec.structs.replace(shard, content=[])], 12, 1 << 30)
    assert len({content[s.end] - content[s.start] for s in blind}) > 1


def test_one_split_over_two_lanes_share_is_named_in_a_warning(caplog):
    """A single-frame .zst (as the zstd CLI writes) beside a finely framed one: 24 splits for 12 lanes,
    but one of them holds 44% of the bytes, and its lane ended the epoch at step 420 of 421 while
    the others ended by step 64 (84% padding), with no word of why."""
    fine = ShardPlan("z.jsonl.zst", 0, "", list(range(0, 41_001, 1_000)))  # 41 frames of 1 KB
    single = ShardPlan("z2.jsonl.zst", 0, "", [0, 32_000])
    sp = SourcePlan(name="zmid", uri="file:///x/", prefix="", text_field="text", shards=[fine, single],
                    splits=plan_splits([fine, single], 12, 4096))
    assert len(sp.splits) == 24
    with caplog.at_level(logging.WARNING, logger="zephon_stream.loader"):
        warn_coarse(sp, 12, max_epochs=2)
        warn_coarse(SourcePlan(name="even", uri="file:///y/", prefix="", text_field="text", shards=[fine],
                               splits=plan_splits([fine], 12, 4096)), 12, max_epochs=2)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["source 'zmid': one split (of shard 'z2.jsonl.zst') holds 44% of its bytes, 5.3x a lane's share "
                    "of an epoch at 12 lanes: its zstd frames or gzip members cannot be cut finer, so the lane that "
                    "reads it takes that much longer: the other lanes end long before it and give padding while "
                    "it reads; rewrite it with smaller frames: `zephon shard --frame-size` (256KiB by default), e.g. "
                    "4KiB"], said
