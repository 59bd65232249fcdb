"""`zephon refit publish|pull|status` on safetensors files and a file:// prefix."""

from __future__ import annotations

import argparse
import json
import os
import re
import struct

import pytest
import torch

from tests.refit._helpers import assert_same, model, step
from zephon_stream import ConfigError, DataError
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


def _mxfp4(seed: int) -> dict[str, torch.Tensor]:
    """An MXFP4 layer as checkpoints hold it: FP4 values two a byte, an E8M0 scale per 32 values."""
    g = torch.Generator().manual_seed(seed)
    raw = lambda *shape: torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)  # noqa: E731
    return {"mlp.blocks": raw(64, 16).view(torch.float4_e2m1fn_x2), "mlp.scales": raw(64, 1).view(torch.float8_e8m0fnu),
            "norm": torch.randn(64, generator=g).to(torch.float8_e4m3fnuz), "b": raw(8).view(torch.float8_e5m2fnuz)}


def test_safetensors_files_of_mx_formats_read_and_write_as_the_library_does(tmp_path) -> None:
    """F4 (shape in FP4 values: the last dim twice torch's float4_e2m1fn_x2), F8_E8M0 and the FNUZ
    float8s: a file the `safetensors` library wrote loads, and a file saved here loads there with
    the same header entries."""
    library = pytest.importorskip("safetensors.torch")
    state = _mxfp4(1)
    (tmp_path / "lib.safetensors").write_bytes(library.save(state))
    assert_same(state, dict(safetensors.load(tmp_path / "lib.safetensors")))
    safetensors.save(tmp_path / "ours.safetensors", state)
    def entries(data: bytes) -> dict[str, tuple[str, list[int]]]:
        n = struct.unpack("<Q", data[:8])[0]
        return {k: (v["dtype"], v["shape"]) for k, v in json.loads(data[8:8 + n]).items()}
    ours = entries((tmp_path / "ours.safetensors").read_bytes())
    assert ours == entries(library.save(state)) and ours["mlp.blocks"] == ("F4", [64, 32])
    with pytest.raises(ConfigError, match="0-dim torch.float4_e2m1fn_x2: .* reshape it to"):
        safetensors.save(tmp_path / "x.safetensors", {"x": torch.zeros((), dtype=torch.uint8).view(
            torch.float4_e2m1fn_x2)})
    odd = library.save({"x": torch.zeros(3, dtype=torch.uint8)}).replace(b'"U8","shape":[3]', b'"F4","shape":[3]')
    (tmp_path / "odd.safetensors").write_bytes(odd)
    with pytest.raises(DataError, match=r"is F4 of shape \[3\]: its last dim must be a multiple of 2"):
        safetensors.load(tmp_path / "odd.safetensors")


def test_cli_publishes_and_pulls_an_mxfp4_checkpoint(tmp_path, capsys) -> None:
    prefix = f"file://{tmp_path}/store/"
    (tmp_path / "store").mkdir()
    trainer, rollout = tmp_path / "trainer.safetensors", tmp_path / "rollout.safetensors"
    for v, seed in enumerate((1, 2), 1):
        safetensors.save(trainer, _mxfp4(seed))
        assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(trainer)) == 0
        assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(rollout)) == 0  # made on the first pull
        pulled = capsys.readouterr().out.splitlines()[-1].split()
        assert pulled[:3] == ["version", str(v), "digest"] and ("(created" in pulled) == (v == 1)
        assert_same(_mxfp4(seed), dict(safetensors.load(rollout)))


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


def test_a_new_weights_file_on_a_full_disk_is_an_error_not_a_sigbus(tmp_path, capsys, monkeypatch) -> None:
    """`zephon refit pull` into a new file on a full disk: the sparse file was created and the first
    write through its memory map killed the process (SIGBUS, exit 135, no message)."""
    import errno
    import os

    prefix = f"file://{tmp_path}/store/"
    (tmp_path / "store").mkdir()
    safetensors.save(tmp_path / "trainer.safetensors", model(3))
    assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(tmp_path / "trainer.safetensors")) == 0
    capsys.readouterr()
    reserved = []

    def full(fd, offset, size):
        reserved.append(size)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    new = tmp_path / "new.safetensors"
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(new)) == 1
    assert "cannot be written (No space left on device)" in capsys.readouterr().err
    assert reserved and reserved[0] > sum(t.numel() * t.element_size() for t in model(3).values())
    monkeypatch.undo()
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(new)) == 0  # space again
    assert_same(model(3), dict(safetensors.load(new)))


