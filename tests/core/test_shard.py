"""`zephon shard` and `zephon_stream.shard.shard`: every input kind into seekable JSONL.zst (or tar)
shards that give back the same documents, in order, split for lanes; errors name the object."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zephon_stream import ConfigError, DataError, ZephonError
from zephon_stream.cli.main import main
from zephon_stream.connectors import open_store
from zephon_stream.formats.jsonl_zst import read_seek_table
from zephon_stream.loader.config import SourceConfig
from zephon_stream.shard import ShardReport, _Progress, shard
from zephon_stream.testing.determinism import real, run_world


def _lines(paths) -> list[bytes]:
    out = []
    for p in sorted(paths):
        with open(p, "rb") as fh:
            out += zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True).read().splitlines()
    return out


def _texts(out_dir) -> list[str]:
    return [json.loads(line)["text"] for line in _lines(out_dir.glob("*.jsonl.zst"))]


def _frames(path) -> list[int] | None:
    async def main():
        store, _ = open_store(f"file://{path.parent}/")
        async with store:
            return await read_seek_table(store, path.name, path.stat().st_size)
    return anyio.run(main)


@pytest.mark.parametrize("kind", ["jsonl", "gzip", "parquet"])
def test_inputs_become_seekable_shards_of_the_same_documents(kind, dataset, gzip_dataset, parquet_dataset, tmp_path):
    root, docs = dataset
    src = {"jsonl": root, "gzip": gzip_dataset, "parquet": parquet_dataset}[kind] / "a"
    report = shard(str(src), str(tmp_path / "out"), target_bytes=6000, frame_bytes=1500, progress=False)
    assert isinstance(report, ShardReport) and report.documents == 600 and report.inputs == 3
    paths = sorted((tmp_path / "out").glob("shard-*.jsonl.zst"))
    assert [p.name for p in paths] == [f"shard-{i:05d}.jsonl.zst" for i in range(len(report.shards))]
    assert len(paths) > 2 and _texts(tmp_path / "out") == docs["a"]
    sizes = [p.stat().st_size for p in paths]
    assert max(sizes[:-1]) < 6000 + 1500 and min(sizes[:-1]) >= 6000  # cut at the first frame past the target
    assert all(len(_frames(p)) > 3 for p in paths[:-1])  # seek table: several frames, so several splits


def test_jsonl_lines_are_kept_as_they_are(dataset, tmp_path):
    root, _ = dataset
    shard(f"file://{root}/b/", f"file://{tmp_path}/out/", progress=False)
    want = []
    for i in range(2):
        with open(root / "b" / f"b-{i}.jsonl.zst", "rb") as fh:
            want += zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True).read().splitlines()
    assert _lines((tmp_path / "out").glob("*.zst")) == want  # every field, byte for byte


def test_the_loader_reads_the_shards_with_many_lanes(config, gzip_dataset, tmp_path):
    """A single-member .json.gz file is one split; sharded, the same documents spread over lanes."""
    report = shard(str(gzip_dataset / "b"), str(tmp_path / "b"), target_bytes=4000, frame_bytes=500, progress=False)
    assert report.documents == 300
    cfg = config.replace(sources=[config.sources[0], SourceConfig(name="b", uri=f"file://{tmp_path}/b/", weight=0.4)])
    one, _ = run_world(cfg, 1, 6, backend="inline")
    assert real(run_world(cfg, 3, 6, backend="threads")[0]) == real(one)

    from zephon_stream.loader.plan import plan_data

    async def splits():
        store, _ = open_store(f"file://{tmp_path}/b/")
        async with store:
            return len((await plan_data(cfg.replace(sources=cfg.sources[1:]), [store])).sources[0].splits)
    assert anyio.run(splits) >= cfg.lanes


def test_text_folder_one_document_per_file(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    texts = {"in/x.txt": "first\nfile", "in/sub/y.md": "# second", "in/z.txt": "third ✓"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "in" / "skip.bin").write_bytes(b"\x00")
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    rows = [json.loads(line) for line in _lines((tmp_path / "out").glob("*.zst"))]
    assert report.documents == 3 and [r["text"] for r in rows] == ["# second", "first\nfile", "third ✓"]
    assert [r["id"] for r in rows] == ["sub/y.md", "x.txt", "z.txt"]


def test_json_files_of_lines_or_of_one_array_become_shards(tmp_path):
    """`.json` as datasets ship it: JSON lines, or one array of records (Alpaca's, pretty-printed,
    maybe after a BOM). Records keep every field, each as one compact line, in file order."""
    records = [{"instruction": f"say {i}", "text": f"line {i}\nwith a newline ✓", "n": [i, {"k": None}]}
               for i in range(30)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a-lines.json").write_text("".join(json.dumps(r) + "\n" for r in records[:10]))
    (tmp_path / "in" / "b-pretty.json").write_bytes(b"\xef\xbb\xbf\n" + json.dumps(records[10:20], indent=4).encode())
    (tmp_path / "in" / "c-compact.json").write_text(json.dumps(records[20:], ensure_ascii=False))
    (tmp_path / "in" / "d-empty.json").write_text(" [ ] ")
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), frame_bytes=300, progress=False)
    assert (report.inputs, report.documents, report.skipped) == (4, 30, 0)
    assert [json.loads(line) for line in _lines((tmp_path / "out").glob("*.zst"))] == records
    # beside JSON lines or Parquet, a .json file is not data (a dataset_info.json): not read
    (tmp_path / "in" / "e.jsonl").write_text(json.dumps({"text": "only me"}) + "\n")
    report = shard(str(tmp_path / "in"), str(tmp_path / "out2"), progress=False)
    assert report.inputs == 1 and _texts(tmp_path / "out2") == ["only me"]


def _write_arrow(path, table, stream: bool = True, batch: int = 7) -> None:
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
        for b in table.to_batches(max_chunksize=batch):
            writer.write_batch(b)
        writer.close()


def test_a_save_to_disk_folder_of_arrow_files_becomes_shards(tmp_path):
    """Hugging Face datasets' save_to_disk: data-*.arrow (IPC streams) beside dataset_info.json and
    state.json. Rows are read as Parquet's are (a dotted text field, chat conversations); the JSON
    metadata is not input; a DatasetDict's top folder is refused with its splits named."""
    ds = tmp_path / "ds"
    ds.mkdir()
    texts = [f"row {i} ✓\nline" for i in range(40)]
    table = pa.table({"meta": [{"text": t} for t in texts], "n": list(range(40))})
    _write_arrow(ds / "data-00000-of-00002.arrow", table.slice(0, 25))
    _write_arrow(ds / "data-00001-of-00002.arrow", table.slice(25), stream=False)  # the IPC file format too
    (ds / "dataset_info.json").write_text(json.dumps({"features": {}}, indent=2))
    (ds / "state.json").write_text(json.dumps({"_data_files": []}, indent=2))
    report = shard(str(ds), str(tmp_path / "out"), text_field="meta.text", progress=False)
    assert (report.inputs, report.documents) == (2, 40) and _texts(tmp_path / "out") == texts

    conversations = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                     for i in range(10)]
    (tmp_path / "chat").mkdir()
    _write_arrow(tmp_path / "chat" / "data-00000-of-00001.arrow", pa.table({"messages": conversations}))
    shard(str(tmp_path / "chat"), str(tmp_path / "chat-out"), messages_field="messages", progress=False)
    assert [json.loads(line)["messages"] for line in _lines((tmp_path / "chat-out").glob("*.zst"))] == conversations

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match=r"'x.arrow' is not an Arrow IPC stream or file"):
        shard(str(tmp_path / "bad"), str(tmp_path / "bad-out"), progress=False)
    whole = (ds / "data-00000-of-00002.arrow").read_bytes()
    (tmp_path / "bad" / "x.arrow").write_bytes(whole[:len(whole) * 2 // 3])
    with pytest.raises(DataError, match=r"'x.arrow' is damaged after row 14"):
        shard(str(tmp_path / "bad"), str(tmp_path / "bad-out2"), text_field="meta.text", progress=False)
    with pytest.raises(DataError, match=r"has no column 'text' \(its columns: meta, n\)"):
        shard(str(ds), str(tmp_path / "o3"), progress=False)

    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "test").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    for split in ("train", "test"):
        _write_arrow(tmp_path / "dd" / split / "data-00000-of-00001.arrow", pa.table({"text": ["x"]}))
    with pytest.raises(ConfigError, match=r"Hugging Face DatasetDict .*: shard one split's folder \(test, train\)"):
        shard(str(tmp_path / "dd"), str(tmp_path / "o4"), progress=False)
    assert shard(str(tmp_path / "dd" / "train"), str(tmp_path / "o5"), progress=False).documents == 1


def _arrow_bytes(stream: bool) -> bytes:
    sink = pa.BufferOutputStream()
    table = pa.table({"text": [f"row {i} ✓" for i in range(30)], "meta": [{"n": i} for i in range(30)]})
    writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
    for b in table.to_batches(max_chunksize=7):
        writer.write_batch(b)
    writer.close()
    return sink.getvalue().to_pybytes()


_ARROW = {True: _arrow_bytes(True), False: _arrow_bytes(False)}


@settings(max_examples=120, deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 1 << 20))
def test_a_damaged_arrow_file_gives_its_rows_or_one_line_data_error(stream, edits, cut) -> None:
    """Bytes changed anywhere in an Arrow stream or file, and the file cut short: rows come out
    (never more than written), or one DataError line; never a pyarrow traceback."""
    data = bytearray(_ARROW[stream])
    for i, b in edits:
        data[i % len(data)] = b
    _shard_damaged("x.arrow", bytes(data[:cut % (len(data) + 1)] if cut % 3 == 0 else data), 30)


