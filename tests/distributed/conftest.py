"""Multi-process fixtures: torchrun (gloo on CPU) inside a network namespace that has only loopback.

    def test_x(torchrun, stream_config, baseline):      # toml = stream_config[1]
        output = torchrun(4, WORKER, toml, out, "10")           # waits; raises with the output on failure
        proc = torchrun.start(2, script, ...)                   # running; `for line in torchrun.lines(proc)`

torchrun's store and gloo may bind every interface, so each launch runs under `unshare --net`
(see `_launch.py`): the processes can reach 127.0.0.1 and nothing else, and every launch has a
loopback of its own, so the fixed master port never clashes with anything. Where a namespace
cannot be made (no `unshare`, no CAP_SYS_ADMIN) the tests are skipped with the reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.conftest import build_dataset
from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.distributed import batch_digest

HERE = Path(__file__).parent
LAUNCH = HERE / "_launch.py"
STEPS = 14  # global batches in the reference run: about half an epoch of the dataset below
RUN_TIMEOUT_S = 180


@functools.cache
def sandbox_problem() -> str | None:
    """Why a loopback-only network namespace cannot be made here, or None if it can."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux and util-linux `unshare` to run torchrun in a loopback-only network namespace"
    probe = subprocess.run(["unshare", "--net", "--", sys.executable, "-c", "import socket"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode:
        return (f"`unshare --net` failed ({probe.stderr.strip()[-200:]}): multi-process tests need root or "
                "CAP_SYS_ADMIN so that torchrun and gloo can reach only 127.0.0.1")
    return None


class Torchrun:
    """Launches `torchrun --nproc_per_node N script args` (gloo, 127.0.0.1) in a fresh network namespace."""

    def command(self, nproc: int, script: Path | str, *args: object) -> list[str]:
        return ["unshare", "--net", "--", sys.executable, str(LAUNCH), "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", "29500", "--monitor_interval", "0.1",
                str(script), *map(str, args)]

    def env(self) -> dict[str, str]:
        return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def start(self, nproc: int, script: Path | str, *args: object) -> subprocess.Popen[str]:
        """The job, running; stdout and stderr merged (whole lines: each is one short write)."""
        return subprocess.Popen(self.command(nproc, script, *args), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=self.env())

    def lines(self, proc: subprocess.Popen[str]) -> Iterator[str]:
        """The job's output lines as they come; torchrun gets SIGTERM (and stops its workers) if
        the job outlives RUN_TIMEOUT_S."""
        watchdog = threading.Timer(RUN_TIMEOUT_S, proc.terminate)
        watchdog.start()
        try:
            with proc:
                yield from proc.stdout
        finally:
            watchdog.cancel()

    def __call__(self, nproc: int, script: Path | str, *args: object) -> str:
        """Run the job to the end; its output, or an AssertionError with it if it failed."""
        proc = self.start(nproc, script, *args)
        output = "".join(self.lines(proc))
        if proc.returncode:
            raise AssertionError(f"torchrun --nproc_per_node {nproc} {script} exited {proc.returncode}:\n"
                                 f"{output[-8000:]}")
        return output


@pytest.fixture(scope="session")
def torchrun() -> Torchrun:
    problem = sandbox_problem()
    if problem:
        pytest.skip(problem)
    return Torchrun()


@pytest.fixture(scope="session")
def stream_config(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, Path]:
    """The generated two-source dataset of tests/core, L = 12 lanes, and its config as TOML."""
    root = tmp_path_factory.mktemp("dist-data")
    build_dataset(root)
    config = Config(seed=1234, lanes=12, seq_len=64, global_batch_size=24,
                    tokenizer=str(root / "tokenizer.json"), shuffle_window=8, split_bytes=4096,
                    sample_batch=2, cpu_threads=1,
                    sources=[SourceConfig(name="a", uri=f"file://{root}/a/", weight=0.6),
                             SourceConfig(name="b", uri=f"file://{root}/b/", weight=0.4)])
    path = root / "stream.toml"
    path.write_text(config.to_toml())
    return config, path


@pytest.fixture(scope="session")
def baseline(stream_config: tuple[Config, Path]) -> list[str]:
    """Global-batch digests of the uninterrupted single-process run (no torch.distributed)."""
    loader = Loader(stream_config[0], dp_rank=0, dp_size=1)
    digests = []
    for batch in loader:
        digests.append(batch_digest(batch["input_ids"], batch["slots"]))
        if loader.step == STEPS:
            break
    assert len(set(digests)) == STEPS
    return digests
