"""A user mistake on the command line or in the config is one line on stderr and exit status 2."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import msgspec
import pytest

from zephon_stream import ConfigError, Loader
from zephon_stream.cli.main import main
from zephon_stream.loader.config import Config, SourceConfig


@pytest.fixture()
def toml(config: Config, tmp_path: Path):
    """Write the test config with some lines changed (`key = value`, top level or in every source)."""
    def write(name: str = "c.toml", **changes: str) -> Path:
        text = config.to_toml()
        for key, value in changes.items():
            line = f"{key} = {value}"
            text, n = re.subn(rf"(?m)^{key} = .*$", line, text)
            if not n and key in SourceConfig.__struct_fields__:  # unset: add it to every source
                text = text.replace("[[sources]]\n", f"[[sources]]\n{line}\n")
            elif not n:  # a setting left at its default: add it at the top level
                text = line + "\n" + text
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert re.match(r"zephon (stream|inspect|config): error: ", err), err  # the subcommand named, as shard's
    return err


@pytest.mark.parametrize("command", [["stream"], ["inspect", "--step", "0"], ["config"]])
def test_missing_or_directory_config(capsys, tmp_path, command) -> None:
    for path, why in [(tmp_path / "nope.toml", "No such file"), (tmp_path, "Is a directory")]:
        err = _one_line_error(capsys, [command[0], str(path), *command[1:]])
        assert str(path) in err and why in err, err


def test_resume_from_a_missing_file_or_a_directory(capsys, toml, tmp_path) -> None:
    cfg = toml()
    for path, why in [(tmp_path / "nope.state", "No such file"), (tmp_path, "Is a directory")]:
        err = _one_line_error(capsys, ["stream", str(cfg), "--steps", "1", "--resume", str(path)])
        assert f"--resume {str(path)!r}" in err and why in err, err


def test_save_state_into_a_missing_directory_or_onto_one(capsys, toml, tmp_path) -> None:
    cfg = toml()
    err = _one_line_error(capsys, ["stream", str(cfg), "--steps", "1", "--save-at", "1",
                                   "--save-state", str(tmp_path / "no" / "dir" / "s.state")])
    assert "does not exist; create it first" in err, err
    err = _one_line_error(capsys, ["stream", str(cfg), "--steps", "1", "--save-at", "1",
                                   "--save-state", str(tmp_path)])
    assert "is a directory" in err, err


def test_a_file_that_is_not_a_state(capsys, toml, tmp_path) -> None:
    bad = tmp_path / "bad.state"
    bad.write_bytes(b"\x93\x01\x02")
    err = _one_line_error(capsys, ["stream", str(toml()), "--steps", "1", "--resume", str(bad)])
    assert f"--resume {str(bad)!r}: not a zephon-stream state file" in err, err  # of several files, which one


def test_a_model_directory_names_its_tokenizer_json(capsys, config, toml, tmp_path) -> None:
    """A Hugging Face model directory holds tokenizer.json: naming the directory was 'Is a directory'."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(config.tokenizer, model / "tokenizer.json")
    assert main(["stream", str(toml(tokenizer=f'"{config.tokenizer}"')), "--steps", "2", "--digests"]) == 0
    want = capsys.readouterr().out
    assert main(["stream", str(toml("d.toml", tokenizer=f'"{model}"')), "--steps", "2", "--digests"]) == 0
    assert capsys.readouterr().out == want
    assert Loader(config.replace(tokenizer=str(model))).order_digest == Loader(config).order_digest
    err = _one_line_error(capsys, ["stream", str(toml(tokenizer=f'"{tmp_path}"')), "--steps", "1"])
    assert f"tokenizer {str(tmp_path)!r} is a directory with no tokenizer.json in it" in err, err


@pytest.mark.parametrize("content", [b"", b"{}", b"not json", b'{"version": "1.0"}'],
                         ids=["empty", "empty-object", "not-json", "other-json"])
def test_an_empty_or_foreign_tokenizer_file(capsys, toml, tmp_path, content) -> None:
    tok = tmp_path / "tok.json"
    tok.write_bytes(content)
    err = _one_line_error(capsys, ["stream", str(toml(tokenizer=f'"{tok}"')), "--steps", "1"])
    assert f"tokenizer {str(tok)!r} is not a tokenizer.json file" in err, err


BAD_SETTINGS = [
    ({"pad_token_id": "300"}, "pad_token_id = 300: outside the vocabulary"),  # the test vocabulary has 300 ids
    ({"pad_token_id": "-3"}, "pad_token_id = -3"),
    ({"seed": str(1 << 64)}, "seed = 18446744073709551616: must be in [0, 2**64)"),
    ({"seed": "-1"}, "seed = -1: must be in [0, 2**64)"),
    ({"endpoint_url": '"not a url"'}, "endpoint_url = 'not a url': is not a URL"),
    ({"endpoint_url": '"http://host:port"'}, "is not a URL"),
    ({"read_timeout": "0"}, "read_timeout = 0.0: must be in (0, 3600]"),
    ({"connect_timeout": "-1"}, "connect_timeout = -1.0"),
    ({"lanes": "100000000"}, "lanes = 100000000: must be in [1, 4096]"),
    ({"seq_len": "100000000000"}, "seq_len = 100000000000: must be in [2, 16777216]"),
    ({"global_batch_size": "100000000000"}, "global_batch_size = 100000000000"),
    ({"global_batch_size": "1048560", "seq_len": "16777216"}, "tokens per batch"),
    ({"max_record_bytes": "0"}, "max_record_bytes = 0: must be >= 1"),
    ({"max_record_bytes": "-5"}, "max_record_bytes = -5"),
    ({"stall_warning_s": "-1"}, "stall_warning_s = -1.0: must be 0 (never warn) or a number of seconds >= 0.1"),
    ({"stall_warning_s": "0.0001"}, "stall_warning_s = 0.0001: must be 0 (never warn) or a number"),
    ({"stall_warning_s": "nan"}, "stall_warning_s = nan"),
    ({"shufle_window": "8"}, "unknown field `shufle_window`; did you mean `shuffle_window`?"),
    ({"xyzzy": "8"}, "unknown field `xyzzy`\n"),  # nothing close: no guess
    # a value not among the choices: the choices, and the closest (msgspec names the value only)
    ({"packing": '"bestfit"'}, 'at `$.packing`; packing is one of "concat", "best_fit", "none" (did you mean '
                               '"best_fit"?)\n'),
    ({"loss_on": '"assistants"'}, 'loss_on is one of "assistant", "last_assistant", "all" (did you mean '
                                  '"assistant"?)\n'),
    ({"backend": '"gpu"'}, 'backend is one of "inline", "threads", "processes", "ray"\n'),
]


