"""`zephon relay` from the command line: flags, config files, --once, and what it never prints."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import anyio
import pytest

from tests.relay._helpers import assert_same, model, snapshot, step, zeros_like
from zephon_stream import ConfigError
from zephon_stream.cli.relay import add_subparser, load_config
from zephon_stream.refit import Publisher, Subscriber


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zephon")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["relay", *argv])


def test_endpoint_options_follow_their_prefix() -> None:
    args = parse("--from", "s3://t/p/", "--from-endpoint", "http://127.0.0.1:1", "--to", "s3://a/p/",
                 "--to-endpoint", "http://127.0.0.1:2", "--to-region", "eu-west-1", "--to", "s3://b/p/",
                 "--to-profile", "b", "--poll-interval", "0.5", "--metrics-port", "9464")
    cfg = load_config(args)
    assert cfg.parent is not None and cfg.parent.endpoint_url == "http://127.0.0.1:1"
    assert [(c.uri, c.endpoint_url, c.region, c.profile) for c in cfg.to] == [
        ("s3://a/p/", "http://127.0.0.1:2", "eu-west-1", None), ("s3://b/p/", None, None, "b")]
    assert (cfg.poll_interval, cfg.metrics_port) == (0.5, 9464)


def test_a_negative_grace_is_refused() -> None:
    """--grace -1 was taken (while --poll-interval 0 and --workers 0 are refused)."""
    with pytest.raises(ConfigError, match=r"grace=-1.0: give the seconds a running sync may take to finish"):
        load_config(parse("--from", "s3://t/p/", "--to", "s3://a/p/", "--grace", "-1"))


def test_option_before_its_prefix_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("--to-endpoint", "http://x:1", "--to", "s3://a/")
    assert "--to-endpoint must follow a --to" in capsys.readouterr().err


def test_an_option_given_twice_or_to_a_local_prefix_is_refused(tmp_path, capsys, monkeypatch) -> None:
    """The second --to-endpoint of one --to won silently, and an endpoint of a file:// prefix was
    dropped without a word; a plain folder path was 'unsupported URI scheme', where refit --prefix
    takes one."""
    with pytest.raises(SystemExit):
        parse("--from", "s3://t/p/", "--to", "s3://a/", "--to-endpoint", "http://x:1", "--to-endpoint", "http://y:2")
    assert "--to-endpoint given twice for s3://a/" in capsys.readouterr().err
    cfg = load_config(parse("--from", "s3://t/p/", "--to", f"file://{tmp_path}/a/", "--to-endpoint", "http://x:1"))
    with pytest.raises(ConfigError, match=rf"file://{tmp_path}/a/: endpoint_url is for s3:// prefixes only"):
        cfg.to[0].prefix()
    monkeypatch.chdir(tmp_path)
    cfg = load_config(parse("--from", "root", "--to", "child"))
    assert (cfg.parent.uri, cfg.to[0].uri) == (f"file://{tmp_path}/root/", f"file://{tmp_path}/child/")


def test_config_file_with_credentials_from_env(tmp_path, monkeypatch) -> None:
    (tmp_path / "r.toml").write_text(
        'poll_interval = 0.25\n[from]\nuri = "s3://t/p/"\nendpoint_url = "http://127.0.0.1:1"\n'
        'access_key_id_env = "K"\nsecret_access_key_env = "S"\n[from.options]\nmax_in_flight = 8\n'
        '[[to]]\nuri = "s3://a/p/"\n')
    monkeypatch.setenv("K", "key-id")
    monkeypatch.setenv("S", "very-secret")
    cfg = load_config(parse("--config", str(tmp_path / "r.toml"), "--to", "s3://b/p/"))
    assert [c.uri for c in cfg.to] == ["s3://a/p/", "s3://b/p/"] and cfg.poll_interval == 0.25
    parent = cfg.parent.prefix()
    assert parent.options["secret_access_key"] == "very-secret" and parent.options["max_in_flight"] == 8
    assert "very-secret" not in repr(parent) and "very-secret" not in parent.name
    monkeypatch.delenv("S")
    with pytest.raises(ConfigError, match=r"\$S, which is not set"):
        load_config(parse("--config", str(tmp_path / "r.toml"))).parent.prefix()
    (tmp_path / "bad.toml").write_text('[from]\nuri = "s3://t/"\nendpoint = "x"\n')
    with pytest.raises(ConfigError, match="endpoint"):
        load_config(parse("--config", str(tmp_path / "bad.toml"), "--to", "s3://a/"))


@pytest.mark.parametrize(("text", "hint"), [
    ('[form]\nuri = "s3://t/"\n', "unknown field `form`; did you mean `from`?"),
    ('[[to]]\nuri = "s3://a/"\nprofil = "x"\n', "`profil` - at `$.to[0]`; did you mean `profile`?"),
    ('[[to]]\nuri = "s3://a/"\npoll_interval = 3\n',
     "`poll_interval` is a top-level key: put it above the first [table]"),
    ('[[to]]\nuri = "s3://a/"\npoll_intervall = 3\n',
     "did you mean `poll_interval`? It is a top-level key: put it above the first [table]"),
    ('[[to]]\nuri = "s3://a/"\nxyzzy = 3\n', "unknown field `xyzzy` - at `$.to[0]`"),
])
def test_a_misspelt_or_misplaced_key_names_the_one_meant(tmp_path, text: str, hint: str) -> None:
    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(parse("--config", str(tmp_path / "r.toml"), "--from", "s3://t/", "--to", "s3://b/"))
    assert str(err.value).endswith(hint), err.value


def test_workers_and_its_deprecated_spellings(tmp_path, capsys, caplog) -> None:
    assert load_config(parse("--from", "s3://t/", "--to", "s3://a/", "--workers", "3")).workers == 3
    assert load_config(parse("--from", "s3://t/", "--to", "s3://a/")).workers == 8
    assert capsys.readouterr().err == ""
    args = parse("--from", "s3://t/", "--to", "s3://a/", "--lanes", "5")  # the old flag: still works, warns
    assert load_config(args).workers == 5
    assert capsys.readouterr().err == "zephon: warning: --lanes is deprecated, use --workers\n"
    help_text = _help()
    assert "--workers N" in help_text and "--lanes" not in help_text
    (tmp_path / "old.toml").write_text('lanes = 6\n[from]\nuri = "s3://t/"\n[[to]]\nuri = "s3://a/"\n')
    with caplog.at_level(logging.WARNING, logger="zephon_stream"):
        assert load_config(parse("--config", str(tmp_path / "old.toml"))).workers == 6
        assert load_config(parse("--config", str(tmp_path / "old.toml"), "--workers", "2")).workers == 2
    assert "the relay setting `lanes` is deprecated, use `workers`" in caplog.text
    (tmp_path / "both.toml").write_text('lanes = 6\nworkers = 2\n[from]\nuri = "s3://t/"\n[[to]]\nuri = "s3://a/"\n')
    with pytest.raises(ConfigError, match="give `workers` alone"):
        load_config(parse("--config", str(tmp_path / "both.toml")))


def _help() -> str:
    return add_subparser(argparse.ArgumentParser(prog="zephon").add_subparsers()).format_help()


def test_once_over_file_prefixes(tmp_path: Path, capsys) -> None:
    for d in ("root", "a", "b"):
        (tmp_path / d).mkdir()
    w = model(3)

    async def publish() -> dict:
        async with Publisher(f"file://{tmp_path}/root/", chunk_bytes=256, keyframe_every=2) as pub:
            nonlocal w
            for v in (1, 2, 3):
                w = step(w, v)
                await pub.publish(w)
        return snapshot(w)

    final = anyio.run(publish)
    args = parse("--from", f"file://{tmp_path}/root/", "--to", f"file://{tmp_path}/a/", "--to",
                 f"file://{tmp_path}/b/", "--once")
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert f"file://{tmp_path}/b/: relayed 3 version(s) [1, 2, 3]; parent at 3" in out
    assert '"event": "version_committed"' in err
    assert args.func(args) == 0  # nothing pending: a no-op
    assert "relayed 0 version(s)" in capsys.readouterr().out

    async def pull() -> dict:
        replica = zeros_like(w)
        async with Subscriber(f"file://{tmp_path}/b/") as sub:
            assert await sub.pull(replica) == 3
        return replica

    assert_same(final, anyio.run(pull))


@pytest.mark.s3
def test_rejected_credentials_never_printed(regions, tmp_path, capsys) -> None:
    trainer, child = regions("trainer", proxy=False), regions("child")
    secret = trainer.options["secret_access_key"]
    (tmp_path / "r.toml").write_text(
        f'[from]\nuri = "{trainer.uri("p/")}"\nendpoint_url = "{trainer.options["endpoint_url"]}"\n'
        f'access_key_id = "{trainer.options["access_key_id"]}"\nsecret_access_key = "{secret}"\n'
        f'[[to]]\nuri = "{child.uri("p/")}"\nendpoint_url = "{child.options["endpoint_url"]}"\n'
        f'access_key_id = "{child.options["access_key_id"]}"\nsecret_access_key = "wrong-{secret}"\n')

    async def publish() -> None:
        store, key = trainer.open("p/")
        async with store, Publisher(key, store=store, chunk_bytes=256) as pub:
            await pub.publish(model(4))

    anyio.run(publish)
    args = parse("--config", str(tmp_path / "r.toml"), "--once")
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert "credentials were rejected" in err
    assert secret not in out + err


@pytest.mark.s3
@pytest.mark.parametrize("missing", ["child", "parent"])
def test_a_daemon_whose_bucket_does_not_exist_exits(regions, tmp_path: Path, missing: str) -> None:
    """A bucket that does not exist is a wrong name, endpoint or region: the daemon's first sync
    raises it and the process exits 2 (it retried with backoff for ever), and `--once` exits 2 as
    for any mistake. A prefix that does not exist yet is no mistake: see the local parent's warning."""
    import os
    import subprocess
    import sys

    region = regions("r", proxy=False)
    endpoint, gone = region.options["endpoint_url"], "s3://zr-no-such-bucket/p/"
    (tmp_path / "root").mkdir()
    src, dst = (f"file://{tmp_path}/root/", gone) if missing == "child" else (gone, region.uri("p/"))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": region.options["access_key_id"],
           "AWS_SECRET_ACCESS_KEY": region.options["secret_access_key"]}
    cmd = [sys.executable, "-m", "zephon_stream.cli", "relay", "--from", src, "--to", dst, "--to-endpoint", endpoint,
           "--poll-interval", "0.1", "--log-format", "text"]
    if missing == "parent":  # else the parent is a local folder
        cmd += ["--from-endpoint", endpoint]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert got.returncode == 2, got.stderr
    assert got.stderr.count("bucket 'zr-no-such-bucket' does not exist") == 1, got.stderr
    assert "exiting on the error above" in got.stderr and "event=fatal" in got.stderr
    once = subprocess.run([*cmd, "--once"], capture_output=True, text=True, timeout=60, env=env)
    assert once.returncode == 2, once.stderr
    assert "zephon relay: error: " in once.stderr and "bucket 'zr-no-such-bucket' does not exist" in once.stderr


