"""The determinism matrix: byte-identical per-sample digests across world sizes, backends,
buffer sizes, injected latency and any sequence of checkpoint/resume (L = 12).

Every test runs for the text config, for an image+text config (tar shards of images mixed
with a text source), whose records digest the pixels too, and for a scheduled text config (weights
that change at two steps, the second pausing a source, a shuffle window per source:
tests/core/test_mixtures.py has the set_weights runs). Other modules collect these tests again for
more configs (formats, packing, transforms, chat); for those, tests/core/conftest.py leaves out
two repeated runs through worker processes (`TEXT_ONLY_CASES`)."""

from __future__ import annotations

import math

import msgspec
import pytest

from zephon_stream import ConfigError
from zephon_stream.engine.window import ReadWindow
from zephon_stream.loader.config import ScheduleEntry
from zephon_stream.loader.loader import Loader
from zephon_stream.testing.determinism import batch_records, real, run_world
from zephon_stream.testing.stores import WithLatency

STEPS = 24
_BASELINES: dict[str, list] = {}  # config TOML -> baseline records (runs are pure functions of the config)


@pytest.fixture(params=["text", "vision", "scheduled"])
def config(request):
    if request.param == "scheduled":
        text = request.getfixturevalue("config")
        return text.replace(shuffle_scope="source", schedule=[ScheduleEntry(5, {"a": 0.2, "b": 0.8}),
                                                              ScheduleEntry(13, {"a": 0.0, "b": 0.3})])  # a paused
    return request.getfixturevalue("config" if request.param == "text" else "vision_config")


@pytest.fixture()
def baseline(config):
    """The uninterrupted inline run every case compares with: computed once per config and session."""
    key = config.to_toml()
    if key not in _BASELINES:
        _BASELINES[key] = run_world(config, 1, STEPS, backend="inline")[0]
    records = list(_BASELINES[key])
    assert len(records) == STEPS * config.global_batch_size
    distinct = len({r[4] for r in records})
    if config.vision is None:
        assert distinct == len(records), "samples should be distinct"
    else:  # a sample that opens at an image (a span is never cut) and that the document fills recurs each epoch
        assert distinct >= 0.99 * len(records), "samples should be distinct, but for a few repeated across epochs"
    return records


@pytest.mark.parametrize(("dp_size", "backend"), [
    (1, "threads"), (2, "inline"), (3, "threads"), (4, "threads"), (6, "inline"), (2, "processes"),
])
def test_world_sizes_and_backends(config, baseline, dp_size, backend):
    records, _ = run_world(config, dp_size, STEPS, backend=backend)
    assert records == baseline


def _records(cfg, dp, steps, backend, resume=None):
    """run_world's records alone: a job for the session's second process (tests/_offload.py)."""
    return run_world(cfg, dp, steps, backend=backend, resume=resume)[0]


def test_buffer_capacities(config, baseline, offload):
    tiny = config.replace(sample_buffer=1, doc_buffer=1, sample_batch=1, tokenize_batch=3, cpu_threads=1)
    large = config.replace(sample_buffer=16, doc_buffer=16, sample_batch=8, tokenize_batch=512, cpu_threads=4)
    if config.vision is not None:  # images: the decode calls' size and threads too
        tiny = tiny.replace(vision=msgspec.structs.replace(config.vision, decode_batch=1, decode_ahead=1,
                                                                 decode_threads=1))
        large = large.replace(vision=msgspec.structs.replace(config.vision, decode_batch=16, decode_ahead=64,
                                                                   decode_threads=6))
    large_records = offload.submit(_records, large, 3, STEPS, "threads")  # meanwhile, in the second process
    assert run_world(tiny, 2, STEPS, backend="threads")[0] == baseline
    assert offload.result(large_records) == baseline


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_injected_read_latency(config, baseline, backend):
    records, _ = run_world(config, 2 if backend == "processes" else 4, STEPS, backend=backend,
                           wrap_store=WithLatency(seed=3, max_ms=4))
    assert records == baseline


@pytest.mark.parametrize(("cut", "before", "after"), [
    (1, (4, "threads"), (2, "processes")),
    (9, (2, "inline"), (3, "threads")),
    (17, (6, "threads"), (1, "inline")),
])
def test_resume_onto_other_world_and_backend(config, baseline, cut, before, after):
    first, states = run_world(config, before[0], cut, backend=before[1])
    rest, _ = run_world(config, after[0], STEPS - cut, backend=after[1], resume=states)
    assert first + rest == baseline


def test_resume_twice(config, baseline):
    a, s1 = run_world(config, 2, 5, backend="threads")
    b, s2 = run_world(config, 3, 6, backend="inline", resume=s1)
    c, _ = run_world(config, 4, STEPS - 11, backend="threads", resume=s2)
    assert a + b + c == baseline