def _shard_damaged(name: str, data: bytes, most: int) -> None:
    """Shard one damaged input: at most `most` documents come out, or one ZephonError line."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "in").mkdir()
        (Path(tmp) / "in" / name).write_bytes(data)
        try:
            report = shard(str(Path(tmp) / "in"), str(Path(tmp) / "out"), progress=False)
        except ZephonError as exc:
            assert "\n" not in str(exc), str(exc)
            return
        assert report.documents <= most


_JSON_ARRAY = json.dumps([{"text": f"row {i} ✓", "n": [i, {"k": None}]} for i in range(12)], indent=2).encode()


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_JSON_ARRAY) - 1), st.sampled_from(b'[]{}",:\\ \nax0\xff')),
                min_size=1, max_size=6), st.integers(0, len(_JSON_ARRAY)))
def test_a_damaged_json_array_gives_its_records_or_one_line_data_error(edits, cut) -> None:
    data = bytearray(_JSON_ARRAY)
    for i, b in edits:
        data[i] = b
    _shard_damaged("x.json", bytes(data[:cut] if cut else data), 12)


_CSV_ROWS = [{"id": "1", "text": "hello, world\nsecond line", "n": "3"}, {"id": "2", "text": "123", "n": "x"},
             {"id": "3", "text": 'she said "hi" ✓', "n": ""}, {"id": "4", "text": "NA", "n": "n"},
             {"id": "5", "text": "", "n": "e"}]


def _csv(rows: list[dict[str, str]], delimiter: str = ",") -> bytes:
    import csv

    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), delimiter=delimiter)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def test_csv_and_tsv_rows_become_documents_as_written(tmp_path):
    """Quoted values with newlines, delimiters and quotes; text that looks like a number or a null
    is kept as a string; a BOM before the header is not part of its first name."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_bytes(b"\xef\xbb\xbf" + _csv(_CSV_ROWS))
    (tmp_path / "in" / "b.tsv").write_bytes(_csv(_CSV_ROWS, "\t"))
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    assert (report.inputs, report.documents, report.skipped) == (2, 10, 0)
    assert _texts(tmp_path / "out") == [r["text"] for r in _CSV_ROWS] * 2
    report = shard(str(tmp_path / "in" / "a.csv"), str(tmp_path / "out2"), text_field="n", progress=False)
    assert _texts(tmp_path / "out2") == [r["n"] for r in _CSV_ROWS]
    with pytest.raises(DataError, match=r"CSV file 'a.csv' has no column 'body' \(its columns: id, text, n\)"):
        shard(str(tmp_path / "in" / "a.csv"), str(tmp_path / "out3"), text_field="body", progress=False)
    with pytest.raises(ConfigError, match=r"holds \*.csv \*.tsv \*.csv.gz \*.tsv.gz files, which hold no conver"):
        shard(str(tmp_path / "in"), str(tmp_path / "out4"), messages_field="messages", progress=False)


