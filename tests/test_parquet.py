"""Parquet sources: planning from the footer, reading a row group's needed columns, records as
rows, and bad input (corrupt footer or data, missing or mistyped column, nulls) named clearly."""

from __future__ import annotations

import io

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import ConfigError, DataError, IncompatibleState, ZephonError
from zephon_stream.connectors.memory import MemoryStore
from zephon_stream.loader.config import SourceConfig, TransformStep
from zephon_stream.operators.images import ImageRecord
from zephon_stream.operators.parquet import ParquetParser, ParquetSplitReader
from zephon_stream.operators.read import Split, plan_source
from zephon_stream.operators.transforms import Records


def _parquet(table: pa.Table, **kwargs) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, **kwargs)
    return out.getvalue()


def _plan(files: dict[str, bytes], text_field: str = "text", on_bad: str = "error", image_field: str | None = None,
          lanes: int = 4):
    async def main():
        store = MemoryStore()
        for key, data in files.items():
            await store.put(key, data)
        return store, await plan_source(store, "", "src", "memory://x/", text_field, lanes, 1024, on_bad,
                                        images=image_field is not None, image_field=image_field)
    return anyio.run(main)


def _read(files, text_field="text", on_bad="error", image_field=None, split=None, offset=0, max_record=1 << 20,
          lanes=4, records=None):
    store, plan = _plan(files, text_field, on_bad, image_field, lanes)
    parser = ParquetParser(text_field, image_field, on_bad, max_record, records)

    async def main():
        out = []
        for sp in [split] if split else plan.splits:
            reader = ParquetSplitReader(store, plan.shards[sp.shard], sp, max_record, columns=parser.columns,
                                        bad=parser.bad)
            async for pos, block in reader.blocks(offset):
                out += parser.parse(reader, pos, block)
        return out
    return anyio.run(main), parser


TEXTS = [f"document {i} " + "word " * (i % 17) for i in range(100)]


def test_row_groups_are_the_splits_and_rows_the_records():
    data = _parquet(pa.table({"id": range(100), "text": TEXTS}), row_group_size=10)
    store, plan = _plan({"a.parquet": data}, lanes=100)
    assert plan.format == "parquet" and plan.shards[0].rows == list(range(0, 101, 10))
    assert len(plan.splits) == 10 and all(s.end - s.start == 1 for s in plan.splits)
    records, _ = _read({"a.parquet": data}, lanes=100)
    assert [t for _, _, t in records] == TEXTS
    assert [(off, n) for off, n, _ in records[:12]] == [(i, 1) for i in range(10)] + [(0, 1), (1, 1)]


def _with_empty_row_groups(texts: list[str]) -> bytes:
    """`texts` in row groups of 10, with a row group of no rows first, in the middle and last
    (pyarrow writes an empty table as one: its chunk lists no data page, at offset 0)."""
    out = io.BytesIO()
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(out, schema) as writer:
        writer.write_table(pa.table({"text": pa.array([], pa.string())}))
        writer.write_table(pa.table({"text": texts[:50]}), row_group_size=10)
        writer.write_table(pa.table({"text": pa.array([], pa.string())}))
        writer.write_table(pa.table({"text": texts[50:]}), row_group_size=10)
        writer.write_table(pa.table({"text": pa.array([], pa.string())}))
    return out.getvalue()


def test_row_groups_of_no_rows_hold_nothing_and_files_of_none_are_named():
    """An empty file that pyarrow wrote was refused as corrupt ("row group 0 column 'text' lists
    bytes 0..15, outside the file's data"): its one row group has no data page."""
    data = _with_empty_row_groups(TEXTS)
    assert pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).column(0).data_page_offset == 0
    empty = _parquet(pa.table({"text": pa.array([], pa.string())}))
    records, _ = _read({"a.parquet": data, "b.parquet": empty}, lanes=3)
    assert sorted(t for _, _, t in records) == sorted(TEXTS)
    with pytest.raises(DataError, match=r"source 'src': the parquet shards under memory://x/ hold no rows"):
        _plan({"b.parquet": empty})


def test_a_dictionary_encoded_text_column_is_text():
    """pandas writes a category column as an Arrow dictionary: it was refused as 'not a string'."""
    data = _parquet(pa.table({"text": pa.array(TEXTS).dictionary_encode()}), row_group_size=10)
    assert pa.types.is_dictionary(pq.read_schema(io.BytesIO(data)).field("text").type)
    records, _ = _read({"a.parquet": data})
    assert sorted(t for _, _, t in records) == sorted(TEXTS)
    ints = _parquet(pa.table({"text": pa.array(range(100)).dictionary_encode()}))
    with pytest.raises(DataError, match="column 'text' of Parquet file 'a.parquet' is int64, not a string"):
        _plan({"a.parquet": ints})