def _cut_and_resume(cfg, cut):
    """Steps [0, cut) on 4 ranks (threads), then the rest on 2 (inline) from their states."""
    first, states = run_world(cfg, 4, cut, backend="threads")
    rest, _ = run_world(cfg, 2, None, backend="inline", resume=states)
    return first + rest


def test_epochs_to_the_end_and_resume_at_epoch_boundary(config, offload):
    """Seven runs to the end of two epochs; the session's second process makes three of them
    meanwhile (tests/_offload.py): the same runs and comparisons, on both cores."""
    cfg = config.replace(max_epochs=2)
    dp3 = offload.submit(_records, cfg, 3, None, "threads")
    full = _records(cfg, 1, None, "threads")
    steps = full[-1][0] + 1
    assert steps > 40
    last = offload.submit(_cut_and_resume, cfg, steps - 1)  # the last step, lanes ending
    assert real(_records(cfg, 2, None, "threads")) == real(full)
    assert real(offload.result(dp3)) == real(full)
    assert real(_cut_and_resume(cfg, steps // 2)) == real(full)  # about one epoch in
    assert real(offload.result(last)) == real(full)


def _epoch_crossing(loader, lanes):
    """Whether some lane's reader has moved into its first split of epoch 1, for some source."""
    for lane, st in loader.frontier.lanes.items():
        for s, position in enumerate([c.position for c in st.sources] if st else []):
            n = len(loader.data_plan.sources[s].splits)
            if position >= math.ceil((n - lane) / lanes):  # position p is split g = lane + p * lanes
                return True
    return False


def test_resume_on_both_sides_of_the_first_epoch_crossing(config, offload):
    """Cut at the last step before any lane reads its second epoch, and at the first step after."""
    cfg = config.replace(max_epochs=2)
    loader = Loader(cfg, backend="inline")
    records, states, crossing = [], {}, None
    for batch in loader:
        records += batch_records(batch)
        states[loader.step] = loader.state_dict()
        if crossing is None and _epoch_crossing(loader, cfg.lanes):
            crossing = loader.step
        if crossing is not None and loader.step == crossing + 8:
            break
    assert crossing is not None and crossing > 1, "no lane reached its second epoch"
    after = offload.submit(_records, cfg, 3, 8, "threads", [states[crossing]])  # meanwhile, in the second process
    for cut, rest in ((crossing - 1, _records(cfg, 3, 9, "threads", [states[crossing - 1]])),
                      (crossing, offload.result(after))):
        assert rest == [r for r in records if r[0] >= cut], f"continuation after step {cut} differs"


@pytest.mark.parametrize("backend", ["inline", "threads"])
def test_read_ahead_window_does_not_change_order(config, baseline, backend, monkeypatch):
    """Splits read through a window of ranged requests (a store with latency, as S3) or one request
    at a time (read_ahead = 1, or local files at any read_ahead: they say `overlap_reads = False`)."""
    windows = []
    real_init = ReadWindow.__init__

    def counting(self, *args, **kwargs):
        windows.append(args[1])  # the ranges
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ReadWindow, "__init__", counting)
    slow = WithLatency(seed=5, max_ms=3.0)  # parts finish out of order
    ahead, _ = run_world(config.replace(read_ahead=3), 2, STEPS, backend=backend, wrap_store=slow)
    assert windows and max(len(r) for r in windows) >= 3
    windows.clear()
    one, _ = run_world(config.replace(read_ahead=1), 3, STEPS, backend=backend)
    local, _ = run_world(config.replace(read_ahead=3), 2, STEPS, backend=backend)  # file://: no window either
    assert ahead == one == local == baseline and not windows


def test_refuses_world_that_cannot_keep_order(config):
    with pytest.raises(ConfigError, match="does not divide lanes=12: use a dp_size in"):
        Loader(config, dp_rank=0, dp_size=5)
    with pytest.raises(ConfigError, match="does not divide global_batch_size"):
        Loader(config.replace(global_batch_size=18), dp_rank=0, dp_size=4)
    # the sizes offered keep the order: those that divide both (4 and 12 divide the lanes, not 18)
    with pytest.raises(ConfigError, match=r"dp_size=5 does not divide lanes=12: use a dp_size in \[1, 2, 3, 6\] "
                                          r"\(they divide lanes=12 and global_batch_size=18\)"):
        Loader(config.replace(global_batch_size=18), dp_rank=0, dp_size=5)
    # dp_size 0 said "need 0 <= dp_rank < dp_size"; a rank without its dp_size gets the default of 1
    with pytest.raises(ConfigError, match=r"^dp_size=0: give the number of data-parallel ranks, >= 1$"):
        Loader(config, dp_rank=0, dp_size=0)
    with pytest.raises(ConfigError, match=r"dp_rank=1 dp_size=1: .*; dp_size is 1 unless given\)$"):
        Loader(config, dp_rank=1)
