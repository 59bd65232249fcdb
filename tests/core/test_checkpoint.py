"""Exactly-once delivery, checkpoint size, restore time and refusal of incompatible state."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import Counter

import msgspec
import pytest

from zephon_stream import IncompatibleState
from zephon_stream.loader.loader import Frontier, Loader
from zephon_stream.loader.state import LoaderState, state_to_bytes
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.testing.determinism import batch_records, lane_documents, lane_token_streams

from .conftest import batches_to


@pytest.mark.parametrize("dp_size, global_batch_size", [(1, 24), (3, 24), (1, 6), (3, 6)])
def test_exactly_once_over_one_epoch(config, dataset, dp_size, global_batch_size):
    """Also when a step reads fewer lanes than there are: a step of padding alone is no end."""
    root, docs = dataset
    cfg = config.replace(max_epochs=1, sources=config.sources[:1], global_batch_size=global_batch_size)
    tok = Tokenize(cfg.tokenizer, cfg.eos_token)
    batches = []
    for rank in range(dp_size):
        batches += list(Loader(cfg, dp_rank=rank, dp_size=dp_size, backend="threads"))
    streams = lane_token_streams(batches)
    assert sorted(streams) == list(range(cfg.lanes)), "every lane gets data"
    got = Counter(d for s in streams.values() for d in lane_documents(s, tok.eos_id))
    want = Counter(tuple(ids.tolist()) for ids in tok(docs["a"]))
    assert sum(len(d) * c for d, c in got.items()) == sum(len(d) * c for d, c in want.items())
    assert got == want


def test_labels_positions_and_boundaries(config):
    cfg = config.replace(seq_len=32)
    eos = Tokenize(cfg.tokenizer, cfg.eos_token).eos_id
    batch = next(iter(Loader(cfg, backend="inline")))
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    flat_bounds = batch["cu_seqlens"].tolist()
    assert flat_bounds[0] == 0 and flat_bounds[-1] == ids.numel()
    for b in range(ids.shape[0]):
        row, lab, p = ids[b].tolist(), labels[b].tolist(), pos[b].tolist()
        for j in range(len(row) - 1):
            if row[j] == eos:
                assert lab[j] == -100 and p[j + 1] == 0  # no label across documents; positions restart
            else:
                assert lab[j] == row[j + 1]
        starts = [x - b * 32 for x in flat_bounds if b * 32 <= x < (b + 1) * 32]
        assert [j for j in range(32) if p[j] == 0] == starts


def test_state_size_is_bounded_per_lane(config):
    cfg = config.replace(shuffle_window=64)  # the default window
    loader = Loader(cfg, backend="threads")
    sizes = []
    for step, _ in enumerate(loader):
        if step in (30, 60, 90):  # past the windows' growth (their first 64 pulls): from there on full
            sizes.append(len(state_to_bytes(loader.state_dict())))
        if step == 90:
            break
    per_lane = max(sizes) / cfg.lanes
    assert per_lane <= 16 * 1024, per_lane
    assert max(sizes) < 2 * min(sizes), "state must not grow with the position"


def _time_to_first_batch(cfg, state):
    loader = Loader(cfg, backend="threads")
    loader.load_state_dict(state)
    t = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - t


@pytest.mark.slow
def test_restore_time_does_not_grow_with_position(config):
    cfg = config.replace(shuffle_window=64, seq_len=32, global_batch_size=12)
    loader = Loader(cfg, backend="threads")
    states = {}
    for step, _ in enumerate(loader, start=1):
        # both past the first few hundred pulls of each window: before, its documents reach back only
        # to the start of the run, so a restore reads fewer splits (and the early figure is not comparable)
        if step in (500, 1000):
            states[step] = loader.state_dict()
        if step == 1000:
            break
    assert LoaderState.from_dict(states[1000]).header.step == 1000
    early = min(_time_to_first_batch(cfg, states[500]) for _ in range(3))
    late = min(_time_to_first_batch(cfg, states[1000]) for _ in range(3))
    assert late < 2.0 * early + 0.05, (early, late)


def test_refuses_changed_data_or_config(config, dataset, tmp_path):
    loader = Loader(config, backend="inline")
    it = iter(loader)
    next(it)
    it.close()
    state = loader.state_dict()
    for change, needle in [({"seed": 1}, "another order config.*seed: 1234 in the checkpoint, 1 now"),
                           ({"seq_len": 128}, "another order config.*seq_len: 64 in the checkpoint, 128 now"),
                           ({"lanes": 6}, "another order config.*lanes: 12 in the checkpoint, 6 now")]:
        with pytest.raises(IncompatibleState, match=needle):
            Loader(config.replace(**change), backend="inline").load_state_dict(state)
    # settings left out of the order data at their defaults are named with their default, and only
    # the changed ones (packing's window and truncate, unchanged, were listed, and every default as None)
    for change, says in [({"packing": "best_fit"}, "packing: 'concat' in the checkpoint, 'best_fit' now; restore"),
                         ({"packing": "best_fit", "packing_window": 128},  # a window set under concat is unused there
                          "packing: 'concat' in the checkpoint, 'best_fit' now; restore"),
                         ({"labels": "unshifted"}, "labels: 'shifted' in the checkpoint, 'unshifted' now; restore"),
                         ({"shuffle_window": 0}, "shuffle_window: 8 in the checkpoint, 0 now; restore")]:
        with pytest.raises(IncompatibleState) as err:
            Loader(config.replace(**change), backend="inline").load_state_dict(state)
        assert says in str(err.value) and "None" not in str(err.value)
    # a source's setting is named by source and setting (the whole list of sources was printed twice)
    a, b = config.sources
    for sources, says in [
        ([msgspec.structs.replace(a, weight=0.5), b],
         "sources: weight of 'a': 0.6 in the checkpoint, 0.5 now (to change a run's weights from a step on, "
         "resume with the config as it was and call Loader.set_weights"),
        ([a, msgspec.structs.replace(b, text_field="body")], "sources: text_field of 'b': 'text' in the checkpoint, "
         "'body' now; restore"),
        ([a, msgspec.structs.replace(b, name="c")], "sources: source 'b' is gone; source 'c' is new; restore"),
        ([b, a], "sources: the sources' order: ['a', 'b'] in the checkpoint, ['b', 'a'] now; restore"),
    ]:
        with pytest.raises(IncompatibleState) as err:
            Loader(config.replace(sources=sources), backend="inline").load_state_dict(state)
        assert says in str(err.value), str(err.value)
    root, _ = dataset
    moved = tmp_path / "a"
    shutil.copytree(root / "a", moved)
    (moved / "a-9.jsonl").write_bytes(b'{"text": "a new shard"}\n')
    srcs = [msgspec.structs.replace(config.sources[0], uri=f"file://{moved}/"), config.sources[1]]
    other = Loader(config.replace(sources=srcs), backend="inline")
    other.load_state_dict(state)
    shards = sorted((root / "a").iterdir())
    was, now = sum(p.stat().st_size for p in shards), sum(p.stat().st_size for p in moved.iterdir())
    with pytest.raises(IncompatibleState, match=rf"other data .*: source 'a' had {len(shards)} shards of {was:,} "
                                                rf"bytes, now {len(shards) + 1} shards of {now:,} bytes; resume"):
        next(iter(other))
    (moved / "a-9.jsonl").unlink()
    first = moved / shards[0].name
    data = first.read_bytes()
    first.write_bytes(data[::-1])  # the same size: the ETag tells
    os.utime(first, ns=(0, first.stat().st_mtime_ns + 10**9))
    other = Loader(config.replace(sources=srcs), backend="inline")
    other.load_state_dict(state)
    with pytest.raises(IncompatibleState, match=rf"source 'a' had {len(shards)} shards of {was:,} bytes, now "
                                                rf"{len(shards)} shards of {was:,} bytes \(a shard was replaced"
                                                r".*a local file's ETag is its modification time and size.*copy "
                                                r"the files again with `cp -rp`"):
        next(iter(other))  # a local copy that did not keep the times reads the same: the message says so
    older = LoaderState.from_dict(state)  # a checkpoint from before the sources' part was kept
    older = {**state, "meta": msgspec.msgpack.encode(msgspec.structs.replace(older.header, data_sources={}))}
    other = Loader(config.replace(sources=srcs), backend="inline")
    other.load_state_dict(older)
    with pytest.raises(IncompatibleState, match="other data .*: shards were added, removed or rewritten"):
        next(iter(other))


def _as_format_1(state: dict[str, bytes]) -> dict[str, bytes]:
    """A state as this project wrote it before lane states nested their operators' states (format 1)."""
    decoded = LoaderState.from_dict(state)
    out = {"meta": msgspec.msgpack.encode(msgspec.structs.replace(decoded.header, format_version=1))}
    for ls in decoded.lane_states:
        flat = [ls.lane, ls.samples, ls.done, [[c.position, c.offset] for c in ls.sources], ls.mix.counts,
                ls.mix.position, ls.shuffle.window, ls.shuffle.pulls, ls.pack.carry, ls.pack.offset]
        out[f"lane_{ls.lane:04d}"] = msgspec.msgpack.encode(flat)
    return out


