"""examples/rl_loop.py end to end: trainer, relay across a throttled link, two rollout workers, one SIGKILLed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zephon_stream.testing.seaweed import find_weed

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.s3
def test_rl_loop_bit_exact_and_a_killed_worker_catches_up(tmp_path: Path) -> None:
    try:
        find_weed()
    except FileNotFoundError as exc:
        pytest.skip(f"no SeaweedFS: {exc}")
    out = tmp_path / "run.json"
    cmd = [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--quick", "--data", str(tmp_path / "data"),
           "--versions", "5", "--every", "2", "--tokens", "4", "--kill-worker", "1", "--kill-at", "3",
           "--verify-bytes", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    run = json.loads(out.read_text())
    published = {int(v): p for v, p in run["published"].items()}
    assert sorted(published) == [1, 2, 3, 4, 5]
    assert published[1]["keyframe"] and published[5]["keyframe"] and not published[2]["keyframe"]

    events = run["events"]
    assert events and run["ok"]
    for e in events:  # the O(delta) digest and the O(model) SHA-256 both agree with the trainer's version
        assert e["digest"] == published[e["version"]]["digest"], e
        assert e["sha"] == published[e["version"]]["sha"], e
        assert e["bit_exact"] is True
    by_worker = {w: [e for e in events if e["worker"] == w] for w in (0, 1)}
    assert max(e["version"] for e in by_worker[0]) == 5

    [restart] = run["restarts"]
    assert restart["worker"] == 1 and restart["had"] >= 1  # it held a version when it was killed
    before = [e for e in by_worker[1] if e["pid"] == restart["pid"]]
    after = [e for e in by_worker[1] if e["pid"] != restart["pid"]]
    assert before and after, "worker 1 applied versions both before the SIGKILL and after its restart"
    assert all(e["applied"] > restart["at"] for e in after)
    assert after[-1]["version"] == 5  # caught up, bit-exact (asserted for every event above)
    assert "SIGKILL" in proc.stdout and "bit-exact yes" in proc.stdout