@pytest.mark.parametrize("changes, needle", BAD_SETTINGS, ids=[n for n, _ in enumerate(BAD_SETTINGS)])
def test_a_bad_setting(capsys, toml, changes, needle) -> None:
    path = toml(**changes)
    for argv in (["stream", str(path), "--steps", "1"], ["config", str(path)]):
        if argv[0] == "config" and "vocabulary" in needle:
            continue  # the vocabulary is known once the tokenizer is loaded, not by `zephon config`
        err = _one_line_error(capsys, argv)
        assert needle in err, err


def test_a_top_level_key_below_a_table_says_so(capsys, toml) -> None:
    path = toml()
    path.write_text(path.read_text() + "\nshuffle_window = 4\n")  # TOML: a key of the last [[sources]]
    err = _one_line_error(capsys, ["config", str(path)])
    assert err.endswith("unknown field `shuffle_window` - at `$.sources[1]`; `shuffle_window` is a top-level key: "
                        "put it above the first [table]\n"), err


def test_a_table_where_an_array_of_tables_belongs_says_so(capsys, toml) -> None:
    path = toml()
    text = path.read_text()
    path.write_text(text[:text.index("[[sources]]")] + text[text.index("[[sources]]"):].split("\n\n")[0]
                    .replace("[[sources]]", "[sources]"))  # one source, written as a table
    err = _one_line_error(capsys, ["config", str(path)])
    assert err.endswith("at `$.sources`; write [[sources]] (an array of tables, one per entry), not [sources]\n"), err


@pytest.mark.parametrize("table, typo, key", [
    ("[[sources]]", "txt_field", "text_field"),
    ("[vision]", "min_pixel", "min_pixels"),
    ("[[schedule]]", "stpe", "step"),
])
def test_a_misspelt_key_in_a_table_names_the_key_of_that_table(capsys, toml, table, typo, key) -> None:
    path = toml()
    text = path.read_text()
    text = text.replace(table, f"{table}\n{typo} = 1", 1) if table in text else f"{text}\n{table}\n{typo} = 1\n"
    path.write_text(text)
    err = _one_line_error(capsys, ["config", str(path)])
    assert f"unknown field `{typo}`" in err and err.endswith(f"; did you mean `{key}`?\n"), err


def test_source_settings_are_checked_when_built_in_python() -> None:
    with pytest.raises(ConfigError, match=r"sources\[s\]\.endpoint_url = 'not a url'"):
        SourceConfig(name="s", uri="s3://b/", endpoint_url="not a url")
    with pytest.raises(ConfigError, match=r"sources\[s\]\.read_timeout = 0"):
        SourceConfig(name="s", uri="s3://b/", read_timeout=0)


def test_settings_of_the_wrong_type_in_python_are_config_errors(config) -> None:
    # msgspec checks types when it decodes a TOML file, not when a Struct is made in Python: a string
    # seq_len was a TypeError from the first comparison
    with pytest.raises(ConfigError, match=r"config seq_len = '64': must be a whole number, not str"):
        config.replace(seq_len="64")
    with pytest.raises(ConfigError, match=r"config shuffle_window = True: must be a whole number, not bool"):
        config.replace(shuffle_window=True)
    with pytest.raises(ConfigError, match=r"config sources\[s\]\.weight = '2': must be a number, not str"):
        SourceConfig(name="s", uri="s3://b/", weight="2")
    import numpy as np

    same = config.replace(seed=np.int64(config.seed), tokenizer=Path(config.tokenizer),
                          sources=[msgspec.structs.replace(s, weight=np.float64(s.weight)) for s in config.sources])
    assert same == config and type(same.seed) is int and type(same.tokenizer) is str  # numpy's and a Path: taken
    assert Loader(same).order_digest == Loader(config).order_digest


def test_running_out_of_memory_is_one_line(capsys, toml, monkeypatch) -> None:
    from zephon_stream.loader import loader as _loader

    def no_memory(self):  # what numpy raises when a config asks for more than the machine has
        raise MemoryError
        yield

    monkeypatch.setattr(_loader.Loader, "__iter__", no_memory)
    err = _one_line_error(capsys, ["stream", str(toml()), "--steps", "1"])
    assert "out of memory" in err and "seq_len" in err, err


def test_a_good_run_still_works(capsys, toml, tmp_path) -> None:
    saved = tmp_path / "s.state"
    assert main(["stream", str(toml()), "--steps", "2", "--save-at", "1", "--save-state", str(saved),
                 "--digests"]) == 0
    assert main(["stream", str(toml()), "--steps", "2", "--resume", str(saved), "--digests"]) == 0
    capsys.readouterr()
