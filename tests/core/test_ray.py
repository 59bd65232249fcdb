"""The determinism matrix on the ray backend, and Ray actors killed at random points.

Ray binds to the host's address, and tests may reach only 127.0.0.1, so the Ray side runs in
a child process in a network namespace that has only loopback (`unshare --net`, `lo` up: the
mechanism of tests/distributed), started once for the session (`_ray_child.py`, the `ray_child`
fixture of tests/core/conftest.py; test_transforms.py's ray case is here, to run in it too). Its per-sample
digests are compared here with the in-process baseline. Where the namespace cannot be made,
Ray is missing, or Ray does not start, every test here is skipped with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.core.test_error_order import bad_text_config
from tests.core.test_transforms import bangs, ray_transforms_config
from tests.core.test_vision import png_text_config
from zephon_stream.loader.config import Config
from zephon_stream.testing.determinism import real, run_world

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
        configs = {"text": text, "vision": vision, "transforms": ray_transforms_config(text),
                   "errors": bad_text_config(text, self.tmp),
                   "png_text": png_text_config(vision, self.tmp / "png_text")}
        for name, cfg in configs.items():
            (self.tmp / f"{name}.toml").write_text(cfg.to_toml())
        spec = self.tmp / "spec.json"
        spec.write_text(json.dumps({**{name: str(self.tmp / f"{name}.toml") for name in configs}, "steps": STEPS}))
        out = self.tmp / "out.json"
        cmd = ["unshare", "--net", "--", sys.executable, "-m", "tests.core._ray_child", str(spec), str(out)]
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        logs = self.tmp / "child.out", self.tmp / "child.err"  # files, not pipes: nobody reads while it runs
        env = {**os.environ, "RAY_gcs_rpc_server_reconnect_timeout_s": "20"}  # a dead GCS ends it in 20 s, not 60
        with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=stderr, text=True, env=env)
        try:
            _make_baselines(text, vision)  # on the other core, while the child runs Ray
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            failure = None if proc.returncode == 0 else f"the Ray child exited {proc.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"the Ray child ran past {CHILD_TIMEOUT_S} s"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        results = json.loads(out.read_text()) if out.exists() else {}
        if failure:
            failure += f":\n{logs[0].read_text()[-4000:]}\n{logs[1].read_text()[-8000:]}"
            failure += ray_logs(results.get("temp"), self.tmp / "ray-logs")
        return ChildResults(results, failure)


def ray_logs(temp: str | None, keep: Path) -> str:
    """Which of Ray's processes outlived a child that did not exit cleanly (killed now), and the ends
    of the logs of Ray's own processes (GCS, raylet) in its session dir, which is moved to `keep`:
    why Ray died, where the child's output cannot say."""
    if not temp or not Path(temp).is_dir():
        return ""
    shown = []
    for log in sorted({log.resolve() for log in Path(temp).glob("session_*/logs/*")}, reverse=True):  # GCS last
        if log.name.startswith(("gcs_server", "raylet")) and log.is_file():
            lines = log.read_text(errors="replace").splitlines()
            tail = [line for line in lines if line.startswith("[20") or log.suffix == ".err"][-12:]  # no stats dumps
            shown.append(f"--- {log.name}, last lines:\n" + "\n".join(tail))
    logs = next(Path(temp).glob("session_2*/logs"), None)
    if logs is not None:
        shutil.copytree(logs, keep, dirs_exist_ok=True)
    shown.append(f"--- Ray's processes left: {', '.join(_kill_left(temp)) or 'none'}; Ray's logs: {keep}")
    shutil.rmtree(temp, ignore_errors=True)
    return "\n" + "\n".join(shown)


