"""Elastic resume of a real training job: examples/train_tiny_gpt.py under torchrun (gloo, L = 12)
on 4 processes, cut cleanly at step 5, resumed on 2, killed with SIGKILL at step 9, resumed on 3
from the newest complete DCP checkpoint. Every global batch after every cut equals the
uninterrupted run's, and so does the loss (model and optimizer resumed too)."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed.conftest import STEPS

EXAMPLE = Path(__file__).parents[2] / "examples" / "train_tiny_gpt.py"
MODEL = ("--d-model", 32, "--layers", 1, "--heads", 2, "--ckpt-every", 2)
STEP = re.compile(r"^step +(\d+) +loss ([\d.]+) +batch ([0-9a-f]{64})$", re.M)
RESUMED = re.compile(r"^resumed from \S+ at step (\d+) on (\d+) processes$", re.M)
PID = re.compile(r"^rank 0 pid (\d+):")
CUT, KILL_AT = 5, 9
Steps = dict[int, tuple[float, str]]  # step -> (loss, global-batch digest)

pytestmark = pytest.mark.slow


def steps(output: str) -> Steps:
    return {int(s): (float(loss), digest) for s, loss, digest in STEP.findall(output)}


def resumed(output: str) -> tuple[int, int] | None:
    found = RESUMED.findall(output)
    return (int(found[0][0]), int(found[0][1])) if found else None


def kill_rank0_at(torchrun, step: int, nproc: int, *args: object) -> str:
    """Run the job; SIGKILL rank 0 right after it prints `step`. The job's whole output."""
    proc = torchrun.start(nproc, EXAMPLE, *args)
    lines, pid = [], None
    for line in torchrun.lines(proc):
        lines.append(line)
        if (m := PID.match(line)) is not None:
            pid = int(m[1])
        if (m := STEP.match(line.rstrip("\n"))) is not None and int(m[1]) == step:
            assert pid is not None, "rank 0 did not print its pid"
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0, "the job should fail once rank 0 is killed"
    return "".join(lines)


def complete_checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in run.glob("step_*") if (p / ".metadata").is_file())


def assert_continues(got: Steps, want: Steps, first: int, last: int) -> None:
    assert sorted(got) == list(range(first, last + 1)), sorted(got)
    for s in range(first, last + 1):
        assert got[s][1] == want[s][1], f"global batch {s} differs from the uninterrupted run's"
        assert got[s][0] == pytest.approx(want[s][0], abs=1e-3), f"loss at step {s}: {got[s]} vs {want[s]}"


def test_train_4_then_2_killed_then_3_processes(torchrun, stream_config, baseline, tmp_path):
    toml = stream_config[1]
    run = tmp_path / "run"
    with ThreadPoolExecutor(1) as pool:  # the reference run beside the first cut: each launch has its own namespace
        reference = pool.submit(torchrun, 1, EXAMPLE, "--config", toml, "--steps", STEPS, "--ckpt-dir",
                                tmp_path / "ref", *MODEL)
        first = torchrun(4, EXAMPLE, "--config", toml, "--steps", CUT, "--ckpt-dir", run, *MODEL)  # a clean cut
        ref = steps(reference.result())
    assert [ref[s][1] for s in range(STEPS)] == baseline
    assert ref[STEPS - 1][0] < ref[0][0] - 0.3, "the loss should go down"

    assert resumed(first) is None
    assert_continues(steps(first), ref, 0, CUT - 1)

    second = kill_rank0_at(torchrun, KILL_AT, 2, "--config", toml, "--steps", STEPS, "--ckpt-dir", run,
                           *MODEL)
    assert resumed(second) == (CUT, 2)
    got = steps(second)
    assert_continues(got, ref, CUT, max(got))
    assert max(got) >= KILL_AT
    newest = complete_checkpoints(run)[-1]
    assert KILL_AT - 1 <= newest <= max(got) + 1
    (run / f"step_{STEPS - 1:06d}").mkdir()  # a save cut short: data written, `.metadata` never renamed in
    (run / f"step_{STEPS - 1:06d}" / "__0_0.distcp").write_bytes(b"partial")

    third = torchrun(3, EXAMPLE, "--config", toml, "--steps", STEPS, "--ckpt-dir", run, *MODEL)
    assert resumed(third) == (newest, 3)
    assert_continues(steps(third), ref, newest, STEPS - 1)