def test_a_format_1_checkpoint_resumes_where_it_stopped(config):
    from zephon_stream.testing.determinism import run_world

    full, _ = run_world(config, 1, 14)
    first, states = run_world(config, 2, 6)
    rest, _ = run_world(config, 3, 8, resume=[_as_format_1(s) for s in states])
    assert first + rest == full


def test_an_unknown_format_is_refused_naming_it(config):
    from zephon_stream import CheckpointError

    loader = Loader(config, backend="inline")
    state = loader.state_dict()
    head = LoaderState.from_dict(state).header
    state["meta"] = msgspec.msgpack.encode(msgspec.structs.replace(head, format_version=9))
    with pytest.raises(CheckpointError, match=r"format_version 9 is not supported: .* reads formats \(1, 2\)"):
        Loader(config, backend="inline").load_state_dict(state)


def test_state_dict_while_a_batch_is_consumed_is_a_batch_boundary(config, monkeypatch):
    """state_dict() while the loop consumes a batch, from a checkpoint thread or from a signal handler
    in the loop's own thread (a preemption handler that saves), gives the state after or before
    that batch: never lanes past it with the step before it (that resumed past samples never
    handed out, 'lane 0 state field samples = 7: step 3 means 6'), and the handler does not hang
    on the lock the consuming thread holds."""
    want = [batch_records(b) for b in batches_to(Loader(config, backend="threads"), 8)]
    loader, consume, saved, savers = Loader(config, backend="threads"), Frontier.consume, {}, []

    def consume_with_saves_beside(frontier: Frontier, lanes, sample) -> None:
        consume(frontier, lanes, sample)
        if frontier.step == 3 and not savers:  # halfway through batch 3
            saved["handler"] = loader.state_dict()  # as a signal handler in this thread would
            savers.append(threading.Thread(target=lambda: saved.update(thread=loader.state_dict())))
            savers[0].start()
            savers[0].join(timeout=0.5)  # the save waits for the batch, or it would have taken this one half done

    monkeypatch.setattr(Frontier, "consume", consume_with_saves_beside)
    got = [batch_records(b) for b in batches_to(loader, 8)]
    savers[0].join()
    assert got == want
    for who, step in (("thread", 4), ("handler", 3)):
        resumed = Loader(config, backend="threads")
        resumed.load_state_dict(saved[who])
        assert resumed.step == step, who
        assert [batch_records(b) for b in batches_to(resumed, 8)] == want[step:], who

