"""Bad input through the whole loader: a clear error naming the object and offset, or a counted skip."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import zstandard

from zephon_stream import DataError
from zephon_stream.loader.config import SourceConfig
from zephon_stream.loader.loader import Loader

GOOD = b"".join(msgspec.json.encode({"text": f"good document number {i} " * 5}) + b"\n" for i in range(40))
MAX_RECORD = 1 << 18  # above the nested record (200 kB), below the long ones


def _corrupt_frame_shard() -> bytes:
    """Three zstd frames of whole lines; the middle one's checksum is wrong."""
    c = zstandard.ZstdCompressor(write_checksum=True)
    frames = [c.compress(GOOD), c.compress(b'{"text": "in the corrupt frame"}\n'), c.compress(GOOD)]
    frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 0xFF])
    return b"".join(frames)


CASES = {
    "malformed": ("x.jsonl", GOOD + b'{"text": "unterminated\n' + GOOD,
                  r"'x.jsonl' at byte \d+: (JSON is malformed|Input data was truncated)"),
    "utf8": ("x.jsonl", GOOD + b'{"text": "bad \xff byte"}\n' + GOOD, r"'x.jsonl' at byte \d+: Invalid UTF-8"),
    "missing_field": ("x.jsonl", GOOD + b'{"body": "no text"}\n' + GOOD,
                      r"'x.jsonl' at byte \d+: Object missing required field `text`; the record's fields are 'body'"),
    "empty_shard": ("x.jsonl", b"", r"empty shard 'x.jsonl' \(0 bytes\)"),
    "truncated_zst": ("x.jsonl.zst", zstandard.ZstdCompressor().compress(GOOD * 4)[:-9],
                      r"truncated .zst shard 'x.jsonl.zst': frame at byte 0"),
    "corrupt_frame": ("x.jsonl.zst", _corrupt_frame_shard(),
                      r"corrupt zstd frame in 'x.jsonl.zst' at compressed byte \d+: .*checksum"),
    "too_long": ("x.jsonl", GOOD + msgspec.json.encode({"text": "x" * MAX_RECORD}) + b"\n" + GOOD,
                 rf"record at byte \d+ of 'x.jsonl' is longer than max_record_bytes={MAX_RECORD}"),
    "nested": ("x.jsonl", GOOD + b'{"meta": ' + b"[" * 100_000 + b"]" * 100_000 + b', "text": "a"}\n' + GOOD,
               r"'x.jsonl' at byte \d+: it nests JSON arrays or objects more than 512 deep"),
    "bom": ("x.jsonl", b"\xef\xbb\xbf" + GOOD, r"'x.jsonl' at byte 0: .*UTF-8 byte order mark"),
    "cr_only": ("x.jsonl", GOOD.replace(b"\n", b"\r"), r"'x.jsonl' at byte 0: .*CR-only line endings"),
    "cr_only_long": ("x.jsonl", (GOOD * 60).replace(b"\n", b"\r"),
                     (r"record at byte 0 of 'x.jsonl' is longer than max_record_bytes=\d+; it holds \d+ carriage "
                      r"returns .*CR-only line endings")),
    "surrogate": ("x.jsonl", GOOD + b'{"text": "lone \\ud800"}\n' + GOOD,
                  r"'x.jsonl' at byte \d+: .*lone UTF-16 surrogate escape \\ud800"),
}


def _config(config, tmp_path, name, data):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a-good.jsonl").write_bytes(GOOD)
    (bad / name).write_bytes(data)
    return config.replace(sources=[SourceConfig(name="bad", uri=f"file://{bad}/")], lanes=2,
                          global_batch_size=2, shuffle_window=4, max_epochs=1, max_record_bytes=MAX_RECORD)


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


@pytest.mark.parametrize("backend", ["inline", "threads", "processes"])
def test_a_bad_record_counts_once_per_epoch_and_names_it(config, tmp_path, backend):
    """Two epochs read the bad record once each: 2 skipped, one in epoch 0 and one in epoch 1."""
    name, data, _ = CASES["malformed"]
    cfg = _config(config, tmp_path, name, data).replace(on_bad_record="skip", max_epochs=2)
    loader = Loader(cfg, backend=backend)
    for _ in loader:
        pass
    stats = loader.statistics()
    assert stats.skipped_by_epoch == {0: 1, 1: 1} and stats.skipped_records == 2, stats