def _kill_left(temp: str) -> list[str]:
    """SIGKILL the processes whose command line names `temp` (Ray's, orphaned by the child's end);
    their names and states (R running, S sleeping, T stopped, Z zombie, ...) as they were."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if temp.encode() in (entry / "cmdline").read_bytes():
                name, _, rest = (entry / "stat").read_text().partition(") ")
                left.append(f"{name.partition(' (')[2]} (pid {entry.name}, state {rest[:1]})")
                os.kill(int(entry.name), signal.SIGKILL)
        except (ValueError, OSError):
            continue
    return left


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


def _make_baselines(text: Config, vision: Config) -> None:
    """The baselines the Ray cases compare with, made while the child runs (they take seconds, and
    the child leaves a core free). A baseline that fails here is made again by its test, and fails there."""
    for config, steps in ((text, STEPS), (text, 2 * STEPS), (vision, STEPS)):
        try:
            baseline(config, steps)
        except Exception:  # reported by the test that needs it, with its own traceback
            continue


def records(results: dict[str, Any], case: str) -> list[tuple]:
    return [tuple(r) for r in results[case]]


@pytest.mark.parametrize("case", ["dp1_three_actors_latency", "onto_dp2", "off_dp3"])
def test_text_matrix_on_ray(results, config, case):
    """dp 1 on three actors with a latency store (sample_buffer 1); resume from threads (dp 4) onto
    ray (dp 2), and from ray (dp 3) onto inline: the bytes of the inline single-rank run."""
    assert records(results, case) == baseline(config)


def test_image_text_on_ray(results, vision_config):
    assert records(results, "vision_dp1") == baseline(vision_config)


def test_pillow_s_png_text_limits_are_the_trainer_s_on_ray(results):
    """The lane actors decode under the trainer's raised limits (test_vision.py: threads, processes)."""
    assert results["png_text"] == [[7, 1], [8, 0]]


def test_actors_killed_at_random_points(results, config):
    """>= 10 SIGKILLs of lane actors across a run (two in a row too): nothing repeated or skipped."""
    kills = results["kills"]
    assert [tuple(r) for r in kills["records"]] == baseline(config, 2 * STEPS)
    assert kills["restarts"] == kills["killed"] >= 10
    assert kills["peak"] <= kills["capacity"] + 1


def test_the_same_error_after_the_same_batches_on_ray(results):
    """Bad records in several lanes (tests/core/test_error_order.py): on two actors, under injected
    latency, the same DataError after the same batches as the inline run (in the child: the
    message names the data's path)."""
    inline, ray = results["errors"]["inline"], results["errors"]["ray"]
    assert inline[0][1] is not None and inline[0][0] > 0
    assert ray == inline


def test_fails_after_max_restarts_naming_the_lanes(results):
    assert results["max_restarts"].startswith("lane worker ")
    assert "Ray actor: ActorDiedError) died, and its max_restarts = 0 restarts are spent: lanes [" in \
        results["max_restarts"]


def test_local_ray_outlives_the_thread_that_started_it(results):
    """Ray's GCS still runs once the pool thread that asked for Ray has idled out (it was killed with
    that thread when a pool worker started it: PR_SET_PDEATHSIG)."""
    assert results["outlives_idle_threads"] is True


def test_local_ray_is_private_to_loopback_and_cleaned_up(results):
    assert results.failure is None, results.failure
    assert results["node_ip"] == "127.0.0.1"
    assert Path(results["temp"]).name.startswith("zephon-ray-")
    assert not results["temp_left"] and not results["ray_left"]


def test_transforms_on_ray(results, config, dataset):
    """Ray actors import the transforms by name (test_transforms.py's case, here so that the one
    Ray child serves it on the worker that runs this file): the batches of the inline run (dp 2 on
    one actor, every step to the end of the data), and the filtered records counted from the
    actor's reports."""
    _, docs = dataset
    want, _ = run_world(ray_transforms_config(config), 1, None, backend="inline")
    assert real(tuple(r) for r in results["transforms"]["records"]) == real(want)
    assert results["transforms"]["filtered"] == {"a": bangs(docs["a"])}