def test_a_semicolon_csv_names_the_delimiter_to_pass(tmp_path, capsys):
    """Spreadsheets in many locales export CSV with ';' between values."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_bytes(_csv(_CSV_ROWS, ";"))
    assert main(["shard", str(tmp_path / "in"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "CSV file 'a.csv' has one column, 'id;text;n', and no 'text': its header seems separated by ';'; pass " \
           "--delimiter ';'" in err, err
    assert err.count("\n") == 1, err  # the error alone: no progress line before it
    assert main(["shard", str(tmp_path / "in"), str(tmp_path / "out2"), "--delimiter", ";"]) == 0
    assert _texts(tmp_path / "out2") == [r["text"] for r in _CSV_ROWS]
    with pytest.raises(ConfigError, match=r"delimiter '\"' must be one character, not a quote"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), delimiter='"', progress=False)
    (tmp_path / "tsv").mkdir()
    (tmp_path / "tsv" / "a.tsv").write_bytes(_csv(_CSV_ROWS, "\t"))
    assert main(["shard", str(tmp_path / "tsv"), str(tmp_path / "out5"), "--delimiter", ","]) == 2
    err = capsys.readouterr().err
    assert "its header seems separated by '\\t'; pass --delimiter '\\t'" in err, err
    assert main(["shard", str(tmp_path / "tsv"), str(tmp_path / "out5"), "--delimiter", "\\t"]) == 0  # as pasted
    assert _texts(tmp_path / "out5") == [r["text"] for r in _CSV_ROWS]


def test_gzipped_csv_of_one_or_more_members_and_its_bounds(tmp_path, monkeypatch):
    import gzip

    import zephon_stream.shard as shard_module

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv.gz").write_bytes(gzip.compress(_csv(_CSV_ROWS)))
    rows = _csv(_CSV_ROWS, "\t")
    cut = rows.index(b"\n3\t")  # two members, cut inside the rows: one TSV once inflated
    (tmp_path / "in" / "b.tsv.gz").write_bytes(gzip.compress(rows[:cut]) + gzip.compress(rows[cut:]) + b"\0" * 9)
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    assert (report.inputs, report.documents) == (2, 10)
    assert _texts(tmp_path / "out") == [r["text"] for r in _CSV_ROWS] * 2
    data = (tmp_path / "in" / "a.csv.gz").read_bytes()
    (tmp_path / "in" / "a.csv.gz").write_bytes(data[:-12])
    with pytest.raises(DataError, match=r"'a.csv.gz' does not decompress: it is cut short"):
        shard(str(tmp_path / "in"), str(tmp_path / "out2"), progress=False)
    (tmp_path / "in" / "a.csv.gz").write_bytes(gzip.compress(_csv(_CSV_ROWS * 50)))  # 4.5 kB in 0.2 kB
    monkeypatch.setattr(shard_module, "_ARRAY_MAX", 1000)  # a bomb, in small: inflated past the bound
    monkeypatch.setattr(shard_module, "_INFLATE_RATIO", 2)
    with pytest.raises(DataError, match=r"'a.csv.gz' does not decompress: it inflates to more than 1000 bytes \(4 "
                                        r"GiB, or 2 times its size if more\): a decompression bomb\? If not, gunzip"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), progress=False)
    monkeypatch.setattr(shard_module, "_INFLATE_RATIO", 100)  # the bound grows with the file: 20 kB here
    assert shard(str(tmp_path / "in"), str(tmp_path / "out4"), progress=False).documents == 5 * 50 + 5


def test_a_csv_file_streams_through_in_parts(tmp_path, monkeypatch):
    """A CSV file is read in parts into a checked temporary file, which is parsed a block at a
    time: no file is read whole (it was, up to 4 GiB, and its text held again as a str)."""
    import gzip

    import zephon_stream.shard as shard_module

    monkeypatch.setattr(shard_module, "_CSV_PART", 7)  # parts cut rows, characters and gzip members
    rows = [{"id": str(i), "text": f"caf\u00e9 {i}\n\u20ac"} for i in range(40)]
    data = b"id,text\n" + b"".join(f'{r["id"]},"{r["text"]}"\n'.encode() for r in rows)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_bytes(data)
    (tmp_path / "in" / "b.csv.gz").write_bytes(gzip.compress(data[:50]) + gzip.compress(data[50:]) + b"\0" * 20)
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    assert report.documents == 80 and _texts(tmp_path / "out") == [r["text"] for r in rows] * 2
    (tmp_path / "in" / "b.csv.gz").write_bytes(gzip.compress(data) + b"\0" * 9 + b"x")
    with pytest.raises(DataError, match=r"'b.csv.gz' does not decompress: bytes after the zeros that pad its last"):
        shard(str(tmp_path / "in"), str(tmp_path / "out2"), progress=False)
    (tmp_path / "in" / "b.csv.gz").unlink()
    (tmp_path / "in" / "a.csv").write_bytes(data.replace(b"caf\xc3\xa9 30", b"caf\xe9 30"))  # Latin-1
    at = data.index(b"caf\xc3\xa9 30") + 3
    with pytest.raises(DataError, match=rf"CSV file 'a.csv' is not UTF-8: byte {at} is 0xe9; the file is not read"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), progress=False)


def test_a_csv_spool_that_fails_says_where_and_what_to_set(tmp_path, monkeypatch, capsys):
    """The temporary file a CSV file is copied into is on TMPDIR's disk: a full disk is one line
    naming the file, the folder and TMPDIR, not an OSError traceback."""
    import errno

    import zephon_stream.shard as shard_module

    def full(self, piece, final=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_bytes(_csv(_CSV_ROWS))
    monkeypatch.setattr(shard_module._Utf8Check, "feed", full)
    assert main(["shard", str(tmp_path / "in"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"zephon shard copies CSV file 'a.csv' into a temporary file in \S+ to parse it, and that "
                     r"failed: No space left on device; set TMPDIR to a disk with room for the file", err), err


def test_a_csv_spool_has_no_name_in_tmpdir(tmp_path, monkeypatch):
    """The temporary file is unlinked as it is made: a `zephon shard` killed while it parses a CSV
    file (a spool of gigabytes) leaves nothing in TMPDIR, and neither does one that ends."""
    import tempfile

    import zephon_stream.shard as shard_module

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    seen = []
    rows = shard_module._Job._csv_rows

    def listing(self, *args, **kwargs):
        seen.append(sorted(p.name for p in (tmp_path / "tmp").iterdir()))  # the spool is written: rows are next
        return rows(self, *args, **kwargs)

    monkeypatch.setattr(shard_module._Job, "_csv_rows", listing)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_bytes(_csv(_CSV_ROWS))
    assert shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False).documents == len(_CSV_ROWS)
    assert seen == [[]] and not any((tmp_path / "tmp").iterdir())


def test_a_long_csv_value_is_a_record_not_the_end_of_the_file(tmp_path):
    """A block holds max_record_bytes and 1 MiB more, so a long value is read (a value over
    pyarrow's 1 MiB default block ended the file), and one over the bound is a bad record. Only the text column is
    converted: another column's type was guessed from the first block, and a later value that did
    not fit it ('big' in a column of numbers) ended the file."""
    rows = [{"id": str(i), "text": f"row {i}"} for i in range(30)]
    rows.insert(20, {"id": "big", "text": "w" * (6 << 20)})
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_bytes(_csv(rows))
    shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    assert _texts(tmp_path / "out") == [r["text"] for r in rows]
    report = shard(str(tmp_path / "in"), str(tmp_path / "out2"), on_bad="skip", max_record_bytes=4 << 20,
                   progress=False)  # the long value is a bad record, counted
    assert (report.documents, report.skipped) == (30, 1)
    with pytest.raises(DataError, match=r"bad row in CSV file 'a.csv', column 'text', row 20: the text is longer"):
        shard(str(tmp_path / "in"), str(tmp_path / "out4"), max_record_bytes=4 << 20, progress=False)  # not "Parquet"
    with pytest.raises(DataError, match=r"'a.csv' is damaged after row \d+: a row holds more than 2097152 bytes "
                                        r"\(max_record_bytes and 1 MiB, at most 1 GiB\)"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), max_record_bytes=1 << 20, progress=False)


def test_a_csv_header_longer_than_a_block_says_so(tmp_path):
    """pyarrow finds no row in a first block that the header fills ("Empty CSV file or block"):
    the error says the header is too long and which setting to raise; blank lines before it do not count."""
    header = ",".join(f"column_{i}" for i in range(100_000)) + ",text"  # 1.2 MB
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("\n\r\n" + header + "\n" + "1," * 100_000 + "hello\n")
    with pytest.raises(DataError, match=r"'a.csv' does not read as CSV with a header line: its header line is longer "
                                        r"than 1049577 bytes \(a block: max_record_bytes and 1 MiB, at most 1 GiB\); "
                                        r"raise max_record_bytes if the header is right"):
        shard(str(tmp_path / "in"), str(tmp_path / "out"), max_record_bytes=1001, progress=False)
    shard(str(tmp_path / "in"), str(tmp_path / "out2"), max_record_bytes=2 << 20, progress=False)
    assert _texts(tmp_path / "out2") == ["hello"]
    (tmp_path / "in" / "a.csv").write_text("\n" * (3 << 20))  # blank lines alone: pyarrow's own words
    with pytest.raises(DataError, match=r"'a.csv' does not read as CSV with a header line: CSV parse error: Empty"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), max_record_bytes=1001, progress=False)


def test_csv_rows_with_too_few_or_many_values_are_bad_records(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("id,text\n1,ok\n2,too,many\n3\n4,fine\n")
    with pytest.raises(DataError, match=r"bad record in 'a.csv': row 3 \(the header is row 1\) has 3 values, the "
                                        r"header 2 \(set on_bad_record"):
        shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    report = shard(str(tmp_path / "in"), str(tmp_path / "out2"), on_bad="skip", progress=False)
    assert (report.documents, report.skipped) == (2, 2) and _texts(tmp_path / "out2") == ["ok", "fine"]
    (tmp_path / "in" / "a.csv").write_text("")
    with pytest.raises(DataError, match=r"'a.csv' does not read as CSV with a header line: Empty CSV file"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), progress=False)
    (tmp_path / "in" / "a.csv").write_bytes("id,text\n1,caf\u00e9\n".encode("latin-1"))  # an Excel export
    with pytest.raises(DataError, match=r"CSV file 'a.csv' is not UTF-8: byte 13 is 0xe9; .* iconv -f latin1"):
        shard(str(tmp_path / "in"), str(tmp_path / "out4"), progress=False)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.text(max_size=20).map(str.encode), st.integers(1, 9))
@example(b"ab\xe2\x82", 3)  # a character cut by the file's end, and across pieces
@example("x\u20acy".encode(), 2)
def test_the_utf8_check_of_a_csv_file_finds_the_first_bad_byte_as_decode_does(data, piece) -> None:
    """A CSV file is checked for UTF-8 as its parts come, keeping no text (a whole `decode` held
    the file again as a str): the byte found is the one `bytes.decode` names, for any cut."""
    from zephon_stream.shard import _Utf8Check

    try:
        data.decode()
        want = None
    except UnicodeDecodeError as exc:
        want = (exc.start, data[exc.start])
    check = _Utf8Check()
    got = next((bad for at in range(0, len(data), piece) if (bad := check.feed(data[at:at + piece]))), None)
    assert (got or check.feed(b"", final=True)) == want


_CSV_DATA = _csv(_CSV_ROWS * 3)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_CSV_DATA) - 1), st.sampled_from(b'",\t\n\r\\ax0\xff\x00')),
                min_size=1, max_size=6), st.integers(0, len(_CSV_DATA)),
       st.sampled_from(["x.csv", "x.tsv", "x.csv.gz"]))
@example(edits=[(4, 34)], cut=0, name="x.csv.gz")  # the gzip header's time: the same 15 rows
def test_a_damaged_csv_file_gives_its_rows_or_one_line_data_error(edits, cut, name) -> None:
    import gzip

    data = bytearray(_CSV_DATA if name == "x.csv" else gzip.compress(_CSV_DATA) if name == "x.csv.gz"
                     else _CSV_DATA.replace(b",", b"\t"))
    for i, b in edits:
        data[i % len(data)] = b
    data = bytes(data[:cut] if cut else data)
    text = _inflatable(data) if name.endswith(".gz") else data  # a gzip header's time may change, and no row
    _shard_damaged(name, data, text.count(b"\n") + text.count(b"\r") + 1)  # a new line may make a row


def _inflatable(data: bytes) -> bytes:
    """What the gzip members at the start of `data` inflate to, up to the first damaged byte."""
    import zlib

    out = []
    while data:
        inflate = zlib.decompressobj(wbits=31)
        try:
            out.append(inflate.decompress(data))
        except zlib.error:
            break
        if not inflate.eof:
            break
        data = inflate.unused_data
    return b"".join(out)


def test_hidden_inputs_are_not_read(tmp_path, caplog):
    (tmp_path / "in" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "in" / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    (tmp_path / "in" / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    (tmp_path / "in" / "._a.jsonl").write_bytes(b"\x00\x05\x16\x07")
    caplog.set_level("WARNING")
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    assert report.inputs == 1 and _texts(tmp_path / "out") == ["one"]
    assert any("zephon shard: 2 objects under" in r.getMessage() for r in caplog.records)
    named = shard(str(tmp_path / "in" / ".ipynb_checkpoints" / "a-checkpoint.jsonl"), str(tmp_path / "o2"),
                  progress=False)
    assert named.inputs == 1  # a file named by itself is read, hidden or not


def test_a_dotted_text_field_reaches_into_json_arrays_and_lines(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(json.dumps([{"doc": {"body": "one"}}, {"doc": {"body": "two"}},
                                                        {"doc.body": "three"}]))
    (tmp_path / "in" / "b.json").write_text(json.dumps({"doc": {"body": "four"}}) + "\n")
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), text_field="doc.body", progress=False)
    assert report.documents == 4 and report.skipped == 0
    assert [json.loads(line) for line in _lines((tmp_path / "out").glob("*.zst"))][2] == {"doc.body": "three"}


def test_bad_records_of_a_json_array_name_their_place_or_are_counted(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(json.dumps([{"text": "ok"}, {"text": 3}, ["x"], {"body": "y"},
                                                        {"text": "fine"}]))
    with pytest.raises(DataError, match=r"bad record in 'a.json': record 1 of its JSON array has int in field 'text'"):
        shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    report = shard(str(tmp_path / "in"), str(tmp_path / "out2"), on_bad="skip", progress=False)
    assert (report.documents, report.skipped) == (2, 3) and _texts(tmp_path / "out2") == ["ok", "fine"]
    deep = 100_000
    (tmp_path / "in" / "a.json").write_text('[{"text": "ok"}, {"text": "x", "n": ' + "[" * deep + "]" * deep + "}]")
    with pytest.raises(DataError, match=r"'a.json' holds a record that nests JSON arrays or objects more than 512 "):
        shard(str(tmp_path / "in"), str(tmp_path / "out-deep"), progress=False)  # was a RecursionError traceback
    report = shard(str(tmp_path / "in"), str(tmp_path / "out-deep2"), on_bad="skip", progress=False)
    assert (report.documents, report.skipped) == (0, 1)
    (tmp_path / "in" / "a.json").write_text('[{"text": "ok"}, {"text": ')
    with pytest.raises(DataError, match=r"'a.json' starts as a JSON array but is not one: Input data was truncated"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), progress=False)
    # an Alpaca-style array and the default text field: the fields there are, not "skip them" (all of them)
    (tmp_path / "in" / "a.json").write_text(json.dumps([{"instruction": "i", "input": "", "output": "o"}]))
    with pytest.raises(DataError, match=r"record 0 of its JSON array has no field 'text'; its fields are "
                                        r"'instruction', 'input', 'output': set text_field to one of them$"):
        shard(str(tmp_path / "in"), str(tmp_path / "out4"), progress=False)


def test_a_source_of_json_files_names_what_it_holds_and_the_fix(config, tmp_path):
    from zephon_stream.loader.loader import Loader

    missing = config.replace(sources=[SourceConfig(name="sft", uri=f"file://{tmp_path}/missing/")])
    with pytest.raises(ConfigError, match=r"^source 'sft': file://\S+/missing/ does not exist$"):  # not "no object"
        next(iter(Loader(missing, backend="threads")))
    (tmp_path / "empty").mkdir()
    empty = config.replace(sources=[SourceConfig(name="sft", uri=f"file://{tmp_path}/empty/")])
    with pytest.raises(ConfigError, match=r"objects under \S+/empty/ \(it holds no object\)"):
        next(iter(Loader(empty, backend="threads")))
    (tmp_path / "d").mkdir()
    for split in ("train", "valid"):
        (tmp_path / "d" / f"{split}.json").write_text(json.dumps({"text": "x"}) + "\n")
    (tmp_path / "d" / "README.md").write_text("a dataset")
    cfg = config.replace(sources=[SourceConfig(name="sft", uri=f"file://{tmp_path}/d/")])
    with pytest.raises(ConfigError, match=r"source 'sft': no \*.jsonl or .* objects under .*/d/ \(it holds \*.json: 2, "
                                          r"\*.md: 1\); `zephon shard` converts .arrow \(Hugging Face save_to_disk\), "
                                          r".json \(JSON lines or an array of records\), .csv, .tsv \(gzipped too\), "
                                          r".txt and .md files"):
        next(iter(Loader(cfg, backend="threads")))
    (tmp_path / "d" / "train.json").rename(tmp_path / "d" / "train.csv")
    with pytest.raises(ConfigError, match=r"\(it holds \*.md: 1, \*.csv: 1, \*.json: 1\); `zephon shard` converts"):
        next(iter(Loader(cfg, backend="threads")))
    for name in ("train.csv", "valid.json", "README.md"):
        (tmp_path / "d" / name).unlink()
    (tmp_path / "d" / "train.tsv.gz").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"\(it holds \*.tsv.gz: 1\); `zephon shard` converts"):
        next(iter(Loader(cfg, backend="threads")))


def test_bad_records_name_the_object_or_are_counted(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": 3}\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=r"bad record in 'a.jsonl' at byte 15"):
        shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    report = shard(str(tmp_path / "in"), str(tmp_path / "out2"), on_bad="skip", progress=False)
    assert (report.documents, report.skipped) == (2, 1) and _texts(tmp_path / "out2") == ["ok", "fine"]


def test_refuses_to_overwrite_and_bad_settings(dataset, tmp_path):
    root, _ = dataset
    shard(str(root / "a"), str(tmp_path / "out"), progress=False)
    # the fix it gives is not "another name" (a new-user trial followed that into a folder of both copies)
    with pytest.raises(ConfigError, match=r"already holds 'shard-00000.jsonl.zst' .*: remove them to shard again, "
                                          r"or write to another folder \(another name adds a second set"):
        shard(str(root / "a"), str(tmp_path / "out"), progress=False)
    with pytest.raises(ConfigError, match=r"shard: \S+nothing does not exist$"):  # it said "looked for *.txt *.md"
        shard(str(tmp_path / "nothing"), str(tmp_path / "o"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"shard: \S+empty holds no files$"):
        shard(str(tmp_path / "empty"), str(tmp_path / "o"), progress=False)
    (tmp_path / "private").mkdir()  # a folder of Python modules' texts: "holds no files" after a warning of them
    for name in ("__init__.txt", "_helpers.txt", ".notes.txt"):
        (tmp_path / "private" / name).write_text("text\n")
    with pytest.raises(ConfigError, match=r"shard: \S+private holds no files to read: its 3 files are all under names "
                                          r"that start with '.' or '_' .*: rename them$"):
        shard(str(tmp_path / "private"), str(tmp_path / "o"), progress=False)
    (tmp_path / "odd").mkdir()
    for name in ("a.docx", "b.pdf", "c.xlsx", "d.doc"):
        (tmp_path / "odd" / name).write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"no input under \S+odd: it holds 4 files \(a.docx, b.pdf, c.xlsx, \.\.\.\), "
                                          r"none of a kind zephon shard reads: \*.jsonl .* \*.parquet .*\*.md$"):
        shard(str(tmp_path / "odd"), str(tmp_path / "o"), progress=False)
    with pytest.raises(ConfigError, match=r"none of a kind zephon shard reads: \*.parquet \*.arrow \*.png \*.jpg$"):
        shard(str(tmp_path / "odd"), str(tmp_path / "o"), image_field="png;jpg", progress=False)
    with pytest.raises(ConfigError, match="target_bytes must be >= 1"):
        shard(str(root / "a"), str(tmp_path / "o"), target_bytes=0)
    with pytest.raises(ConfigError, match=r"target_bytes is a number of bytes \(an int, e.g. 128 << 20\), not '1MiB'"):
        shard(str(root / "a"), str(tmp_path / "o"), target_bytes="1MiB")  # it was a TypeError from a comparison
    with pytest.raises(ConfigError, match=r"max_record_bytes is a number of bytes .* not 1.5"):
        shard(str(root / "a"), str(tmp_path / "o"), max_record_bytes=1.5)


def test_hidden_names_are_counted_under_the_input_folder_only():
    """On S3 a LIST of "data" also returns "data-old/..." and "data.jsonl": those are not the
    folder's hidden files, and "its 2 files are all under names that start with '_'" was false."""
    import anyio

    from zephon_stream.connectors.memory import MemoryStore
    from zephon_stream.shard import _Job

    store = MemoryStore()
    store.objects.update({"data-old/a.txt": b"x\n", "data.jsonl": b'{"text": "x"}\n', "data/_tmp.txt": b"x\n"})
    job = _Job(1 << 20, 1 << 16, None, None, "s", "error", 1 << 20)
    with pytest.raises(ConfigError, match=r"its 1 files are all under names that start with"):
        anyio.run(job._inputs, store, "data", "s3://b/data")
    del store.objects["data/_tmp.txt"]
    job = _Job(1 << 20, 1 << 16, None, None, "s", "error", 1 << 20)
    with pytest.raises(ConfigError, match=r"shard: s3://b/data holds no files$"):
        anyio.run(job._inputs, store, "data", "s3://b/data")


def test_image_folder_with_captions_becomes_tar_shards(tmp_path, caplog):
    import random

    from tests.core.conftest import make_image
    from zephon_stream.formats.tar import parse_samples

    rng = random.Random(5)
    (tmp_path / "in").mkdir()
    images = {}
    for i in range(12):
        images[i] = make_image(rng, "PNG" if i % 2 else "JPEG")
        (tmp_path / "in" / f"im{i:02d}.{'png' if i % 2 else 'jpg'}").write_bytes(images[i])
        (tmp_path / "in" / f"im{i:02d}.txt").write_text(f"caption {i}")
    report = shard(str(tmp_path / "in"), str(tmp_path / "out"), image_field="png;jpg",
                   target_bytes=20000, progress=False)
    assert report.documents == 12 and len(report.shards) > 1
    samples = []
    for path in sorted((tmp_path / "out").glob("*.tar")):
        data = path.read_bytes()
        samples += parse_samples(data, 0, path.name, 1 << 20)
    assert [s.members.get("png", s.members.get("jpg")) for s in samples] == [images[i] for i in range(12)]
    assert [s.members["txt"].decode() for s in samples] == [f"caption {i}" for i in range(12)]
    # samples are renamed (000000000, ...): each shard's name map says which input each one was
    assert _names(tmp_path / "out", caplog) == [
        {"key": s.key, "from": f"im{i:02d}.{'png' if i % 2 else 'jpg'}"} for i, s in enumerate(samples)]
    for p in (tmp_path / "out").glob("*.tar"):  # shards removed, their maps left: a new run would leave stale maps
        p.unlink()
    with pytest.raises(ConfigError, match=r"already holds '.*_shard-00000.names.jsonl' \(\d+ objects named shard-\* "
                                          r"and _shard-\*\): remove them"):
        shard(str(tmp_path / "in"), str(tmp_path / "out"), image_field="png;jpg", progress=False)


def _names(out: Path, caplog: pytest.LogCaptureFixture) -> list[dict]:
    """The name maps of `out`'s tar shards, one per shard and in shard order; no source reads them."""
    from zephon_stream.connectors.base import ObjectInfo
    from zephon_stream.operators.read import is_hidden, visible

    shards = sorted(p.name for p in out.glob("*.tar"))
    maps = sorted(p.name for p in out.glob("*.names.jsonl"))
    assert maps == [f"_{n.removesuffix('.tar')}.names.jsonl" for n in shards] and all(is_hidden(m, "") for m in maps)
    caplog.clear()
    with caplog.at_level("WARNING"):  # a source over the folder reads the shards alone, and says nothing
        listed = [ObjectInfo(key=name, size=1, etag="") for name in shards + maps]
        assert visible(listed, "", "source 'img'", str(out)) == listed[:len(shards)]
    assert caplog.records == []
    return [json.loads(line) for m in maps for line in (out / m).read_bytes().splitlines()]


def test_parquet_image_column_becomes_tar_shards_bytes_unchanged(vision_parquet_dataset, tmp_path, caplog):
    from zephon_stream.formats.tar import parse_samples

    root, images = vision_parquet_dataset
    report = shard(str(root / "pq"), str(tmp_path / "out"), image_field="image", text_field="caption",
                   target_bytes=200_000, progress=False)
    assert report.documents == len(images)
    got = []
    for path in sorted((tmp_path / "out").glob("*.tar")):
        got += [s.members["png"] for s in parse_samples(path.read_bytes(), 0, path.name, 1 << 20)]
    assert got == images
    names = _names(tmp_path / "out", caplog)
    assert len(names) == len(images) and {n["from"] for n in names} == {p.name for p in (root / "pq").iterdir()}
    assert all(n["item"] for n in names), names[:3]


def test_an_image_of_no_known_format_is_a_bad_record(tmp_path, caplog):
    """A Parquet image whose bytes and name say no format stopped the run even with skip, and its
    sample number was taken: the keys after it skipped one."""
    import random

    from tests.core.conftest import make_image
    from zephon_stream.formats.tar import parse_samples

    rng = random.Random(3)
    images = [{"bytes": make_image(rng), "path": f"im{i}.png"} for i in range(4)]
    images[1] = {"bytes": b"neither a known magic nor a name", "path": None}
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"image": images, "caption": [f"caption {i}" for i in range(4)]}),
                   tmp_path / "pq" / "a.parquet")
    with pytest.raises(DataError, match=r"image 'row 1 of row group 0' of '.*a.parquet': its format is not known"):
        shard(str(tmp_path / "pq"), str(tmp_path / "o1"), image_field="image", text_field="caption", progress=False)
    report = shard(str(tmp_path / "pq"), str(tmp_path / "o2"), image_field="image", text_field="caption",
                   on_bad="skip", progress=False)
    assert (report.documents, report.skipped) == (3, 1)
    (path,) = (tmp_path / "o2").glob("*.tar")
    samples = parse_samples(path.read_bytes(), 0, path.name, 1 << 20)
    assert [s.key for s in samples] == ["000000000", "000000001", "000000002"]
    assert [s.members["txt"] for s in samples] == [b"caption 0", b"caption 2", b"caption 3"]
    assert [n["item"] for n in _names(tmp_path / "o2", caplog)] == ["im0.png", "im2.png", "im3.png"]