def test_a_file_that_is_not_safetensors_and_a_changed_layout_say_what_to_do(tmp_path, capsys) -> None:
    (tmp_path / "model.py").write_text("import torch\nprint('a training script, not weights')\n")
    prefix = f"file://{tmp_path}/store/"
    assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(tmp_path / "model.py")) == 2
    assert "model.py: not a safetensors file? Its first 8 bytes give a header length of" in capsys.readouterr().err
    rollout = tmp_path / "rollout.safetensors"
    safetensors.save(tmp_path / "t.safetensors", model(5))
    assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(tmp_path / "t.safetensors")) == 0
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(rollout)) == 0
    grown = {**model(5), "w1": torch.zeros(20, 24, dtype=torch.bfloat16)}  # the trainer's model grew
    safetensors.save(tmp_path / "t.safetensors", grown)
    assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(tmp_path / "t.safetensors")) == 0
    capsys.readouterr()
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(rollout)) == 2
    err = capsys.readouterr().err
    assert "expected torch.bfloat16 (20, 24)" in err and (
        f"if the published model's layout changed (names, shapes, dtypes), delete {rollout} and its record "
        f"{rollout}.refit to pull the new layout whole") in err, err
    rollout.unlink()
    (tmp_path / "rollout.safetensors.refit").unlink()
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(rollout)) == 0
    assert_same(grown, dict(safetensors.load(rollout)))


def test_an_interrupted_pull_or_publish_says_so(tmp_path, capsys, monkeypatch) -> None:
    """Ctrl-C exited 130 with nothing said (a trial), where `zephon stream` says where it stopped.
    (asyncio's runner turns SIGINT into KeyboardInterrupt out of `anyio.run`: simulated there.)"""
    import zephon_stream.cli.refit as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    prefix = f"file://{tmp_path}/store/"
    safetensors.save(tmp_path / "t.safetensors", model(6))
    monkeypatch.setattr(cli.anyio, "run", interrupted)
    for command, says in [("pull", "weights pulled in place may be part-way to the version"),
                          ("publish", "a version is visible once whole or not at all")]:
        with pytest.raises(KeyboardInterrupt):  # `zephon`'s main turns it into exit status 130
            zephon("refit", command, "--prefix", prefix, "--weights", str(tmp_path / "t.safetensors"))
        assert f"zephon refit {command}: interrupted; {says}" in capsys.readouterr().err


def test_a_long_publish_or_pull_says_how_far_it_is(tmp_path, capsys, monkeypatch) -> None:
    """A 200 MB model took 5-6 s of silence each way; a multi-GB one, minutes."""
    import zephon_stream.cli.refit as cli

    monkeypatch.setattr(cli, "PROGRESS_S", 0.001)
    prefix = f"file://{tmp_path}/store/"
    safetensors.save(tmp_path / "t.safetensors", model(6))
    assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(tmp_path / "t.safetensors")) == 0
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(tmp_path / "r.safetensors")) == 0
    err = capsys.readouterr().err.splitlines()
    # a publish reads the version it builds on first: both counted (it said "0.0 MB written" meanwhile)
    assert any(re.fullmatch(r"zephon refit publish: [\d,]+\.\d MB read, [\d,]+\.\d MB written in \d+ s", e)
               for e in err), err
    assert any(re.fullmatch(r"zephon refit pull: [\d,]+\.\d MB read in \d+ s", e) for e in err), err
    monkeypatch.setattr(cli, "PROGRESS_S", 60.0)
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(tmp_path / "r.safetensors")) == 0
    assert capsys.readouterr().err == ""  # a short one says nothing


def test_s3_options_are_flags_for_an_s3_prefix_only(tmp_path, capsys, monkeypatch) -> None:
    """`zephon refit` had no --endpoint-url: a SeaweedFS or MinIO prefix failed with
    'GetObject s3://.../LATEST at AWS failed: EndpointConnectionError', with no hint of
    AWS_ENDPOINT_URL. Without a server: an endpoint that refuses connections is the one used."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.setenv(var, "unset-by-the-test")  # restored after: the CLI sets them in its process
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.delenv("AWS_PROFILE")
    assert zephon("refit", "status", "--prefix", str(tmp_path), "--endpoint-url", "http://127.0.0.1:9") == 2
    assert f"--endpoint-url is for s3:// prefixes; --prefix {tmp_path.as_uri()}/ takes none" in capsys.readouterr().err
    assert zephon("refit", "status", "--prefix", "s3://bkt/p/", "--endpoint-url", "http://127.0.0.1:9",
                  "--region", "eu-west-1") == 1
    assert "s3://bkt/p/LATEST at http://127.0.0.1:9" in capsys.readouterr().err
    assert os.environ["AWS_REGION"] == "eu-west-1"
