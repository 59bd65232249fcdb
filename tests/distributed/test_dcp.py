"""The loader under torch.distributed.checkpoint, in one process (the multi-process round trips,
4 -> 2 -> 3 ranks, are in test_elastic.py), and the documented way to save without DCP."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zephon_stream import CheckpointError, IncompatibleState, Loader, state_from_bytes, state_to_bytes
from zephon_stream.distributed import ToDevice, batch_digest


def digests(loader, n):
    return [batch_digest(b["input_ids"], b["slots"]) for b in itertools.islice(loader, n)]


def single_process(call, *args, **kwargs):
    with warnings.catch_warnings():  # DCP warns that no process group is initialized: that is the point
        warnings.filterwarnings("ignore", "torch.distributed is .*single process", UserWarning)
        return call(*args, no_dist=True, **kwargs)


def saved_at(config, steps, path):
    loader = Loader(config, dp_rank=0, dp_size=1)
    feed = ToDevice(loader, "cpu", ahead=1)
    for _ in itertools.islice(iter(feed), steps):
        pass
    single_process(dcp.save, {"loader": feed}, checkpoint_id=path)


def test_dcp_round_trip_is_the_continuation(stream_config, baseline, tmp_path):
    config = stream_config[0]
    saved_at(config, 6, tmp_path)
    loader = Loader(config, dp_rank=0, dp_size=1)
    single_process(dcp.load, {"loader": loader}, checkpoint_id=tmp_path)
    assert loader.step == 6
    assert digests(loader, 4) == baseline[6:10]


def test_dcp_refuses_another_config_clearly(stream_config, tmp_path):
    config = stream_config[0]
    saved_at(config, 3, tmp_path)
    for other in (config.replace(seed=99), config.replace(lanes=6), config.replace(global_batch_size=12)):
        with pytest.raises(IncompatibleState, match="another order config"):
            single_process(dcp.load, {"loader": Loader(other, dp_rank=0, dp_size=1)}, checkpoint_id=tmp_path)


def test_dcp_names_the_missing_lane_when_lanes_grow(stream_config, tmp_path):
    """A checkpoint of L = 12 lanes has no entry for lane 12: DCP's planner refuses before the loader
    sees the state, with a CheckpointException (a BaseException, not an Exception) naming the key."""
    saved_at(stream_config[0], 3, tmp_path)
    bigger = Loader(stream_config[0].replace(lanes=24), dp_rank=0, dp_size=1)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: loader.lane_0012"):
        single_process(dcp.load, {"loader": bigger}, checkpoint_id=tmp_path)


def test_saving_without_dcp_one_file_per_rank(stream_config, baseline, tmp_path):
    """The README's recipe: each of R ranks writes its own file; each of R' ranks reads them all."""
    config = stream_config[0]
    for rank in range(4):
        loader = Loader(config, dp_rank=rank, dp_size=4)
        for _ in itertools.islice(loader, 5):
            pass
        (tmp_path / f"loader-rank{rank:05d}.msgpack").write_bytes(state_to_bytes(loader.state_dict()))
    files = sorted(tmp_path.glob("loader-rank*.msgpack"))
    whole = Loader(config, dp_rank=0, dp_size=1)
    whole.load_state_dict([state_from_bytes(p.read_bytes()) for p in files])
    assert digests(whole, 3) == baseline[5:8]
    with pytest.raises(CheckpointError, match="pass every rank's state"):
        Loader(config, dp_rank=0, dp_size=3).load_state_dict(state_from_bytes(files[0].read_bytes()))