def test_one_image_file_as_the_input(tmp_path, caplog):
    """Its caption beside it was not found: only the file itself had been listed."""
    import random

    from tests.core.conftest import make_image

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "cat.png").write_bytes(make_image(random.Random(2)))
    (tmp_path / "in" / "cat.txt").write_text("a cat")
    report = shard(str(tmp_path / "in" / "cat.png"), str(tmp_path / "out"), image_field="png", progress=False)
    assert report.documents == 1
    assert _names(tmp_path / "out", caplog) == [{"key": "000000000", "from": "cat.png"}]


def test_cli_shards_and_prints_a_summary(dataset, tmp_path, capsys):
    root, _ = dataset
    assert main(["shard", str(root / "a"), str(tmp_path / "out"), "--target-size", "8KiB",
                 "--frame-size", "2k"]) == 0
    out, err = capsys.readouterr()
    assert "600 documents from 3 inputs" in out and "shards" in out
    assert "shard: " in err and "600 documents" in err  # plain progress lines: stderr is not a terminal
    assert _texts(tmp_path / "out") == dataset[1]["a"]
    assert main(["shard", str(root / "a"), str(tmp_path / "out")]) == 2
    assert "already holds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["shard", str(root / "a"), str(tmp_path / "x"), "--target-size", "12 parsecs"])


