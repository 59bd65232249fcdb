"""Real multi-process runs (torchrun, gloo on CPU, loopback only): the global batches of every
world size, and of tensor-parallel peers, equal the single-process run's byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.conftest import STEPS

WORKER = Path(__file__).parent / "_worker.py"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_world_size_does_not_change_global_batches(torchrun, stream_config, baseline, tmp_path, nproc):
    torchrun(nproc, WORKER, stream_config[1], tmp_path, STEPS)
    assert json.loads((tmp_path / "world.json").read_text()) == baseline


def test_tensor_parallel_peers_receive_identical_batches(torchrun, stream_config, baseline, tmp_path):
    torchrun(4, WORKER, stream_config[1], tmp_path, STEPS, "--tp", 2)  # mesh [[0, 1], [2, 3]]: dp x tp
    ranks = [json.loads((tmp_path / f"mesh-rank{r}.json").read_text()) for r in range(4)]
    coords = [(r["dp_rank"], r["dp_size"], r["tp_rank"]) for r in ranks]
    assert coords == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    assert ranks[0]["local"] == ranks[1]["local"] and ranks[2]["local"] == ranks[3]["local"]
    assert ranks[0]["local"] != ranks[2]["local"]  # the two DP ranks get different halves
    assert ranks[0]["global"] == ranks[1]["global"] == baseline  # each DP group's first rank gathers
    assert ranks[2]["global"] is None and ranks[3]["global"] is None