async def _first_batch(cfg, backend="threads"):
    with anyio.fail_after(60):  # before the fix: 100% CPU, no batch, no error, forever
        async with Loader(cfg, backend=backend).open() as stream:
            return await stream.__anext__()


@pytest.mark.parametrize(("backend", "max_epochs"), [("inline", 0), ("threads", 0), ("processes", 0),
                                                   ("inline", 1), ("processes", 1)])
def test_a_source_with_no_document_is_an_error_not_a_spin(config, tmp_path, backend, max_epochs):
    """Every record skipped (a mistyped text_field). With `max_epochs = 1` a lane reads a position or
    two of the source, never a run of them: the source was left out in silence, the other one
    standing in for it in every batch."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_bytes(GOOD * 3)
    (bad / "b.jsonl").write_bytes(GOOD)
    src = SourceConfig(name="typo", uri=f"file://{bad}/", text_field="txet")
    cfg = config.replace(sources=[config.sources[0], src], on_bad_record="skip", max_epochs=max_epochs)
    with pytest.raises(DataError, match=r"source 'typo' \(file://.*\) yields no document in a whole epoch of its "
                                        r"\d+ splits, .*: all 160 of its records are bad and skipped .*the first: "
                                        r"bad record in 'a.jsonl' at byte 0: Object missing required field `txet`; "
                                        r"the record's fields are 'text'"):
        anyio.run(_first_batch, cfg, backend)


def test_a_source_of_blank_lines_is_an_error_not_a_spin(config, tmp_path):
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.jsonl").write_bytes(b"\n \n\t\n" * 5000)
    cfg = config.replace(sources=[SourceConfig(name="blank", uri=f"file://{blank}/")], max_epochs=0)
    with pytest.raises(DataError, match=r"source 'blank' .* yields no document .*: its shards hold nothing but "
                                        r"blank lines"):
        anyio.run(_first_batch, cfg)


@pytest.mark.parametrize("max_epochs", [0, 1])
def test_lanes_whose_splits_are_blank_do_not_fail_a_source_that_has_documents(config, tmp_path, max_epochs):
    """Most splits blank, one with documents: lanes read runs of empty splits (or, in one epoch, end
    their share with them), check, and go on."""
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    (sparse / "a.jsonl").write_bytes(b"\n" * 200_000)
    (sparse / "b.jsonl").write_bytes(GOOD * (1 if max_epochs == 0 else 40))
    cfg = config.replace(sources=[SourceConfig(name="sparse", uri=f"file://{sparse}/")], max_epochs=max_epochs,
                         global_batch_size=12, split_bytes=4096)

    async def batches():
        loader = Loader(cfg, backend="threads")
        with anyio.fail_after(120):
            async with loader.open() as stream:
                for _ in range(6):
                    batch = await stream.__anext__()
                    assert (batch["num_tokens"] > 0).all()
        return loader.statistics()
    stats = anyio.run(batches)
    assert stats.skipped_records == 0


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_an_error_names_its_source_when_shards_share_names(config, tmp_path, backend):
    """`zephon shard` names every output shard-00000.jsonl.zst: a bad record's or a bad shard's error
    names the source first, or two sources' shards cannot be told apart."""
    for name in ("web", "code"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard-00000.jsonl").write_bytes(GOOD)
    (tmp_path / "code" / "shard-00000.jsonl").write_bytes(GOOD + b'{"text": broken\n')
    srcs = [SourceConfig(name=n, uri=f"file://{tmp_path}/{n}/") for n in ("web", "code")]
    cfg = config.replace(sources=srcs, max_epochs=1)
    with pytest.raises(DataError, match=rf"^source 'code' \(file://{tmp_path}/code/\): bad record in "
                                        r"'shard-00000.jsonl' at byte \d+: "):
        for _ in Loader(cfg, backend=backend):
            pass
    (tmp_path / "web" / "shard-00001.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=rf"^source 'web' \(file://{tmp_path}/web/\): empty shard 'shard-00001.jsonl'"):
        next(iter(Loader(cfg, backend=backend)))