def test_cli_errors_name_its_flags_not_the_config_keys(tmp_path, capsys):
    """The readers' errors name `on_bad_record`, `max_record_bytes` and `text_field`; the command says
    its flags."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": \n')
    assert main(["shard", str(tmp_path / "in"), str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "bad record in 'a.jsonl' at byte 15" in err and "pass --on-bad-record skip to skip" in err, err
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "' + b"x" * 3000 + b'"}\n')
    assert main(["shard", str(tmp_path / "in"), str(tmp_path / "o2"), "--max-record-bytes", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "longer than --max-record-bytes 1024" in err and "on_bad_record" not in err, err
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    (tmp_path / "img" / "a.txt").write_text("a caption")
    assert main(["shard", str(tmp_path / "img"), str(tmp_path / "o3"), "--image-field", "png",
                 "--max-record-bytes", "100"]) == 2
    err = capsys.readouterr().err
    assert "'a.png' takes 208 bytes, more than --max-record-bytes 100 (pass --on-bad-record skip" in err, err
    assert main(["shard", str(tmp_path / "img"), str(tmp_path / "o4"), "--image-field", "png",
                 "--max-record-bytes", "100", "--on-bad-record", "skip"]) == 2  # nothing written: not a success
    out, err = capsys.readouterr()
    assert "0 documents from 1 input (208 bytes) into 0 shards (0 bytes), 1 bad record skipped" in out, out
    assert "error: no document to write from" in err and "every record was bad and skipped" in err, err
    (tmp_path / "none").mkdir()  # a file of no rows: exit 0 and no folder, which a source then said did not exist
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none" / "a.parquet")
    assert main(["shard", str(tmp_path / "none"), str(tmp_path / "o7")]) == 2
    assert "they hold no record (empty, or no rows)" in capsys.readouterr().err
    pq.write_table(pa.table({"text": []}), tmp_path / "none" / "a.parquet")  # from an empty list: a null column
    assert main(["shard", str(tmp_path / "none"), str(tmp_path / "o8")]) == 2
    err = capsys.readouterr().err  # it said "is null, not a string: name a text column", of the column named
    assert "column 'text' of Parquet file 'a.parquet' is of type null: it holds no value" in err, err
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(b"")
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "ok"}\n')
    assert main(["shard", str(tmp_path / "in"), str(tmp_path / "o5")]) == 2
    err = capsys.readouterr().err
    assert "error: empty input 'b.jsonl.gz' (0 bytes): remove it or pass --on-bad-record skip" in err, err
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"body": pa.array([1], pa.int64())}), tmp_path / "pq" / "a.parquet")
    assert main(["shard", str(tmp_path / "pq"), str(tmp_path / "o6")]) == 2
    err = capsys.readouterr().err
    assert "has no column 'text' (its columns: body): pass one of them to --text-field" in err, err
    assert main(["shard", str(tmp_path / "pq"), str(tmp_path / "o7"), "--text-field", "body"]) == 2
    err = capsys.readouterr().err
    assert "column 'body' of Parquet file 'a.parquet' is int64, not a string: name a text column (--text-field)" in err


def test_a_sharegpt_record_says_where_a_map_step_is(tmp_path, capsys):
    """The chat check's hint names a map step, which the loader has and zephon shard has not."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"messages": [{"from": "human", "value": "hi"}]}\n')
    assert main(["shard", str(tmp_path / "in"), str(tmp_path / "out"), "--messages-field", "messages"]) == 2
    err = capsys.readouterr().err
    assert "(ShareGPT style: map from/value to role/content with a map step of a loader source, " \
           "[[sources.transforms]]: zephon shard copies records as they are, so give such files to the loader as " \
           "they are)" in err, err