def test_a_daemon_started_misconfigured_exits(tmp_path: Path) -> None:
    """A child's profile that no AWS file holds cannot mend by retrying: the daemon's first sync
    raises it and the process exits 2, instead of running unhealthy and logging it forever."""
    import os
    import subprocess
    import sys

    (tmp_path / "root").mkdir()
    (tmp_path / "aws-config").write_text("[profile region-a]\nregion = us-east-1\n")
    env = {**os.environ, "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials")}
    got = subprocess.run(
        [sys.executable, "-m", "zephon_stream.cli", "relay", "--from", f"file://{tmp_path}/root/",
         "--to", "s3://bucket/p/", "--to-endpoint", "http://127.0.0.1:9", "--to-profile", "region-b",
         "--poll-interval", "0.1", "--log-format", "text"],
        capture_output=True, text=True, timeout=60, env=env)
    assert got.returncode == 2, got.stderr
    assert "AWS profile 'region-b'" in got.stderr and "kind=config" in got.stderr
    assert "event=fatal" in got.stderr
    assert got.stderr.count("AWS profile 'region-b'") == 1, got.stderr  # logged once, then "exiting on the error above"
    once = subprocess.run([*got.args, "--once"], capture_output=True, text=True, timeout=60, env=env)
    assert once.returncode == 2, once.stderr  # a mistake, as in every command: not 1, a failed copy
    assert "zephon relay: error: AWS profile 'region-b'" in once.stderr
