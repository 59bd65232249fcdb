"""The Ray side of tests/core/test_ray.py, run in a network namespace that has only loopback.

    unshare --net -- python -m tests.core._ray_child SPEC.json OUT.json

SPEC names the text, image+text and transforms configs (TOML files) and the steps. One local Ray is
started the way the backend starts one (`ray_session`: 127.0.0.1, its own temp dir) and used by
every case; OUT gets each case's per-sample records as each case ends (so a crash loses only
the cases after it), or `{"skip": why}` when Ray cannot start here.
"""

from __future__ import annotations

import json
import os
import random
import select
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio.from_thread

from tests.core.test_error_order import first_errors
from tests.core.test_worker_restarts import sigkill_and_wait
from tests.distributed._launch import loopback_up
from zephon_stream import Config, ConfigError, Loader, ZephonError
from zephon_stream.engine import threads
from zephon_stream.loader.ray_backend import ACTOR_NAME, ray_session
from zephon_stream.testing.determinism import batch_records, rank_records, run_world
from zephon_stream.testing.stores import WithLatency


def lane_actors() -> list[int]:
    """Pids of the lane actors of this process's Ray (its descendants named `ray::_LaneActor...`)."""
    return sorted(pid for pid, title in descendants().items() if title.startswith(f"ray::{ACTOR_NAME}"))


