"""Lane workers that die: a worker process killed with SIGKILL at random points is started again
where its lanes stood, and the per-sample digests equal those of an uninterrupted run.

The same checks for Ray actors run in tests/core/test_ray.py (Ray needs a network namespace)."""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import select
import signal
import time

import msgspec
import numpy as np
import pytest

from zephon_stream import ZephonError
from zephon_stream.cli.progress import StreamProgress
from zephon_stream.loader.loader import Loader, LoaderStatistics
from zephon_stream.loader.restarts import Supervision
from zephon_stream.loader.state import LaneState
from zephon_stream.operators.read import RecordCounts
from zephon_stream.operators.types import Sample
from zephon_stream.testing.determinism import batch_records, run_world

STEPS = 40
CUTS = 12
WORKER = "zephon-lanes-"  # the processes backend's worker names: zephon-lanes-<w>


def kill_worker(rng: random.Random, only: str = WORKER) -> int | None:
    """SIGKILL one live lane worker process (chosen by `rng`); its pid, or None if none is alive.

    A process can be listed but already dead (exited, not yet reaped): killing it kills nothing,
    so the next candidate is tried."""
    alive = sorted((p for p in multiprocessing.active_children() if p.name.startswith(only)), key=lambda p: p.name)
    rng.shuffle(alive)
    for victim in alive:
        if sigkill_and_wait(victim.pid):
            return victim.pid
    return None


def sigkill_and_wait(pid: int) -> bool:
    """SIGKILL `pid` and wait until it has exited (its pidfd turns readable), so that the next cut
    cannot pick the same dying process again. False if it had exited already: nothing was killed."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if select.select([fd], [], [], 0)[0]:  # readable before the signal: it had already exited
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        assert select.select([fd], [], [], 60)[0], f"process {pid} outlived SIGKILL by 60 s"
        return True
    finally:
        os.close(fd)


def killed_run(loader: Loader, steps: int, cuts: set[int], kill) -> list:
    """Records of `steps` batches, killing a worker (`kill()`) after each step in `cuts`."""
    records, killed = [], 0
    for batch in loader:
        records += batch_records(batch)
        if batch["step"] in cuts:
            killed += _kill_one(kill)
        if loader.step == steps:
            break
    assert killed == len(cuts), "a cut found no live worker to kill"
    return records


def _kill_one(kill) -> bool:
    """`kill()`, again until a worker is alive to kill (at most 30 s): two cuts in a row can find
    both workers dead, the second one's restart not started yet on a loaded machine (a clean clone's
    `make test`, with its second test process beside it)."""
    deadline = time.monotonic() + 30
    while kill() is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
def test_processes_workers_killed_at_random_points(config):
    """>= 10 SIGKILLs across a run, at random steps (two in a row too): nothing repeated or skipped."""
    baseline, _ = run_world(config, 1, STEPS, backend="inline")
    rng = random.Random(1515)
    cuts = set(rng.sample(range(1, STEPS - 8), CUTS - 1)) | {3, 4}  # the last cuts leave the successor work to do
    loader = Loader(config.replace(max_restarts=len(cuts), workers=2), backend="processes")
    records = killed_run(loader, STEPS, cuts, lambda: kill_worker(rng))
    assert records == baseline
    st = loader.statistics()
    assert st.worker_restarts == len(cuts) >= 10
    assert st.peak_buffered_batches <= st.buffer_capacity + 1  # credits held across the restarts


@pytest.mark.slow
def test_processes_fail_after_max_restarts_naming_the_lanes(config):
    loader = Loader(config.replace(max_restarts=1, workers=2), backend="processes")
    rng = random.Random(0)
    with pytest.raises(ZephonError, match=r"lane worker 1 \(process exit code -9\) died, and its max_restarts = 1 "
                                          r"restarts are spent: lanes \[1, 3, 5, 7, 9, 11\] stopped at samples"):
        for _ in loader:  # kill worker 1 after every batch until the loader gives up on it
            kill_worker(rng, only=WORKER + "1")
    assert loader.statistics().worker_restarts == 1


def _sample(lane: int, index: int) -> Sample:
    state = msgspec.structs.replace(LaneState.initial(lane, 2), samples=index + 1)
    empty = np.zeros(0, np.int32)
    return Sample(empty, empty, empty, [], 0, lane, index, state)


def test_supervision_restarts_from_the_last_received_state_with_the_credits_left(config):
    states = {lane: LaneState.initial(lane, 2) for lane in (0, 2, 4)}
    sup = Supervision(config.replace(sample_buffer=4, max_restarts=1), states, [[0, 4], [2]])
    batch = [_sample(0, 0), _sample(0, 1)]
    sup.received(0, batch)
    sup.received(0, batch)
    sup.credited(0)
    assert sup.credits(0) == 3 and sup.credits(4) == 4  # one batch of lane 0 still waits here
    assert sup.states(0) == [batch[-1].state, states[4]] and batch[-1].state.samples == 2
    sup.ended.add(4)
    sup.set_skipped(0, RecordCounts({0: 5}, {1: {0: 2}}))
    sup.lost(0, "test")
    assert sup.live(0) == [0] and sup.total_restarts() == 1 and sup.skipped() == RecordCounts({0: 5}, {1: {0: 2}})
    sup.set_skipped(0, RecordCounts({0: 1, 1: 1}, {1: {1: 3}}))  # the successor counts from zero
    assert sup.skipped() == RecordCounts({0: 6, 1: 1}, {1: {0: 2, 1: 3}})
    with pytest.raises(ZephonError, match=r"lane worker 0 \(test\) died, and its max_restarts = 1 .*lanes \[0\]"):
        sup.lost(0, "test")


def test_progress_line_shows_restarts_once_there_are_some():
    stats = dict(step=3, samples=24, tokens=3000, skipped_records=0, skipped_by_epoch={}, skipped_shards=0,
                 buffered_batches=40,
                 peak_buffered_batches=48, buffer_capacity=48, store_requests=0, store_retries=0, store_bytes_read=0)
    progress = StreamProgress(lambda: None, file=io.StringIO(), tty=False, clock=lambda: 0.0)
    assert progress.line(LoaderStatistics(**stats, worker_restarts=2), 1.0).endswith("skipped 0  restarts 2")
    assert progress.line(LoaderStatistics(**stats), 1.0).endswith("skipped 0")