def test_restore_reads_from_a_row_inside_a_row_group():
    data = _parquet(pa.table({"text": TEXTS}), row_group_size=10)
    split = Split(0, 2, 5)  # row groups 2..4: rows 20..49, offsets 0..29
    records, _ = _read({"a.parquet": data}, split=split, offset=13)
    assert [t for _, _, t in records] == TEXTS[33:50] and records[0][0] == 13
    assert _read({"a.parquet": data}, split=split, offset=30)[0] == []  # a cursor at the split's end
    with pytest.raises(IncompatibleState, match="row 31 of 'a.parquet' is not in split"):
        _read({"a.parquet": data}, split=split, offset=31)


def test_dotted_path_reaches_into_structs_and_a_null_struct_is_a_null():
    rows = [{"body": t, "n": i} if i != 7 else None for i, t in enumerate(TEXTS[:20])]
    data = _parquet(pa.table({"doc": rows}), row_group_size=8)
    with pytest.raises(DataError, match=r"column 'doc.body', row 7 of row group 0: the value is null"):
        _read({"b.parquet": data}, text_field="doc.body")
    records, parser = _read({"b.parquet": data}, text_field="doc.body", on_bad="skip")
    assert [t for _, _, t in records] == TEXTS[:7] + TEXTS[8:20] and parser.skipped == 1


def test_a_top_level_name_with_a_dot_wins_over_a_path():
    data = _parquet(pa.table({"doc.body": TEXTS[:5], "doc": [{"body": "no"}] * 5}))
    assert [t for _, _, t in _read({"a.parquet": data}, text_field="doc.body")[0]] == TEXTS[:5]


def test_nulls_name_the_file_column_row_group_and_row():
    data = _parquet(pa.table({"text": TEXTS[:30] + [None] + TEXTS[31:40]}), row_group_size=12)
    with pytest.raises(DataError, match=r"bad row in Parquet file 'a.parquet', column 'text', row 6 of row group 2: "
                                        r"the value is null \(set on_bad_record"):
        _read({"a.parquet": data})
    records, parser = _read({"a.parquet": data}, on_bad="skip")
    assert len(records) == 39 and parser.skipped == 1


def test_oversized_text_is_a_bad_record():
    data = _parquet(pa.table({"text": ["short", "x" * 5000, "also short"]}))
    with pytest.raises(DataError, match="longer than max_record_bytes = 1000"):
        _read({"a.parquet": data}, max_record=1000)
    records, parser = _read({"a.parquet": data}, on_bad="skip", max_record=1000)
    assert [t for _, _, t in records] == ["short", "also short"] and parser.skipped == 1


@pytest.mark.parametrize(("table", "field", "needle"), [
    (pa.table({"body": ["a"]}), "text", r"has no column 'text' \(its columns: body\)"),
    (pa.table({"doc": [{"x": "a"}]}), "doc.body", "has no column 'doc.body'"),
    (pa.table({"text": [1, 2]}), "text", "column 'text' of Parquet file 'a.parquet' is int64, not a string"),
    (pa.table({"text": [[1]]}), "text", r"is list<element: int64>, not a string"),
])
def test_missing_or_mistyped_column_is_refused_at_planning(table, field, needle):
    with pytest.raises(DataError, match=needle):
        _plan({"a.parquet": _parquet(table)}, text_field=field)


@pytest.mark.parametrize("kind", [pa.binary(), pa.large_binary()])
def test_a_binary_text_column_is_read_as_utf8_and_bad_bytes_are_a_bad_row(kind):
    """Spark's BinaryType, pandas' bytes objects: the text's UTF-8 bytes, checked value by value."""
    values = ["one ✓".encode(), b"two", b"\xff\xfe bad", None, b"four"]
    data = _parquet(pa.table({"doc": pa.array([{"body": v} for v in values],
                                              pa.struct([("body", kind)])), "text": pa.array(values, kind)}))
    for field in ("text", "doc.body"):
        with pytest.raises(DataError, match=rf"column '{field}', .*: the binary value is not UTF-8 text "
                                            r"\(invalid start byte at byte 0\)"):
            _read({"a.parquet": data}, text_field=field)
        records, parser = _read({"a.parquet": data}, text_field=field, on_bad="skip")
        assert [t for _, _, t in records] == ["one ✓", "two", "four"] and parser.skipped == 2
    shout = Records(SourceConfig(name="s", uri="memory://t/", transforms=[
        TransformStep(map="tests.core.transform_fns:shout")]))  # a map sees the text as a str
    data = _parquet(pa.table({"text": pa.array([v for v in values if v is not None], kind)}))
    records, parser = _read({"a.parquet": data}, on_bad="skip", records=shout)
    assert [t for _, _, t in records] == ["LOUD ONE ✓", "LOUD TWO", "LOUD FOUR"] and parser.skipped == 1


