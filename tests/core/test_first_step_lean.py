"""Until every lane has made its part of the first batch (`lane.FirstStep`), the lanes tokenize
only what that batch takes: no feed read-ahead, no restored document ahead of its pull."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from zephon_stream import IncompatibleState
from zephon_stream.loader.lane import FirstStep, Lanes, TextLane
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.reread import Reread
from zephon_stream.operators.shuffle import Shuffle
from zephon_stream.testing.determinism import batch_records, run_world

REREAD = "a checkpoint's documents"  # the key `TextLane._tokenize_again` tokenizes under


def test_a_lean_reread_fetches_one_document_at_a_time_then_chunks_that_double() -> None:
    refs = [(0, 0, 100 * i, 10) for i in range(10)]
    calls: list = []
    lean = [True]

    async def tokenize(source, docs):
        calls.append([ref for ref, _ in docs])
        return [(ref, np.array([1], dtype=np.uint32)) for ref, _ in docs]

    docs = Reread({r: "text" for r in refs}, tokenize, lambda source: 8, IncompatibleState, lean=lambda: lean[0])
    for ref in refs[:3]:
        anyio.run(docs.fetch, ref)
    lean[0] = False
    for ref in refs[3:]:
        anyio.run(docs.fetch, ref)
    assert calls == [refs[:1], refs[1:2], refs[2:3], refs[3:4], refs[4:6], refs[6:10]]


class Counted:
    """Documents tokenized (by the feeds, and again for a restore) and what the lanes took, as
    they stood when the last lane handed off its first step (before the gate opens)."""

    def __init__(self, monkeypatch) -> None:
        self.fed = 0
        self.again: set[tuple] = set()  # documents tokenized again for the restore
        self.pulled: set[tuple] = set()  # documents the lanes' windows gave out
        self.at_last_pass: tuple[int, set, int, set] | None = None  # fed, again, taken from feeds, pulled
        self.lanes: list[TextLane] = []
        self._lock = threading.Lock()
        tokenize, run, passed, pull = Lanes.tokenize, TextLane.run, FirstStep.passed, Shuffle.next
        counter = self

        def counted(lanes, source, docs, key, *args):
            out = tokenize(lanes, source, docs, key, *args)
            with counter._lock:
                if key == REREAD:
                    counter.again.update(tuple(ref[:4]) for ref, _ in out)
                else:
                    counter.fed += len(out)
            return out

        async def recorded_run(lane, out):
            counter.lanes.append(lane)
            await run(lane, out)

        async def recorded_passed(gate, lane):
            if gate.pending() and len(gate._pending) == 1 and counter.at_last_pass is None:
                counter.at_last_pass = (counter.fed, set(counter.again), counter.taken(), set(counter.pulled))
            await passed(gate, lane)

        async def recorded_pull(shuffle):
            doc = await pull(shuffle)
            if doc is not None:
                counter.pulled.add(tuple(doc[0][:4]))
            return doc

        monkeypatch.setattr(Lanes, "tokenize", counted)
        monkeypatch.setattr(TextLane, "run", recorded_run)
        monkeypatch.setattr(FirstStep, "passed", recorded_passed)
        monkeypatch.setattr(Shuffle, "next", recorded_pull)

    def taken(self) -> int:
        return sum(feed.taken for lane in self.lanes for feed in lane.sources)

    def carried(self) -> set[tuple]:
        return {tuple(lane.state_in.pack.carry[:4]) for lane in self.lanes if lane.state_in.pack.carry is not None}


@pytest.mark.parametrize("restore", [False, True])
def test_before_the_first_batch_the_lanes_tokenize_only_what_it_takes(config, monkeypatch, restore):
    # 8 samples a lane a step (pulls that take several restored documents), windows still growing at step 2
    cfg = config.replace(shuffle_window=64, global_batch_size=96, backend="threads")
    full, _ = run_world(cfg, 1, 3)
    state = None
    if restore:
        _, states = run_world(cfg, 1, 2)
        state = states[0]
    counted = Counted(monkeypatch)
    loader = Loader(cfg)
    if state is not None:
        loader.load_state_dict(state)
    with loader:
        first = batch_records(next(iter(loader)))
    assert counted.at_last_pass is not None and len(counted.lanes) == cfg.lanes
    fed, again, taken, pulled = counted.at_last_pass
    assert fed == taken, "a feed tokenized documents its lane did not take (read-ahead)"
    ahead = again - pulled - counted.carried()
    assert not ahead, f"a restore tokenized window documents no pull took yet: {sorted(ahead)[:3]}"
    assert bool(again) == restore
    assert sorted(first) == sorted(r for r in full if r[0] == (2 if restore else 0))  # the same batch
