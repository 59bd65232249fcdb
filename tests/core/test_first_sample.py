"""A lane's first sample, fresh and after a restore, needs fewer documents than its shuffle window.

Counted, not timed: the documents tokenized (`Lanes.tokenize`) by the time the first sample
batch of a lane reaches the other end of its stream. Today's window grows as it is drawn from
and a restore tokenizes the window's documents when a pull takes them, so both counts stay far
below `shuffle_window`; a window that filled whole first read at least `shuffle_window`.
"""

from __future__ import annotations

import threading
from contextlib import AsyncExitStack

import anyio
import pytest

from zephon_stream import Loader, SourceConfig
from zephon_stream.loader.backends import run_lanes
from zephon_stream.loader.lane import Lanes
from zephon_stream.loader.plan import open_stores, plan_data
from zephon_stream.loader.state import LaneState, LoaderState
from zephon_stream.operators.tokenize import Tokenize

WINDOW = 64
RESTORED = "a checkpoint's documents"  # the key a restore tokenizes its documents under


@pytest.fixture()
def one_lane(config):
    """One lane of source `a` (documents of 0-60 words, samples of 64 tokens), a window of 64, one
    sample a hand-off and one hand-off buffered: the lane cannot run far past its first sample."""
    root = config.sources[0].uri
    return config.replace(lanes=1, global_batch_size=1, shuffle_window=WINDOW, sample_batch=1, sample_buffer=1,
                          sources=[SourceConfig(name="a", uri=root)])


class Counted:
    """Documents through `Lanes.tokenize`, by key (`RESTORED` or a shard's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fresh = self.restored = 0
        lock, original = threading.Lock(), Lanes.tokenize

        def tokenize(lanes, source, docs, key, *args, **kwargs):
            out = original(lanes, source, docs, key, *args, **kwargs)
            with lock:
                if key == RESTORED:
                    self.restored += len(out)
                else:
                    self.fresh += len(out)
            return out

        monkeypatch.setattr(Lanes, "tokenize", tokenize)


async def _first_samples(cfg, state: LaneState | None, counted: Counted) -> tuple[list, tuple[int, int]]:
    """The lane's first sample batch, and (fresh, restored) documents tokenized when it arrived."""
    async with AsyncExitStack() as stack:
        stores = await open_stores(cfg, stack)
        plan = await plan_data(cfg, stores)
        states = {0: state or LaneState.initial(0, len(cfg.sources))}
        async with run_lanes(cfg, Tokenize.for_config(cfg), plan, stores, states) as (streams, *_):
            with anyio.fail_after(60):
                batch = await streams[0].receive()
            return batch, (counted.fresh, counted.restored)


def test_a_fresh_lane_makes_its_first_sample_from_fewer_documents_than_its_window(one_lane, monkeypatch) -> None:
    counted = Counted(monkeypatch)
    batch, (fresh, restored) = anyio.run(_first_samples, one_lane, None, counted)
    assert len(batch) == 1 and restored == 0
    assert 0 < fresh < WINDOW // 2, f"{fresh} documents tokenized for the first sample of a window of {WINDOW}"


def test_a_restored_lane_tokenizes_few_of_its_windows_documents_before_its_first_sample(one_lane, monkeypatch):
    loader = Loader(one_lane, backend="threads")
    want = None
    for step, batch in enumerate(loader):
        if step == 200:
            state = LoaderState.from_dict(loader.state_dict()).lane_states[0]
        if step == 201:
            want = batch["input_ids"][0].tolist()
            break
    loader.close()
    assert len(state.shuffle.window) == WINDOW - 1  # the window is full: its growth is long over
    counted = Counted(monkeypatch)
    batch, (fresh, restored) = anyio.run(_first_samples, one_lane, state, counted)
    assert batch[0].input_ids.tolist() == want  # the same sample as the uninterrupted run
    assert 0 < restored < WINDOW // 2 and fresh < WINDOW // 2, (restored, fresh)