@pytest.mark.parametrize(("mangle", "needle"), [
    (lambda d: d[:-4] + b"XXXX", "it ends with 58 58 58 58, not the magic PAR1"),
    (lambda d: d[:-8] + (10 ** 9).to_bytes(4, "little") + b"PAR1", "the footer length 1000000000 does not fit"),
    (lambda d: d[:-40] + b"\xff" * 32 + d[-8:], "the footer does not decode"),
    (lambda d: d[:5], "5 bytes, fewer than a Parquet file's magic"),
])
def test_corrupt_footer_names_the_file(mangle, needle):
    good = _parquet(pa.table({"text": TEXTS}))
    with pytest.raises(DataError, match=f"corrupt Parquet file 'b.parquet': {needle}"):
        _plan({"a.parquet": good, "b.parquet": mangle(good)})
    _, plan = _plan({"a.parquet": good, "b.parquet": mangle(good)}, on_bad="skip")
    assert plan.skipped_shards == ["b.parquet"]


def test_corrupt_column_data_names_the_row_group():
    good = _parquet(pa.table({"text": TEXTS}), row_group_size=50, compression="snappy")
    meta = pq.read_metadata(io.BytesIO(good))
    chunk = meta.row_group(1).column(0)
    at = chunk.dictionary_page_offset + chunk.total_compressed_size // 2
    bad = good[:at] + bytes(b ^ 0x5A for b in good[at:at + 16]) + good[at + 16:]
    with pytest.raises(DataError, match="corrupt Parquet file 'a.parquet': row group 1 does not decode"):
        _read({"a.parquet": bad})


def test_one_format_per_source():
    with pytest.raises(ConfigError, match="holds both JSON-lines shards .* and Parquet shards"):
        _plan({"a.jsonl": b'{"text": "a"}\n', "b.parquet": _parquet(pa.table({"text": ["b"]}))})


def test_image_columns_give_image_records_with_the_bytes_unchanged():
    images = [bytes([i]) * (10 + i) for i in range(6)]
    hf = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    struct = _parquet(pa.table({"image": pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)], hf),
                                "caption": [f"c{i}" for i in range(6)]}), row_group_size=4)
    records, _ = _read({"a.parquet": struct}, text_field="caption", image_field="image")
    assert [r for _, _, r in records] == [ImageRecord(f"c{i}", b, f"{i}.png") for i, b in enumerate(images)]
    plain = _parquet(pa.table({"img": pa.array(images, pa.large_binary()), "caption": [f"c{i}" for i in range(6)]}))
    records, _ = _read({"a.parquet": plain}, text_field="caption", image_field="img")
    assert [(r.image, r.member) for _, _, r in records] == [(b, f"row {i} of row group 0")
                                                            for i, b in enumerate(images)]


def test_bad_image_rows():
    hf = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array([{"bytes": b"png", "path": "a"}, {"bytes": None, "path": "b"}, None,
                                         {"bytes": b"png", "path": "c"}, {"bytes": b"png", "path": "d"}], hf),
                      "caption": ["ok", "no bytes", "null image", " ", "ok too"]})
    with pytest.raises(DataError, match="column 'image', row 1 of row group 0: the image's bytes are null and it "
                                        "names only a path, 'b': images are read from their bytes, not from paths"):
        _read({"a.parquet": _parquet(table)}, text_field="caption", image_field="image")
    records, parser = _read({"a.parquet": _parquet(table)}, text_field="caption", image_field="image", on_bad="skip")
    assert [r.text for _, _, r in records] == ["ok", "ok too"] and parser.skipped == 3
    with pytest.raises(DataError, match="column 'caption' of Parquet file 'a.parquet' is string, not binary"):
        _plan({"a.parquet": _parquet(table)}, text_field="caption", image_field="caption")


_VALID = _parquet(pa.table({"id": range(60), "text": TEXTS[:60]}), row_group_size=10)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, len(_VALID)))
def test_a_damaged_file_gives_its_rows_or_one_line_data_error(edits, cut) -> None:
    """Bytes changed anywhere (footer, page headers, string pages) and the file cut short: the rows
    come out, or one ZephonError line. A thrift error's message held a newline; a string page with
    bytes that are not UTF-8 and a column name that is not were UnicodeDecodeError tracebacks."""
    data = bytearray(_VALID)
    for i, b in edits:
        data[i] = b
    try:
        records, _ = _read({"a.parquet": bytes(data[:cut] if cut else data)})
    except ZephonError as exc:
        assert "\n" not in str(exc), str(exc)
        return
    assert len(records) <= 60
