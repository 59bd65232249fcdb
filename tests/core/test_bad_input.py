"""Bad input through the whole loader: a clear error naming the object and offset, or a counted skip."""

from __future__ import annotations

import msgspec
import pytest
import zstandard

from zephon_stream import DataError
from zephon_stream._core.config import SourceConfig
from zephon_stream._loader import Loader

GOOD = b"".join(msgspec.json.encode({"text": f"good document number {i} " * 5}) + b"\n" for i in range(40))

CASES = {
    "malformed": ("x.jsonl", GOOD + b'{"text": "unterminated\n' + GOOD, r"'x.jsonl' at byte \d+: (JSON is malformed|Input data was truncated)"),
    "utf8": ("x.jsonl", GOOD + b'{"text": "bad \xff byte"}\n' + GOOD, r"'x.jsonl' at byte \d+: Invalid UTF-8"),
    "missing_field": ("x.jsonl", GOOD + b'{"body": "no text"}\n' + GOOD,
                      r"'x.jsonl' at byte \d+: Object missing required field `text`"),
    "empty_shard": ("x.jsonl", b"", r"empty shard 'x.jsonl' \(0 bytes\)"),
    "truncated_zst": ("x.jsonl.zst", zstandard.ZstdCompressor().compress(GOOD * 4)[:-9],
                      r"truncated .zst shard 'x.jsonl.zst': frame at byte 0"),
}


def _config(config, tmp_path, name, data):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a-good.jsonl").write_bytes(GOOD)
    (bad / name).write_bytes(data)
    return config.replace(sources=[SourceConfig(name="bad", uri=f"file://{bad}/")], lanes=2,
                          global_batch_size=2, shuffle_window=4, max_epochs=1)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_error_names_object_and_offset(config, tmp_path, case, backend):
    name, data, pattern = CASES[case]
    cfg = _config(config, tmp_path, name, data)
    with pytest.raises(DataError, match=pattern):
        list(Loader(cfg, backend=backend))


@pytest.mark.parametrize("case", sorted(CASES))
def test_skip_policy_is_deterministic_and_counted(config, tmp_path, case):
    name, data, _ = CASES[case]
    cfg = _config(config, tmp_path, name, data).replace(on_bad_record="skip")
    runs = []
    for backend in ("inline", "threads"):
        loader = Loader(cfg, backend=backend)
        runs.append([b["input_ids"].tolist() for b in loader])
        stats = loader.statistics()
        skipped = stats.skipped_records + stats.skipped_shards
        assert skipped == 1, stats
    assert runs[0] == runs[1]
