"""`zephon refit publish|pull|status` on safetensors files and a file:// prefix."""

from __future__ import annotations

import argparse
import struct

import pytest
import torch

from tests.refit._helpers import assert_same, model, step
from zephon_stream import DataError
from zephon_stream.cli.refit import add_subparser
from zephon_stream.refit import safetensors


def zephon(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="zephon")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_safetensors_roundtrip_every_dtype(tmp_path) -> None:
    state = {str(d): torch.arange(6).to(d).reshape(2, 3) for d in
             (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}
    state["empty"] = torch.zeros(0, 4)
    safetensors.save(tmp_path / "w.safetensors", state, {"step": "3"})
    assert_same(state, dict(safetensors.load(tmp_path / "w.safetensors")))


@pytest.mark.parametrize("bad", [b"", struct.pack("<Q", 1 << 40), struct.pack("<Q", 4) + b"[1]\n",
                                 struct.pack("<Q", 56) + b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,99]}}'])
def test_bad_safetensors_refused(tmp_path, bad: bytes) -> None:
    (tmp_path / "bad.safetensors").write_bytes(bad)
    with pytest.raises(DataError):
        safetensors.load(tmp_path / "bad.safetensors")


def test_cli_publish_pull_status(tmp_path, capsys) -> None:
    prefix = f"file://{tmp_path}/store/"
    (tmp_path / "store").mkdir()
    trainer, rollout = tmp_path / "trainer.safetensors", tmp_path / "rollout.safetensors"
    states = [model(21)]
    for s in range(1, 4):
        states.append(step(states[-1], 30 + s))
    safetensors.save(rollout, {k: torch.zeros_like(v) for k, v in states[0].items()})
    digests = []
    for v, state in enumerate(states, 1):
        safetensors.save(trainer, state)
        assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(trainer), "--keyframe-every", "2") == 0
        out = capsys.readouterr().out.split()
        assert out[:2] == ["version", str(v)]
        digests.append(out[3])
        if v != 2:  # the rollout side skips a version: it catches up with one compacted delta
            assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(rollout)) == 0
            assert capsys.readouterr().out.split() == ["version", str(v), "digest", digests[-1]]
            assert_same(state, dict(safetensors.load(rollout)))
    assert zephon("refit", "status", "--prefix", prefix) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "latest 4" and len(lines) == 2 + 4
    assert [ln.split()[2] for ln in lines[2:]] == ["yes", "no", "yes", "no"]
    assert zephon("refit", "pull", "--prefix", f"file://{tmp_path}/nope/", "--weights", str(rollout)) == 1
