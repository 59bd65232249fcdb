"""The determinism matrix on the ray backend, and Ray actors killed at random points.

Ray binds to the host's address, and tests may reach only 127.0.0.1, so the Ray side runs in
a child process in a network namespace that has only loopback (`unshare --net`, `lo` up: the
mechanism of tests/distributed), started once for the session (`_ray_child.py`, the `ray_child`
fixture of tests/core/conftest.py; test_transforms.py's ray case runs in it too). Its per-sample
digests are compared here with the in-process baseline. Where the namespace cannot be made,
Ray is missing, or Ray does not start, every test here is skipped with the reason.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zephon_stream.loader.config import Config
from zephon_stream.testing.determinism import run_world

pytestmark = pytest.mark.slow  # one Ray start and ~20 actor starts: about a minute on 2 cores

STEPS = 24
CHILD_TIMEOUT_S = 240
ROOT = Path(__file__).parents[2]


@functools.cache
def sandbox_problem() -> str | None:
    """Why Ray cannot run here in a loopback-only network namespace, or None if it can."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return 'Ray is not installed: pip install "zephon-stream[ray]" to run the ray backend tests'
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux and util-linux `unshare` to run Ray in a loopback-only network namespace"
    probe = subprocess.run(["unshare", "--net", "--", sys.executable, "-c", "import socket"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode:
        return (f"`unshare --net` failed ({probe.stderr.strip()[-200:]}): the Ray tests need root or "
                "CAP_SYS_ADMIN so that Ray can reach only 127.0.0.1")
    return None


class ChildResults(dict):
    """The Ray child's results by case; a case it did not finish fails with the child's output."""

    def __init__(self, results: dict[str, Any], failure: str | None) -> None:
        super().__init__(results)
        self.failure = failure  # why the child did not exit cleanly (None: it did)

    def __missing__(self, case: str) -> Any:
        raise AssertionError(f"the Ray child has no result for {case!r}: {self.failure or 'it exited 0 without it'}")


class RayChild:
    """Runs `_ray_child.py` once (on the first configs asked for) and keeps its results: one Ray
    start for every Ray case of the session (a start is seconds of a 2-core host). A child that
    fails is not run again: the cases it finished are checked, the others fail with its output."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.results = tmp, None

    def __call__(self, text: Config, vision: Config) -> ChildResults:
        if self.results is None:
            self.results = self._run(text, vision)
        if "skip" in self.results:
            pytest.skip(f"Ray did not start in the network namespace: {self.results['skip']}")
        return self.results

    def _run(self, text: Config, vision: Config) -> ChildResults:
        from tests.core.test_transforms import ray_transforms_config

        configs = {"text": text, "vision": vision, "transforms": ray_transforms_config(text)}
        for name, cfg in configs.items():
            (self.tmp / f"{name}.toml").write_text(cfg.to_toml())
        spec = self.tmp / "spec.json"
        spec.write_text(json.dumps({**{name: str(self.tmp / f"{name}.toml") for name in configs}, "steps": STEPS}))
        out = self.tmp / "out.json"
        cmd = ["unshare", "--net", "--", sys.executable, "-m", "tests.core._ray_child", str(spec), str(out)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            failure = (f"the Ray child exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
                       if proc.returncode else None)
        except subprocess.TimeoutExpired as exc:
            failure = f"the Ray child ran past {CHILD_TIMEOUT_S} s:\n{str(exc.stderr or '')[-8000:]}"
        return ChildResults(json.loads(out.read_text()) if out.exists() else {}, failure)


@pytest.fixture()
def results(ray_child, config, vision_config) -> ChildResults:
    return ray_child(config, vision_config)


_baselines: dict[tuple[str, int], list[tuple]] = {}


def baseline(config: Config, steps: int = STEPS) -> list[tuple]:
    """Records of the inline single-rank run (computed once per config and length)."""
    key = (config.to_toml(), steps)
    if key not in _baselines:
        _baselines[key] = run_world(config, 1, steps, backend="inline")[0]
    return _baselines[key]


def records(results: dict[str, Any], case: str) -> list[tuple]:
    return [tuple(r) for r in results[case]]


@pytest.mark.parametrize("case", ["dp1_three_actors_latency", "onto_dp2", "off_dp3"])
def test_text_matrix_on_ray(results, config, case):
    """dp 1 on three actors with a latency store (sample_buffer 1); resume from threads (dp 4) onto
    ray (dp 2), and from ray (dp 3) onto inline: the bytes of the inline single-rank run."""
    assert records(results, case) == baseline(config)


def test_image_text_on_ray(results, vision_config):
    assert records(results, "vision_dp1") == baseline(vision_config)


def test_actors_killed_at_random_points(results, config):
    """>= 10 SIGKILLs of lane actors across a run (two in a row too): nothing repeated or skipped."""
    kills = results["kills"]
    assert [tuple(r) for r in kills["records"]] == baseline(config, 2 * STEPS)
    assert kills["restarts"] == kills["killed"] >= 10
    assert kills["peak"] <= kills["capacity"] + 1


def test_fails_after_max_restarts_naming_the_lanes(results):
    assert results["max_restarts"].startswith("lane worker ")
    assert "Ray actor: ActorDiedError) died, and its max_restarts = 0 restarts are spent: lanes [" in \
        results["max_restarts"]


def test_local_ray_is_private_to_loopback_and_cleaned_up(results):
    assert results.failure is None, results.failure
    assert results["node_ip"] == "127.0.0.1"
    assert Path(results["temp"]).name.startswith("zephon-ray-")
    assert not results["temp_left"] and not results["ray_left"]
