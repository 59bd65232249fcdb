"""Lanes that made their part of the first batch wait for the others (`lane.FirstStep`), so the
CPU goes to the lanes the sequencer waits for. A schedule only: the batches are the same."""

from __future__ import annotations

import anyio
import pytest

from zephon_stream import Loader
from zephon_stream.loader.lane import FirstStep, TextLane
from zephon_stream.testing.determinism import batch_records


def test_a_lane_waits_until_every_lane_has_passed_or_ended():
    order = []

    async def lane(gate: FirstStep, k: int, ends: bool, go: anyio.Event) -> None:
        await go.wait()
        if ends:
            gate.leave(k)  # ran out of data before its first step
        else:
            await gate.passed(k)
        order.append(k)

    async def main() -> None:
        gate = FirstStep()
        go = [anyio.Event() for _ in range(3)]
        for k in range(3):
            gate.enter(k)
        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(lane, gate, k, k == 2, go[k])
            for k in (0, 1):
                go[k].set()
                await anyio.wait_all_tasks_blocked()
                assert order == []  # lane 2 has neither passed nor ended
            go[2].set()
        assert sorted(order) == [0, 1, 2]
        alone = anyio.Event()  # a lane started later alone (a worker restart) never waits
        gate.enter(7)
        with anyio.fail_after(5):
            await gate.passed(7)
            alone.set()
        assert alone.is_set()

    anyio.run(main)


@pytest.mark.parametrize("restore", [False, True])
def test_no_lane_runs_past_its_first_step_before_all_have_made_it(config, monkeypatch, restore):
    log = []
    snapshot, passed = TextLane._snapshot, FirstStep.passed

    def recording_snapshot(self, samples):
        log.append(("sample", self.lane, samples - 1, self._first_handoff(self.state_in.samples)))
        return snapshot(self, samples)

    async def recording_passed(self, lane):
        log.append(("passed", lane))
        await passed(self, lane)

    state = None
    if restore:
        with Loader(config, backend="threads") as loader:
            for _ in zip(range(7), loader):
                pass
            state = loader.state_dict()
    monkeypatch.setattr(TextLane, "_snapshot", recording_snapshot)
    monkeypatch.setattr(FirstStep, "passed", recording_passed)
    loader = Loader(config, backend="threads")
    if state is not None:
        loader.load_state_dict(state)
    with loader:
        first = batch_records(next(iter(loader)))
    assert first
    last_pass = max(i for i, e in enumerate(log) if e[0] == "passed")
    assert sorted(e[1] for e in log if e[0] == "passed") == list(range(config.lanes))
    ahead = [e for e in log[:last_pass] if e[0] == "sample" and e[2] >= e[3]]
    assert not ahead, f"lanes made samples past their first step before every lane had made it: {ahead[:3]}"
