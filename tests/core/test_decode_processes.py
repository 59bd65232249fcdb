"""The loader with images decoded in worker processes (`vision.decode_processes`): the determinism
matrix's records, across resumes to and from the threads' decode, and a user's script that has no
`if __name__ == "__main__":` guard."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from zephon_stream.loader.loader import Loader
from zephon_stream.testing.determinism import run_world

pytestmark = pytest.mark.skipif(os.name != "posix", reason="decode processes need POSIX")
STEPS = 24


def with_processes(cfg, n: int = 2):
    return cfg.replace(vision=msgspec.structs.replace(cfg.vision, decode_processes=n))


def test_records_equal_the_threads_decode_across_resumes(vision_config) -> None:
    baseline, _ = run_world(vision_config, 1, STEPS, backend="inline")
    procs = with_processes(vision_config)
    assert run_world(procs, 3, STEPS, backend="threads")[0] == baseline
    first, states = run_world(procs, 2, 9, backend="threads")  # decoded in processes, resumed on threads
    rest, states2 = run_world(vision_config, 4, 8, backend="threads", resume=states)
    last, _ = run_world(with_processes(vision_config, 1), 1, STEPS - 17, backend="threads", resume=states2)
    assert first + rest + last == baseline


def test_a_script_without_a_main_guard_streams_images(tmp_path: Path, vision_config) -> None:
    """The workers run a module of their own: the user's script is not imported again in them."""
    path = tmp_path / "job.toml"
    path.write_text(with_processes(vision_config).replace(max_epochs=1).to_toml())
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        from zephon_stream import Config, Loader
        images = sum(len(b["image_grid_thw"]) for b in Loader(Config.from_toml({str(path)!r})))
        print("images", images)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("images") == 1 and int(run.stdout.split()[-1]) > 0


@pytest.mark.parametrize("backend", ["inline", "processes"])
def test_other_backends_say_they_ignore_the_setting(vision_config, backend, caplog) -> None:
    """Said in the calling process: the processes backend's lane workers build the lanes, and their log
    may go nowhere (a trial saw nothing from that backend)."""
    from zephon_stream.loader import backends

    backends._warn_once.cache_clear()
    cfg = with_processes(vision_config).replace(backend=backend, max_epochs=1)
    before = _decode_workers_below(os.getpid())  # this process's pool, if a test before this one made it
    with caplog.at_level("WARNING", logger="zephon_stream.loader"):
        for _ in Loader(cfg):
            assert _decode_workers_below(os.getpid()) == before  # and so it is: a lane worker started 2 of its own
            break
    assert f"vision.decode_processes = 2 applies to backend \"threads\" only: backend {backend!r}" in caplog.text


def _decode_workers_below(pid: int) -> list[int]:
    """The decode processes among the descendants of `pid` (they start in a session of their own)."""
    parent, marked = {}, []
    for entry in Path("/proc").iterdir():
        try:
            parent[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            if b"an image decode worker" in (entry / "cmdline").read_bytes():
                marked.append(int(entry.name))
        except (ValueError, OSError):
            continue

    def below(p: int) -> bool:
        while p > 1:
            p = parent.get(p, 0)
            if p == pid:
                return True
        return False

    return sorted(p for p in marked if below(p))


def test_more_processes_than_cores_is_said_and_the_threads_follow(vision_config, caplog, monkeypatch) -> None:
    from zephon_stream.loader import backends

    backends._warn_once.cache_clear()
    monkeypatch.setattr(backends, "usable_cores", lambda: 2)
    cfg = with_processes(vision_config, 6)
    with caplog.at_level("WARNING", logger="zephon_stream.loader"):
        backends.warn_decode_processes(cfg)
    assert "vision.decode_processes = 6 is more than the 2 cores this process may run on" in caplog.text
    assert backends.decode_policy(cfg).threads == 6  # a call reaches a worker from a decode thread: one each
    assert backends.decode_policy(with_processes(vision_config, 2)).threads == vision_config.vision.decode_threads


@pytest.mark.parametrize("steps", [1, 3])
def test_an_iteration_left_open_at_exit_ends_cleanly(tmp_path: Path, vision_config, steps) -> None:
    """`batches = iter(loader)` still open at exit: the iteration is closed first, then the decode
    processes (closed first, they failed the lanes' calls under it: tracebacks, and a hang)."""
    path = tmp_path / "job.toml"
    path.write_text(with_processes(vision_config).to_toml())
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        from zephon_stream import Config, Loader
        batches = iter(Loader(Config.from_toml({str(path)!r})))
        for _ in range({steps}):
            next(batches)
        from zephon_stream.vision import processes
        print("workers", *[w.proc.pid for w in processes._POOL._all], flush=True)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0 and run.stderr == "", run.stderr
    pids = [int(p) for p in run.stdout.split()[1:]]
    assert len(pids) == 2
    for pid in pids:  # ended with it (their parent reaped them: none is left, not even as a zombie)
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