def test_the_output_may_not_be_the_input_inside_it_or_hold_it(tmp_path, monkeypatch, capsys):
    """A loader source reads every data file under its folder: shards written into the input's
    folder (or a folder holding the input) were read beside the input, every document twice."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "a"}\n')
    monkeypatch.chdir(tmp_path)
    for src, dst, why in [("in", "in", "is the input in: a source at in (or the next shard of it) would read the "
                                        "shards too"),
                          ("in/", "in/out", "is inside the input in/"),
                          (f"file://{tmp_path}/in/", f"file://{tmp_path}/in/shards/", "is inside the input"),
                          ("in/a.jsonl", "in", "holds the input in/a.jsonl: a source at in would read the input too"),
                          ("in", ".", "holds the input in")]:
        assert main(["shard", src, dst]) == 2
        assert f"zephon shard: error: shard: the output {dst} {why}" in capsys.readouterr().err
    assert list((tmp_path / "in").iterdir()) == [tmp_path / "in" / "a.jsonl"]
    assert shard("in/a.jsonl", "in-shards", progress=False).documents == 1  # a sibling folder
    assert shard("in", "in/../elsewhere/", progress=False).documents == 1


def test_progress_bar_on_a_terminal_and_lines_elsewhere():
    from zephon_stream.connectors.base import ObjectInfo

    class Tty(io.StringIO):
        def isatty(self):
            return True

    now, counts = [0.0], [(3, 0)]
    tty = Tty()
    bar = _Progress(1000, None, tty, clock=lambda: now[0], counts=lambda: counts[0])
    assert bar.bar is not None
    bar.start_object(ObjectInfo("a", 400, "e"))
    bar.done_object()
    counts[0] = (7, 1)
    bar.close()
    assert "400/1000" in tty.getvalue().replace("B", "").replace(" ", "") or "40%" in tty.getvalue()
    plain = io.StringIO()
    lines = _Progress(1000, None, plain, clock=lambda: now[0], counts=lambda: counts[0])
    counts[0] = (3, 0)
    lines.start_object(ObjectInfo("a", 500, "e"))
    lines.read("a", 300)
    lines.read("a.txt", 100)  # another object's bytes (a caption beside an image) are not this one's
    lines.read("a", 300)  # read twice (a footer): at most the object's size counts
    assert plain.getvalue() == ""  # at most one line every 5 s
    now[0] = 6.0
    lines.tick()
    lines.done_object()
    lines.start_object(ObjectInfo("b", 500, "e"))
    lines.read("b", 100)
    lines.done_object()  # what was not read (a Parquet file's other columns) counts once the object is done
    counts[0] = (5, 1)
    lines.close()
    assert plain.getvalue().splitlines() == [
        "shard: 500/1000 input bytes (50%), 3 documents, 0 shards, 6 s",
        "shard: 1000/1000 input bytes (100%), 5 documents, 1 shard, 6 s"]


def test_the_progress_moves_while_one_large_file_is_read(tmp_path, monkeypatch, capsys):
    """The bytes of the file in hand count as they are read: a single 5 GB file (or the copy of a
    CSV file, which yields no row until it is done) moved the meter only at its end."""
    import itertools

    import zephon_stream.shard as shard_module

    class EveryCall(shard_module._Progress):  # a line at every tick: the clock moves 6 s a call
        def __init__(self, total, bar, file=None, clock=None, **kwargs):
            ticks = itertools.count(0, 6)
            super().__init__(total, False, file, clock=lambda: next(ticks), **kwargs)

    monkeypatch.setattr(shard_module, "_Progress", EveryCall)
    monkeypatch.setattr(shard_module, "_CSV_PART", 100)
    (tmp_path / "in").mkdir()
    data = _csv([{"id": str(i), "text": f"row {i}"} for i in range(100)])
    (tmp_path / "in" / "a.csv").write_bytes(data)
    capsys.readouterr()
    shard(str(tmp_path / "in"), str(tmp_path / "out"), progress=False)
    done = [int(m) for m in re.findall(r"shard: (\d+)/\d+ input bytes", capsys.readouterr().err)]
    assert done == sorted(done) and done[-1] == len(data), done
    assert sum(0 < d < len(data) for d in done) >= len(data) // 100 - 1, done  # a line at each part read


def test_from_and_to_s3(dataset, parquet_dataset, s3, monkeypatch, tmp_path):
    root, docs = dataset
    client = s3.client()
    for path in sorted((parquet_dataset / "a").iterdir()):
        client.put_object(Bucket=s3.bucket, Key=f"raw/{path.name}", Body=path.read_bytes())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.options["secret_access_key"])
    opts = {k: s3.options[k] for k in ("endpoint_url", "region", "addressing_style")}
    report = shard(f"s3://{s3.bucket}/raw/", f"s3://{s3.bucket}/shards/", target_bytes=8000, frame_bytes=2000,
                   progress=False, **opts)
    assert report.documents == 600 and len(report.shards) > 1
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket, Prefix="shards/")["Contents"])
    assert keys == sorted(report.shards) and keys[0] == "shards/shard-00000.jsonl.zst"
    shard(f"s3://{s3.bucket}/shards/", str(tmp_path / "back"), progress=False, **opts)  # s3 -> local, reshard
    assert _texts(tmp_path / "back") == docs["a"]
    one = shard(f"s3://{s3.bucket}/raw/a-1.parquet", str(tmp_path / "one"), progress=False, **opts)
    assert one.inputs == 1 and _texts(tmp_path / "one") == docs["a"][200:400]
    import gzip

    import zephon_stream.shard as shard_module

    monkeypatch.setattr(shard_module, "_CSV_PART", 1000)  # a CSV file from S3 comes in ranged reads of parts
    rows = [{"id": str(i), "text": text} for i, text in enumerate(docs["a"])]
    client.put_object(Bucket=s3.bucket, Key="csv/a.csv.gz", Body=gzip.compress(_csv(rows)))
    report = shard(f"s3://{s3.bucket}/csv/", str(tmp_path / "csv"), progress=False, **opts)
    assert report.documents == 600 and _texts(tmp_path / "csv") == docs["a"]


def test_reexports_the_jsonl_writer():
    from zephon_stream.formats import write_jsonl_shards as a
    from zephon_stream.shard import write_jsonl_shards as b

    assert a is b