def descendants() -> dict[int, str]:
    """This process's descendants: pid -> the first word of its command line."""
    children: dict[int, list[int]] = {}
    titles = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            titles[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (ValueError, OSError):
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    mine, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        mine.append(pid)
        todo += children.get(pid, [])
    return {pid: titles.get(pid, "") for pid in mine if pid != os.getpid()}


def ray_outlives_idle_threads() -> bool:
    """Whether Ray's GCS still runs after every worker thread idle at the start has ended (IDLE_SECONDS
    is lowered for the start): Linux kills it when the thread that started it ends.

    Waits on what happens, not for a fixed time: until each pool thread has left /proc/self/task
    (by then Linux has sent the death signal of any child that thread started), then on the GCS's
    pidfd for its exit, which such a SIGKILL brings within milliseconds (2 s allowed)."""
    pool = [Path(f"/proc/self/task/{t.native_id}") for t in threading.enumerate() if t.name == "zephon-worker"]
    gone, deadline = threading.Event(), time.monotonic() + 10 * threads.IDLE_SECONDS + 30
    while any(task.exists() for task in pool):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pool threads still alive {10 * threads.IDLE_SECONDS + 30:.0f} s after going idle")
        gone.wait(threads.IDLE_SECONDS / 10)  # nothing sets it: the interval between two looks at /proc
    gcs = [pid for pid, title in descendants().items() if Path(title).name == "gcs_server"]
    if not gcs:
        return False
    fd = os.pidfd_open(gcs[0])
    try:
        return not select.select([fd], [], [], 2.0)[0]  # readable: it exited
    finally:
        os.close(fd)


def killed_run(config: Config, steps: int, cuts: set[int], seed: int) -> dict[str, Any]:
    """Records of `steps` batches on dp 1, an actor SIGKILLed after each step in `cuts`."""
    rng, records, killed = random.Random(seed), [], 0
    loader = Loader(config, backend="ray")
    for batch in loader:
        records += batch_records(batch)
        actors = lane_actors()
        if batch["step"] in cuts and actors:
            killed += sigkill_and_wait(rng.choice(actors))  # False: it had exited already, nothing killed
        if loader.step == steps:
            break
    st = loader.statistics()
    return {"records": records, "killed": killed, "restarts": st.worker_restarts,
            "peak": st.peak_buffered_batches, "capacity": st.buffer_capacity}


def refused_after_max_restarts(config: Config) -> str:
    loader = Loader(config.replace(max_restarts=0), backend="ray")
    try:
        for _ in loader:
            for pid in lane_actors()[:1]:
                sigkill_and_wait(pid)
    except ZephonError as exc:
        return str(exc)
    return "no error"


def transforms_run(cfg: Config) -> dict[str, Any]:
    """test_transforms.py's case: dp 2 on one actor to the end of the data; the records, and the
    filtered counts the actor reported."""
    cfg = cfg.replace(ray_actors=1)
    records, filtered = [], {}
    for rank in range(2):
        loader = Loader(cfg, dp_rank=rank, dp_size=2, backend="ray")
        records += rank_records(loader, None)
        for name, n in loader.statistics().filtered_records.items():
            filtered[name] = filtered.get(name, 0) + n
    return {"records": sorted(records, key=lambda r: r[1]), "filtered": filtered}


def png_text_run(cfg: Config) -> list[tuple[int, int]]:
    """test_vision.py's case on one actor: (images, skipped) under Pillow's default PNG text limits,
    then under the trainer's raised ones."""
    from PIL import PngImagePlugin

    from tests.core.test_vision import RAISED_PNG_TEXT_LIMITS, _run

    cfg = cfg.replace(ray_actors=1)
    default = PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY
    try:
        before = _run(cfg, "ray")
        PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY = RAISED_PNG_TEXT_LIMITS
        return [before, _run(cfg, "ray")]
    finally:
        PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY = default


class Out(dict):
    """The results so far, written to OUT after each case (whole: a new file renamed over the old),
    so that the cases done before a crash of the child or of Ray are still checked one by one."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        part = self.path.with_suffix(".part")
        part.write_text(json.dumps(self))
        os.replace(part, self.path)


def cases(text: Config, vision: Config, transforms: Config, errors: Config, png_text: Config, steps: int,
          out: Out) -> None:
    """Each case's records into `out`. Lane actors start slowly on a loaded 2-core host (seconds
    each), so the cases are chosen to start few: 9 for the matrix, 1 for the transforms, 11 for the
    kills, 1 for the refusal, 2 for the errors, 2 for the PNG text limits."""
    one = text.replace(ray_actors=1)
    timed(out, "dp1_three_actors_latency", lambda: run_world(
        text.replace(ray_actors=3, sample_buffer=1), 1, steps, backend="ray",
        wrap_store=WithLatency(seed=3, max_ms=4))[0])
    timed(out, "vision_dp1", lambda: run_world(vision.replace(ray_actors=1), 1, steps, backend="ray")[0])

    def onto() -> list:  # resume from threads (dp 4) onto ray (dp 2)
        first, states = run_world(text, 4, 9, backend="threads")
        return first + run_world(one, 2, steps - 9, backend="ray", resume=states)[0]

    def off() -> list:  # resume from ray (dp 3) onto inline (dp 1)
        first, states = run_world(one, 3, 17, backend="ray")
        return first + run_world(text, 1, steps - 17, backend="inline", resume=states)[0]

    timed(out, "onto_dp2", onto)
    timed(out, "off_dp3", off)
    timed(out, "transforms", lambda: transforms_run(transforms))  # actors import the transforms by name
    # 12 cuts, two in a row too; a cut that finds no actor alive (one still starting) kills none
    cuts = set(random.Random(15).sample(range(7, 2 * steps - 8), 10)) | {5, 6}
    timed(out, "kills", lambda: killed_run(text.replace(max_restarts=len(cuts)), 2 * steps, cuts, seed=15))
    timed(out, "max_restarts", lambda: refused_after_max_restarts(one))
    # bad records in several lanes: the same error after the same batches as in-process (test_error_order.py)
    timed(out, "errors", lambda: {"inline": first_errors(errors, backend="inline"),
                                  "ray": first_errors(errors.replace(ray_actors=2), backend="ray",
                                                      wrap_store=WithLatency(seed=6, max_ms=3))})
    timed(out, "png_text", lambda: png_text_run(png_text))  # Pillow's PNG text limits, the trainer's


def timed(out: Out, case: str, run: Callable[[], Any]) -> None:
    """out[case] = run(), saved; its seconds to stderr (shown when the test fails, and with -s)."""
    t0 = time.monotonic()
    out[case] = run()
    out.save()
    print(f"ray case {case}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


def main(spec_path: str, out_path: str) -> None:
    loopback_up()
    spec = json.loads(Path(spec_path).read_text())
    text, vision, transforms, errors, png_text = (Config.from_toml(spec[name])
                                                  for name in ("text", "vision", "transforms", "errors", "png_text"))
    result = Out(Path(out_path))
    idle, threads.IDLE_SECONDS = threads.IDLE_SECONDS, 0.5  # the thread that starts Ray would end at once
    with anyio.from_thread.start_blocking_portal() as portal:
        try:
            session = portal.wrap_async_context_manager(ray_session(text, 3))
            session.__enter__()
        except ConfigError as exc:
            result["skip"] = str(exc)
        else:
            try:
                import ray

                temp = ray._private.worker._global_node.get_temp_dir_path()  # the session's files
                result["temp"] = temp  # now: if Ray ends this process, the parent shows Ray's logs from it
                result.save()
                result["outlives_idle_threads"] = ray_outlives_idle_threads()
                threads.IDLE_SECONDS = idle
                cases(text, vision, transforms, errors, png_text, spec["steps"], result)
                result["node_ip"] = ray.util.get_node_ip_address()
            finally:
                session.__exit__(None, None, None)
            result["temp_left"] = Path(temp).exists()
            result["ray_left"] = ray.is_initialized()
    result.save()


if __name__ == "__main__":
    main(*sys.argv[1:])
