"""The command line as a new user meets it: help, --version, refused numbers, --save-at, --save-state
alone and on Ctrl-C, inspect from a checkpoint, plain progress lines off a terminal, data that ends
before --steps, and the relay's and refit's edges."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zephon_stream import __version__
from zephon_stream.cli.main import build_parser, main
from zephon_stream.loader.config import Config, SourceConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def cfg(config: Config, tmp_path: Path) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml())
    return path


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """A mistake on the command line: exit 2 and one line on stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.count("\n") == 1 and "error: " in err and "Traceback" not in err, err
    return err


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and re.match(r"zephon (stream|inspect|config): error: ", err), err
    return err


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"zephon-stream {__version__}"


def _parsers(parser: argparse.ArgumentParser, name: str = "zephon") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out += _parsers(sub, f"{name} {sub_name}")
    return out


def test_every_option_has_help_text() -> None:
    missing = [f"{name} {action.option_strings or action.dest}"
               for name, parser in _parsers(build_parser()) for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and not action.help]
    assert not missing, f"options without help text: {missing}"


def test_help_says_steps_is_the_global_step_to_stop_at(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["stream", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "the global step to stop at" in out and "--resume from step 20, --steps 40 streams 20 more" in out


@pytest.mark.parametrize("argv", [["stream", "C", "--steps", "-1"], ["stream", "C", "--save-at", "-3"],
                                  ["inspect", "C", "--step", "-1"], ["stream", "C", "--dp-rank", "-1"],
                                  ["stream", "C", "--steps", "ten"]],
                         ids=["steps", "save-at", "inspect-step", "dp-rank", "not-a-number"])
def test_negative_or_malformed_numbers_refused(capsys, cfg, argv) -> None:
    argv = [str(cfg) if a == "C" else a for a in argv]
    err = _usage_error(capsys, argv)
    noun = "rank" if "--dp-rank" in argv else "step"  # the option's own word, not always "step"
    assert f"is negative: give a {noun} >= 0" in err or "is not a whole number" in err, err


def test_a_usage_error_is_one_line_in_every_command(capsys) -> None:
    assert "the following arguments are required" in _usage_error(capsys, ["stream"])
    assert "--to-endpoint must follow a --to" in _usage_error(capsys, ["relay", "--to-endpoint", "http://x:1"])


def test_save_at_past_steps_refused_before_any_work(capsys, cfg, tmp_path) -> None:
    err = _one_line_error(capsys, ["stream", str(cfg), "--steps", "3", "--save-at", "5",
                                   "--save-state", str(tmp_path / "s.state")])
    assert "--save-at 5 is past --steps 3" in err, err
    assert not (tmp_path / "s.state").exists()


def test_save_at_before_the_resumed_step_refused(capsys, cfg, tmp_path) -> None:
    saved = tmp_path / "s2.state"
    assert main(["stream", str(cfg), "--steps", "2", "--save-at", "2", "--save-state", str(saved), "--digests"]) == 0
    capsys.readouterr()
    err = _one_line_error(capsys, ["stream", str(cfg), "--steps", "4", "--resume", str(saved), "--save-at", "1",
                                   "--save-state", str(tmp_path / "again.state")])
    assert "--save-at 1 is before the resumed step 2" in err, err


def _digests(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict]:
    assert main(argv + ["--digests"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_save_state_alone_saves_where_the_stream_stops(capsys, cfg, tmp_path) -> None:
    saved = tmp_path / "end.state"
    whole = _digests(capsys, ["stream", str(cfg), "--steps", "5"])
    assert _digests(capsys, ["stream", str(cfg), "--steps", "3", "--save-state", str(saved)]) == whole[:3 * 24]
    assert _digests(capsys, ["stream", str(cfg), "--steps", "5", "--resume", str(saved)]) == whole[3 * 24:]
    err = _one_line_error(capsys, ["stream", str(cfg), "--steps", "2", "--resume", str(saved)])
    assert "--steps 2 is before the resumed step 3" in err, err
    err = _one_line_error(capsys, ["stream", str(cfg), "--save-at", "2"])
    assert "--save-at needs --save-state FILE" in err, err


def test_a_save_that_fails_keeps_the_state_it_resumed_from(capsys, cfg, tmp_path, monkeypatch) -> None:
    """`--resume F --save-state F` rolls one file forward. It was rewritten in place: a full
    disk during the write left F cut short, and the run's only checkpoint was gone."""
    saved = tmp_path / "rolling.state"
    _digests(capsys, ["stream", str(cfg), "--steps", "2", "--save-state", str(saved)])
    before = saved.read_bytes()

    real_open = io.open

    class FullDisk(io.FileIO):
        def write(self, data) -> int:
            raise OSError(28, "No space left on device")

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):  # a file opened for writing here takes nothing
        if "w" in mode and str(tmp_path) in os.fsdecode(file):
            return FullDisk(file, "w")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", open_on_a_full_disk)
    monkeypatch.setattr("builtins.open", open_on_a_full_disk)
    assert main(["stream", str(cfg), "--steps", "4", "--resume", str(saved), "--save-state", str(saved)]) != 0
    assert "No space left on device" in capsys.readouterr().err
    assert saved.read_bytes() == before
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    monkeypatch.undo()
    whole = _digests(capsys, ["stream", str(cfg), "--steps", "4"])
    assert _digests(capsys, ["stream", str(cfg), "--steps", "4", "--resume", str(saved)]) == whole[2 * 24:]


@pytest.mark.parametrize(("sent", "code", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                    (signal.SIGTERM, 143, "terminated \\(SIGTERM\\)"),
                                                    ("SIGTERM, SIGINT ignored", 143, "terminated \\(SIGTERM\\)")])
def test_ctrl_c_says_where_it_stopped_and_saves_the_state_there(cfg, tmp_path, capsys, sent, code, said) -> None:
    """The state saved on Ctrl-C is that of the last batch handed out: a resumed run goes on from it.
    So on SIGTERM, a scheduler's preemption (SLURM, Kubernetes): the process ended at once, no state.
    And so on SIGTERM to a shell script's background job, which starts with SIGINT ignored: the
    stream ignored the SIGTERM too and ran to its end (a trial's `zephon stream ... &`); a SIGINT
    there stays ignored."""
    saved = tmp_path / "ctrl-c.state"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    background = not isinstance(sent, signal.Signals)
    run = subprocess.Popen([sys.executable, "-m", "zephon_stream.cli", "stream", str(cfg), "--save-state", str(saved),
                            "--digests"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN if background
                                                            else signal.SIG_DFL))  # as `&` in a script, or not
    for _ in range(24 * 3):  # three batches out
        assert run.stdout.readline()
    if background:
        run.send_signal(signal.SIGINT)
        for _ in range(24 * 2):  # it goes on
            assert run.stdout.readline()
    run.send_signal(signal.SIGTERM if background else sent)
    _, err = run.communicate(timeout=120)
    assert run.returncode == code, err
    m = re.search(rf"zephon stream: {said} at global step (\d+); its state is in '.*ctrl-c.state' "
                  r"\(--resume it to go on\)\n$", err)
    assert m, err
    step = int(m.group(1))
    assert step >= 3
    whole = _digests(capsys, ["stream", str(cfg), "--steps", str(step + 2)])
    assert _digests(capsys, ["stream", str(cfg), "--steps", str(step + 2), "--resume", str(saved)]) == whole[step * 24:]


@pytest.mark.parametrize("terminated", [False, True])
def test_a_stop_before_the_first_batch_says_so(cfg, tmp_path, capsys, monkeypatch, terminated) -> None:
    """A SIGTERM (or Ctrl-C) while the stream starts (planning, a restore) exited 143 (130) with
    nothing on stderr: a trial's preemption 4 s after the start looked like a lost state file."""
    from zephon_stream.cli import main as cli

    def stopped_while_planning(*args, **kwargs):
        if terminated:
            cli._TERMINATED.append(15)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_TERMINATED", [])
    monkeypatch.setattr(cli, "_loader", stopped_while_planning)
    saved = tmp_path / "never.state"
    assert main(["stream", str(cfg), "--save-state", str(saved), "--digests"]) == (143 if terminated else 130)
    out, err = capsys.readouterr()
    said = "terminated (SIGTERM)" if terminated else "interrupted"
    assert err == f"zephon stream: {said} before its first batch was out: nothing was streamed; run it again as it " \
                  "was\n", err
    assert not out and not saved.exists()


def _interrupt_the_fourth_write(monkeypatch) -> None:
    """A Ctrl-C as `zephon stream` takes its fourth batch: after the loader handed it out, before
    its digest lines are written."""
    from zephon_stream.cli import main as cli

    real, calls = cli._write_digests, []

    def interrupted_at_the_fourth(batch, out, names):
        calls.append(batch["step"])
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(batch, out, names)

    monkeypatch.setattr(cli, "_write_digests", interrupted_at_the_fourth)


def test_a_second_ctrl_c_during_the_save_waits_for_the_state_and_its_line(cfg, tmp_path, capsys, monkeypatch) -> None:
    """A second Ctrl-C (or SIGTERM) while the first one's state was being saved cut the save: no
    state file, and the line said the stream stopped before its first batch (a review)."""
    from zephon_stream.cli import main as cli

    whole = _digests(capsys, ["stream", str(cfg), "--steps", "6"])
    real_save = cli._save_state

    def interrupted_again(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # as a second Ctrl-C lands at once
        real_save(*args, **kwargs)

    _interrupt_the_fourth_write(monkeypatch)
    monkeypatch.setattr(cli, "_save_state", interrupted_again)
    saved = tmp_path / "twice.state"
    assert main(["stream", str(cfg), "--steps", "6", "--save-state", str(saved), "--digests"]) == 130
    out, err = capsys.readouterr()
    assert err.endswith(f"zephon stream: interrupted at global step 3; its state is in {str(saved)!r} "
                        "(--resume it to go on)\n"), err
    assert "before its first batch" not in err
    monkeypatch.undo()
    assert _digests(capsys, ["stream", str(cfg), "--steps", "6", "--resume", str(saved)]) == whole[3 * 24:]


def test_ctrl_c_between_taking_a_batch_and_writing_its_lines_saves_the_state_before_it(cfg, tmp_path, capsys,
                                                                                      monkeypatch) -> None:
    """A Ctrl-C that lands after the loader handed a batch out and before its digest lines were
    written: the state was that after the batch, so the resumed run's lines skipped its step (2 of
    8 interrupts of a new-user trial: 14,376 lines where 14,400 were due)."""

    whole = _digests(capsys, ["stream", str(cfg), "--steps", "6"])
    _interrupt_the_fourth_write(monkeypatch)
    saved = tmp_path / "int.state"
    assert main(["stream", str(cfg), "--steps", "6", "--save-state", str(saved), "--digests"]) == 130
    out, err = capsys.readouterr()
    assert err.endswith(f"zephon stream: interrupted at global step 3; its state is in {str(saved)!r} "
                        "(--resume it to go on)\n"), err
    monkeypatch.undo()
    first = [json.loads(line) for line in out.splitlines()]
    assert first + _digests(capsys, ["stream", str(cfg), "--steps", "6", "--resume", str(saved)]) == whole


def test_an_error_mid_stream_saves_the_state_of_the_last_batch_handed_out(cfg, tmp_path, capsys, monkeypatch) -> None:
    """--save-state without --save-at, and the stream stops on an error (a store that stayed down):
    the state there is written, as on Ctrl-C, and the run resumes from it. Nothing was written."""
    from zephon_stream import ConnectorError
    from zephon_stream.cli import main as cli

    whole = _digests(capsys, ["stream", str(cfg), "--steps", "6"])
    real = cli._batches

    def three_then_down(loader, stop):  # the fourth batch's read fails, as the loader raises it
        batches = real(loader, stop)
        for _ in range(3):
            yield next(batches)
        batches.close()
        raise ConnectorError("GetObject s3://b/k failed: EndpointConnectionError after retries")

    monkeypatch.setattr(cli, "_batches", three_then_down)
    saved = tmp_path / "down.state"
    assert main(["stream", str(cfg), "--steps", "6", "--save-state", str(saved), "--digests"]) == 2
    err = capsys.readouterr().err
    assert err == (f"zephon stream: error: GetObject s3://b/k failed: EndpointConnectionError after retries; the "
                   f"stream stopped at global step 3, and its state is in {str(saved)!r} (--resume it once the cause "
                   "is fixed)\n")
    monkeypatch.undo()
    assert _digests(capsys, ["stream", str(cfg), "--steps", "6", "--resume", str(saved)]) == whole[3 * 24:]


def _group(pgid: int, needle: str) -> list[int]:
    """The pids of process group `pgid` whose command line holds `needle`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == pgid and needle.encode() in (
                    entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return found


def _ignores_sigint(pid: int) -> bool:
    ignored = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn"))
    return bool(int(ignored.split()[1], 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.parametrize("when", ["fork server starting", "workers streaming"])
def test_ctrl_c_in_a_terminal_stops_the_processes_backend_without_a_traceback(cfg, tmp_path, when) -> None:
    """A terminal's Ctrl-C signals the whole process group, the fork server and the workers too:
    each worker printed a KeyboardInterrupt traceback, and a fork server still importing died of
    it (a traceback, and the trainer's worker start failed)."""
    toml = tmp_path / "p.toml"
    toml.write_text(cfg.read_text().replace('backend = "threads"', 'backend = "processes"'))
    assert 'backend = "processes"' in toml.read_text()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen([sys.executable, "-m", "zephon_stream.cli", "stream", str(toml), "--digests"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    if when == "fork server starting":  # as soon as it exists, it is importing the workers' code; the
        # trainer's process ignores Ctrl-C for the few milliseconds of its spawn (see start_fork_server)
        while not (_group(run.pid, "forkserver") and not _ignores_sigint(run.pid)) and time.monotonic() < deadline:
            time.sleep(0.002)
    else:
        for _ in range(24 * 3):
            assert run.stdout.readline()
    os.killpg(run.pid, signal.SIGINT)
    try:
        _, err = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # killed here, or the next test fails too, of its leaked pipes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process outside the group may hold the pipes
            run.communicate(timeout=10)
        pytest.fail("zephon stream did not end within 60 s of the Ctrl-C")
    # 130, or killed by the SIGINT itself when it lands as the fork server starts (a shell shows 130
    # for both; why the interpreter exits by the signal there is not known)
    assert run.returncode in (130, -signal.SIGINT) and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert re.search(r"zephon stream: interrupted at global step \d+", err), err
    assert not _group(run.pid, "zephon") and not _group(run.pid, "forkserver")


@pytest.fixture()
def one_document(dataset, tmp_path: Path) -> Path:
    """A config over one short document, read once (max_epochs = 1): the data ends at step 1."""
    root, _ = dataset
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "d.jsonl").write_text('{"text": "the loader reads one short document"}\n')
    config = Config(seed=1, lanes=2, seq_len=16, global_batch_size=2, tokenizer=str(root / "tokenizer.json"),
                    max_epochs=1, sources=[SourceConfig(name="one", uri=f"file://{tmp_path}/one/")])
    path = tmp_path / "one.toml"
    path.write_text(config.to_toml())
    return path


def test_save_at_past_the_end_of_the_data_is_an_error(capsys, one_document, tmp_path) -> None:
    path = one_document
    err = _one_line_error(capsys, ["stream", str(path), "--save-at", "50", "--save-state", str(tmp_path / "s"),
                                   "--digests"])
    assert "the data ended at global step" in err and "before --save-at 50" in err, err
    assert not (tmp_path / "s").exists()


def test_data_that_ends_before_steps_says_so(capsys, one_document) -> None:
    path = one_document
    assert main(["stream", str(path), "--steps", "5"]) == 0  # the data's own end: not an error
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"zephon stream: the data ended at global step \d, before --steps 5 \(max_epochs = 1: "
                        r"every epoch read\)", last), last


def test_inspect_from_a_checkpoint_prints_the_same_batch(capsys, cfg, tmp_path) -> None:
    saved = tmp_path / "s.state"
    assert main(["stream", str(cfg), "--steps", "2", "--save-at", "2", "--save-state", str(saved), "--digests"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(cfg), "--step", "3"]) == 0
    full = capsys.readouterr().out
    assert main(["inspect", str(cfg), "--step", "3", "--resume", str(saved)]) == 0
    assert capsys.readouterr().out == full and full.startswith("# global batch 3:")
    err = _one_line_error(capsys, ["inspect", str(cfg), "--step", "1", "--resume", str(saved)])
    assert "--step 1 is before the resumed step 2" in err, err


def test_progress_off_a_terminal_is_plain_lines(capsys, cfg) -> None:
    assert main(["stream", str(cfg), "--steps", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout stays data
    assert "\r" not in captured.err and "\x1b" not in captured.err, captured.err
    lines = captured.err.splitlines()
    assert lines[-1].startswith("step 3/3 (100%)  elapsed ") and " tok/s (last 10 s)" in lines[-1]


def test_relay_text_log_keeps_the_fields(monkeypatch) -> None:
    from zephon_stream.cli.relay import _setup_logging

    root = logging.getLogger("zephon_stream")
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "propagate", root.propagate)
    monkeypatch.setattr(root, "level", root.level)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    _setup_logging("text", "INFO")
    logging.getLogger("zephon_stream.relay.node").info(
        "version relayed", extra={"event": "version_committed", "child": "file:///c/", "version": 7})
    line = err.getvalue()
    assert line.count("\n") == 1 and "INFO zephon_stream.relay.node: version relayed" in line, line
    assert "event=version_committed child=file:///c/ version=7" in line, line


def test_relay_from_a_missing_local_parent_warns(capsys, monkeypatch, tmp_path) -> None:
    """A relay may start before the first publish, so it runs; but a mistyped --from said only
    'relayed 0', and a daemon polled it for ever."""
    root = logging.getLogger("zephon_stream")
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "propagate", root.propagate)
    assert main(["relay", "--once", "--from", f"file://{tmp_path}/nope/", "--to", f"file://{tmp_path}/c/",
                 "--log-format", "text"]) == 0
    out, err = capsys.readouterr()
    assert out == f"file://{tmp_path}/c/: relayed 0 version(s) []; parent at 0\n"
    assert f"WARNING zephon_stream.relay.node: the parent file://{tmp_path}/nope/ does not exist (yet): nothing is " \
           "relayed until a publisher makes it; check --from if it should event=parent_missing" in err, err


def test_relay_without_a_parent_is_a_plain_error(capsys, monkeypatch) -> None:
    root = logging.getLogger("zephon_stream")
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "propagate", root.propagate)
    assert main(["relay", "--once", "--to", "memory://a/"]) == 2
    err = capsys.readouterr().err
    assert err == "zephon relay: error: a relay needs a parent (--from URI) and at least one child (--to URI)\n"
    for flag, value, said in (("--workers", "0", "workers=0 (must be >= 1)"), ("--keep-versions", "0",
                                                                           "keep_versions=0 (must be >= 1 (unset: "
                                                                           "the parent's retention))")):
        assert main(["relay", "--once", "--from", "memory://p/", "--to", "memory://a/", flag, value]) == 2
        assert capsys.readouterr().err == f"zephon relay: error: invalid relay settings: {said}\n"  # only the wrong one
    assert main(["relay", "--once", "--from", "memory://p/", "--to", "memory://a/", "--metrics-port", "9"]) == 2
    assert capsys.readouterr().err == ("zephon relay: error: --metrics-port serves a daemon's /metrics and /healthz; "
                                       "--once syncs once and serves nothing: leave out one of them\n")  # was ignored
    with pytest.raises(SystemExit) as usage:
        main(["relay", "--once", "--from", "memory://p/", "--to", "memory://a/", "--log-level", "LOUD"])
    assert usage.value.code == 2
    err = capsys.readouterr().err  # it was logging's ValueError traceback
    assert err == ("zephon relay: error: argument --log-level: invalid choice: 'LOUD' (choose from 'DEBUG', 'INFO', "
                   "'WARNING', 'ERROR') (see zephon relay --help)\n"), err


def test_relay_metrics_on_a_port_in_use_is_one_error(tmp_path) -> None:
    """It was a traceback of an exception group (an OSError in the daemon's task group)."""
    import socket

    (tmp_path / "parent").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "zephon_stream.cli", "relay", "--from",
                              (tmp_path / "parent").as_uri() + "/", "--to", (tmp_path / "child").as_uri() + "/",
                              "--metrics-port", str(port), "--log-format", "text"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert f"metrics on 127.0.0.1:{port}: cannot listen there (Address already in use)" in run.stderr, run.stderr


def test_refit_publish_creates_a_missing_file_prefix(capsys, tmp_path) -> None:
    import torch

    from zephon_stream.refit import safetensors

    weights = tmp_path / "w.safetensors"
    safetensors.save(weights, {"w": torch.arange(16, dtype=torch.float32).reshape(4, 4)})
    prefix = tmp_path / "not" / "yet" / "there"
    assert main(["refit", "publish", "--prefix", f"file://{prefix}/", "--weights", str(weights)]) == 0
    assert capsys.readouterr().out.startswith("version 1 ")
    assert prefix.is_dir() and any(prefix.rglob("MANIFEST*"))


def test_inspect_labels_each_document_with_its_source(capsys, cfg, config) -> None:
    assert main(["inspect", str(cfg), "--step", "0"]) == 0
    out = capsys.readouterr().out
    slots = out.split("\n## slot ")[1:]
    assert len(slots) == config.global_batch_size
    labels = [re.findall(r"⟦([^⟧]*)⟧", s) for s in slots]
    assert all(found and s.split("\n", 1)[1].startswith("⟦") for found, s in zip(labels, slots))
    assert {name for found in labels for name in found} == {s.name for s in config.sources}


def test_a_config_flag_says_the_config_is_positional(capsys, cfg) -> None:
    def usage_error(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1, err
        return err
    err = usage_error(["stream", "--config", str(cfg)])
    assert "unrecognized arguments: --config; the config file is given by itself: zephon stream CONFIG.toml" in err
    assert "given by itself" not in usage_error(["stream", str(cfg), "--confg"])
    # an unknown argument is the subcommand's, not `zephon`'s (it said "zephon: error: ... see zephon --help")
    assert usage_error(["refit", "status", "--prefix", "memory://x/", "--json"]) == (
        "zephon refit status: error: unrecognized arguments: --json (see zephon refit status --help)\n")
    assert usage_error(["refit", "pull", "--prefx", "memory://x/", "--weights", "w.safetensors"]) == (
        "zephon refit pull: error: the following arguments are required: --prefix; --prefx is not one of its options "
        "(did you mean --prefix?) (see zephon refit pull --help)\n")  # it named --prefix alone
    assert usage_error(["stream", str(cfg), "--steps", "1", "extra"]).startswith(
        "zephon stream: error: unrecognized arguments: extra (see zephon stream --help)")


def test_with_digests_stdout_holds_the_lines_alone(cfg, capsys, monkeypatch) -> None:
    """Ray printed its notice of a worker that died ('(raylet) A worker died ...') on stdout, among
    the digest lines: they were no longer JSON lines. Anything else the process prints goes to stderr."""
    from zephon_stream.cli import main as cli

    real = cli._batches

    def noisy(loader, stop):
        for batch in real(loader, stop):
            print("(raylet) A worker died or was killed while executing a task")  # as a library's thread does
            yield batch

    monkeypatch.setattr(cli, "_batches", noisy)
    assert main(["stream", str(cfg), "--steps", "2", "--digests"]) == 0
    out, err = capsys.readouterr()
    assert len([json.loads(line) for line in out.splitlines()]) == 2 * 24
    assert err.count("(raylet) A worker died") == 2
    print("after")
    assert capsys.readouterr().out == "after\n"  # stdout is back
