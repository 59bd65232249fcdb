"""The read path under hostile input: bounded memory whatever a zstd frame declares, frame
indexes checked against the frames, skip mode that skips the same way whatever the read sizes,
accurate messages, and any JSON key as the text field."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import anyio
import msgspec
import pytest
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zephon_stream import DataError
from zephon_stream.connectors import LocalStore, MemoryStore
from zephon_stream.errors import root_error
from zephon_stream.formats import seek_table
from zephon_stream.operators.read import Parser, SplitReader, plan_source


def _line(i: int, text: str | None = None) -> bytes:
    return msgspec.json.encode({"id": i, "text": f"doc {i}" if text is None else text}) + b"\n"


def _frames(pieces: list[bytes], checksum: bool = True) -> list[bytes]:
    c = zstandard.ZstdCompressor(level=3, write_checksum=checksum)
    return [c.compress(p) for p in pieces]


async def _read(store, *, lanes=1, on_bad="error", read_ahead=1, max_record=1 << 20, text_field="text"):
    """Every split's records, in order, as (text, ...) plus the skip count."""
    plan = await plan_source(store, "", "s", "memory://t/", text_field, lanes, 1024, on_bad)
    parser = Parser(text_field, on_bad)
    texts = []
    async with anyio.create_task_group() as tg:
        for split in plan.splits:
            reader = SplitReader(store, plan.shards[split.shard], split, max_record, spawn=tg.start_soon,
                                 read_ahead=read_ahead, bad=parser.bad)
            async for pos, block in reader.blocks():
                texts += [t for _, _, t in parser.parse(reader, pos, block)]
    return texts, parser.skipped


def read(store, **kw):
    try:
        return anyio.run(lambda: _read(store, **kw))
    except BaseExceptionGroup as group:  # the task group's: raise the error itself
        raise root_error(group) from None


# ---- bug 2: one compressed frame can take unbounded memory ---------------------------------------

_BIG_FRAME_READER = textwrap.dedent("""
    import json, resource, sys, time, anyio
    from zephon_stream.connectors import LocalStore
    from zephon_stream.operators.read import Parser, SplitReader, plan_source

    async def main(root):
        store = LocalStore(root)
        plan = await plan_source(store, "", "big", "file://" + root, "text", 1, 1 << 20, "error")
        parser = Parser("text", "error")
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start, docs, first, last = time.perf_counter(), 0, None, None
        async with anyio.create_task_group() as tg:
            for split in plan.splits:
                reader = SplitReader(store, plan.shards[split.shard], split, 4 << 20, spawn=tg.start_soon,
                                     read_ahead=4)
                async for pos, block in reader.blocks():
                    records = await anyio.to_thread.run_sync(parser.parse, reader, pos, block)
                    first = first or records[0][2][:8]
                    last, docs = records[-1][2][:8], docs + len(records)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"docs": docs, "first": first, "last": last, "splits": len(plan.splits),
                          "growth_kib": peak - base, "seconds": time.perf_counter() - start}))

    anyio.run(main, sys.argv[1])
""")


def _write_big_frame(path, total: int) -> int:
    """One zstd frame of `total`+ bytes of distinct JSON lines, its content size in the header,
    written in pieces (the test process never holds it)."""
    def line(i):
        return msgspec.json.encode({"text": f"{i:08d} {'zephon ' * 580}"}) + b"\n"
    lines = -(-total // len(line(0)))
    with open(path, "wb") as fh, zstandard.ZstdCompressor(level=3).stream_writer(fh, size=len(line(0)) * lines) as w:
        for i in range(lines):
            w.write(line(i))
    return lines


def test_a_512_mib_frame_streams_in_bounded_memory(tmp_path):
    """Before: the frame was decoded whole (sized by its header): 19 GB RSS for 1 GiB. Now the
    peak growth is set by the settings (4 read parts of <= 1 MiB, one block of 128 KiB, a
    1 MiB output piece, the frame's 2 MiB window, a record <= max_record_bytes = 4 MiB): about
    15 MiB. 64 MiB leaves room for the allocator and is 8x less than the frame decodes to."""
    lines = _write_big_frame(tmp_path / "big.jsonl.zst", 512 << 20)
    assert os.path.getsize(tmp_path / "big.jsonl.zst") < 1 << 20
    header = zstandard.get_frame_parameters((tmp_path / "big.jsonl.zst").read_bytes()[:18])
    assert header.content_size >= 512 << 20
    run = subprocess.run([sys.executable, "-c", _BIG_FRAME_READER, f"{tmp_path}/"], check=False,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert (got["docs"], got["first"], got["last"], got["splits"]) == (lines, "00000000", f"{lines - 1:08d}", 1)
    assert got["growth_kib"] < 64 << 10, got


def _declare(frame: bytes, size: int, single_segment: bool) -> bytes:
    """`frame` (written without a content size) with an 8-byte content size of `size` in its header."""
    fhd = frame[4]
    assert fhd >> 6 == 0 and not fhd & 0x23  # no content size, not single segment, no dictionary
    window = b"" if single_segment else frame[5:6]  # a single-segment frame's window is its content size
    header = bytes([fhd | 0xC0 | (0x20 if single_segment else 0)])
    return frame[:4] + header + window + struct.pack("<Q", size) + frame[6:]


@pytest.mark.parametrize("single_segment", [False, True])
@pytest.mark.parametrize("on_bad", ["error", "skip"])
def test_a_frame_declaring_a_terabyte_is_refused_without_allocating(single_segment, on_bad):
    """Before: a raw MemoryError (the whole content size was allocated up front)."""
    data = b"".join(_line(i) for i in range(50))
    frame = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True).compress(data)
    store = MemoryStore()
    store.objects["a.jsonl.zst"] = _declare(frame, 1 << 40, single_segment) + _frames([_line(50)])[0]
    assert zstandard.get_frame_parameters(store.objects["a.jsonl.zst"]).content_size == 1 << 40
    why = "too much memory.*at most 128 MiB" if single_segment else "corruption"
    if on_bad == "error":
        with pytest.raises(DataError, match=f"corrupt zstd frame in 'a.jsonl.zst' at compressed byte 0: .*{why}"):
            read(store)
    else:
        assert read(store, on_bad="skip") == (["doc 50"], 1)


# ---- bug 3: a malformed seek table loses data silently -------------------------------------------

def _ten_frames() -> tuple[list[bytes], list[bytes]]:
    pieces = [b"".join(_line(f * 6 + i) for i in range(6)) for f in range(10)]
    return pieces, _frames(pieces)


@pytest.mark.parametrize("on_bad", ["error", "skip"])
def test_a_seek_table_listing_ten_frames_as_one_is_refused(on_bad):
    """Before: exit 0 and 6 of the 60 documents."""
    pieces, frames = _ten_frames()
    data = b"".join(frames)
    store = MemoryStore()
    store.objects["a.jsonl.zst"] = data + seek_table([(len(data), sum(map(len, pieces)))])
    with pytest.raises(DataError, match=r"frame index of 'a.jsonl.zst' does not match its frames: the frame at byte "
                                        rf"0 ends at byte {len(frames[0])}, but .* frame 0 at bytes 0..{len(data)}"):
        read(store, on_bad=on_bad)


@pytest.mark.parametrize("lanes", [1, 3, 10])
def test_a_seek_table_with_boundaries_inside_frames_is_refused(lanes):
    pieces, frames = _ten_frames()
    sizes = [len(f) for f in frames]
    sizes[3] += 5  # frame 4 listed 5 bytes late, so frame 3 "ends" inside frame 4: the total still adds up
    sizes[4] -= 5
    store = MemoryStore()
    store.objects["a.jsonl.zst"] = b"".join(frames) + seek_table([(c, 0) for c in sizes])
    with pytest.raises(DataError, match="frame index of 'a.jsonl.zst' does not match its frames"):
        read(store, lanes=lanes)
    store.objects["a.jsonl.zst"] = b"".join(frames) + seek_table([(len(f), len(p)) for f, p in zip(frames, pieces)])
    assert read(store, lanes=lanes) == ([f"doc {i}" for i in range(60)], 0)


# ---- skip mode: records over max_record_bytes, corrupt frames --------------------------------------

def _with_long_records() -> tuple[bytes, list[str]]:
    """Good records around two over the limit (300): one of 250 + 900 bytes, one of 20 kB."""
    out, expect = [], []
    for i in range(60):
        if i == 20:
            out.append(_line(i, "x" * 1150))
        elif i == 41:
            out.append(_line(i, "y" * 20000))
        else:
            out.append(_line(i))
            expect.append(f"doc {i}")
    return b"".join(out), expect


@pytest.mark.parametrize("kind", ["jsonl", "zst"])
def test_long_records_are_skipped_the_same_way_whatever_the_read_sizes(kind):
    data, expect = _with_long_records()
    store = MemoryStore()
    if kind == "jsonl":
        store.objects["a.jsonl"] = data
    else:
        store.objects["a.jsonl.zst"] = b"".join(_frames([data[i:i + 700] for i in range(0, len(data), 700)]))
    for lanes in (1, 4, 13):
        for read_ahead in (1, 4):
            assert read(store, lanes=lanes, read_ahead=read_ahead, on_bad="skip", max_record=300) == (expect, 2)
    with pytest.raises(DataError, match=r"record at .* is longer than max_record_bytes=300: raise the limit"):
        read(store, max_record=300)


def _corrupt(frame: bytes) -> bytes:
    """`frame` with its checksum wrong: zstd finds out only at the frame's end."""
    return frame[:-1] + bytes([frame[-1] ^ 0xFF])


@pytest.mark.parametrize("mid_line", [False, True])
def test_a_corrupt_frame_is_skipped_the_same_way_whatever_the_read_sizes(mid_line):
    data = b"".join(_line(i) for i in range(80))
    if mid_line:
        pieces = [data[i:i + 150] for i in range(0, len(data), 150)]
    else:
        lines = data.splitlines(keepends=True)
        pieces = [b"".join(lines[i:i + 5]) for i in range(0, len(lines), 5)]
    frames = _frames(pieces)
    bad = 6
    frames[bad] = _corrupt(frames[bad])
    store = MemoryStore()
    store.objects["a.jsonl.zst"] = b"".join(frames)
    with pytest.raises(DataError, match=rf"corrupt zstd frame in 'a.jsonl.zst' at compressed byte "
                                        rf"{sum(map(len, frames[:bad]))}: .*checksum"):
        read(store, lanes=4)
    # lost: the records that overlap the frame; after it, reading resumes at a record start, so the
    # cut-off tail of a record (mid_line) is a bad record of its own
    lo, hi = sum(map(len, pieces[:bad])), sum(map(len, pieces[:bad + 1]))
    starts = [sum(map(len, data.splitlines(keepends=True)[:i])) for i in range(81)]
    expect = [f"doc {i}" for i in range(80) if starts[i + 1] <= lo or starts[i] >= hi]
    tail = 1 if hi not in starts else 0
    assert mid_line == bool(tail)
    for lanes in (1, 3, 16):
        for read_ahead in (1, 4):
            assert read(store, lanes=lanes, read_ahead=read_ahead, on_bad="skip") == (expect, 1 + tail)


def test_restoring_inside_a_split_after_a_skipped_frame_resumes_where_the_run_was():
    data = b"".join(_line(i) for i in range(60))
    frames = _frames([data[i:i + 97] for i in range(0, len(data), 97)])
    frames[3] = _corrupt(frames[3])
    store = MemoryStore()
    store.objects["a.jsonl.zst"] = b"".join(frames)

    async def go():
        plan = await plan_source(store, "", "s", "memory://t/", "text", 1, 1 << 20, "skip")
        (split,) = plan.splits
        parser = Parser("text", "skip")
        reader = SplitReader(store, plan.shards[0], split, 1 << 20, bad=parser.bad)
        records = [r async for pos, block in reader.blocks() for r in parser.parse(reader, pos, block)]
        for k, (offset, _, _) in enumerate(records):
            rest = SplitReader(store, plan.shards[0], split, 1 << 20, bad=parser.bad)
            again = [r async for pos, block in rest.blocks(offset) for r in parser.parse(rest, pos, block)]
            assert again == records[k:]
        return len(records)
    assert 0 < anyio.run(go) < 60


# ---- bug 7 and bad-record messages -------------------------------------------------------------------

def _parse(line: bytes, on_bad="error", text_field="text"):
    store = MemoryStore()
    store.objects["a.jsonl"] = line
    return read(store, on_bad=on_bad, text_field=text_field, max_record=1 << 24)


@pytest.mark.parametrize("on_bad", ["error", "skip"])
def test_deep_nesting_is_a_bad_record_not_a_recursion_error(on_bad):
    deep = b'{"meta": ' + b"[" * 100_000 + b"]" * 100_000 + b', "text": "deep"}\n'
    data = _line(0) + deep + _line(2)
    if on_bad == "error":
        with pytest.raises(DataError, match=r"'a.jsonl' at byte \d+: it nests JSON arrays or objects more than 512"):
            _parse(data)
    else:
        assert _parse(data, "skip") == (["doc 0", "doc 2"], 1)


def test_the_nesting_limit_is_fixed_and_brackets_in_strings_do_not_count():
    """The limit does not depend on where the stack happens to be, so every backend skips the same."""
    def nested(d):
        return b'{"m": ' + b"[" * (d - 1) + b"]" * (d - 1) + b', "text": "ok"}\n'
    assert _parse(nested(512) + _line(1, "[" * 5000 + "{" * 5000)) == (["ok", "[" * 5000 + "{" * 5000], 0)
    with pytest.raises(DataError, match="more than 512"):
        _parse(nested(513))


@pytest.mark.parametrize("line, why", [
    (b'\xef\xbb\xbf{"text": "a"}\n', r"UTF-8 byte order mark \(EF BB BF\); remove it"),
    (b'{"text": "a"}\r{"text": "b"}\r{"text": "c"}\r', r"carriage returns .*CR-only line endings"),
    (b'{"text": "lone \\ud800 high"}\n', r"lone UTF-16 surrogate escape \\ud800 at byte 15"),
    (b'{"text": "lone \\udc00 low"}\n', r"lone UTF-16 surrogate escape \\udc00 at byte 15"),
    (b'{"text": "raw \xed\xa0\x80 surrogate"}\n', r"Invalid UTF-8.*bytes ed a0 80 at byte 14 .* UTF-16 surrogate"),
    (b'{"text": "bad \xff byte"}\n', r"Invalid UTF-8.*bytes ff at byte 14 of the record"),
])
def test_bad_records_get_messages_that_name_the_cause(line, why):
    with pytest.raises(DataError, match=r"bad record in 'a.jsonl' at byte 0: .*" + why):
        _parse(line)
    assert _parse(line.rstrip(b"\n") + b"\n" + _line(9), "skip") == (["doc 9"], 1)
    assert _parse(_line(0, "pair \U0001F600") + _line(1)) == (["pair \U0001F600", "doc 1"], 0)


def test_cr_only_shard_over_the_record_limit_says_so():
    store = MemoryStore()
    store.objects["a.jsonl"] = b"".join(_line(i).replace(b"\n", b"\r") for i in range(200))
    with pytest.raises(DataError, match=r"record at byte 0 of 'a.jsonl' is longer than max_record_bytes=1024; it "
                                        r"holds \d+ carriage returns .* CR-only line endings"):
        read(store, max_record=1024)
    assert read(store, max_record=1024, on_bad="skip") == ([], 1)


# ---- text_field: any JSON key ----------------------------------------------------------------------

@pytest.mark.parametrize("key", ["raw-content", "my field", "", "été", 'say "hi"', "back\\slash", "tab\there", "0"])
def test_text_field_can_be_any_json_key(key):
    lines = b"".join(msgspec.json.encode({"id": i, key: f"doc {i}"}) + b"\n" for i in range(3))
    assert _parse(lines, text_field=key) == (["doc 0", "doc 1", "doc 2"], 0)
    with pytest.raises(DataError, match=r"missing required field `text`"):
        _parse(lines)
    other = msgspec.json.encode({"id": 0, key + "x": "a"}) + b"\n"
    with pytest.raises(DataError, match="missing required field"):
        _parse(other, text_field=key)
    with pytest.raises(DataError, match=r"Expected `str`, got `int`"):
        _parse(msgspec.json.encode({key: 5}) + b"\n", text_field=key)


@pytest.mark.parametrize("name", ["doc.body", "a.b.c", 'q"uote.body'])
def test_a_dotted_text_field_reaches_into_nested_objects(name):
    """As in Parquet: the key that is the whole name, else the path; the fast path (a struct per
    level) and the path for keys msgspec cannot rename to (a quote) agree."""
    def nested(value, parts):
        return value if not parts else {parts[0]: nested(value, parts[1:]), "other": 1}

    parts = name.split(".")
    lines = b"".join(msgspec.json.encode({"id": i, **nested(f"doc {i}", parts)}) + b"\n" for i in range(3))
    whole = msgspec.json.encode({name: "whole", parts[0]: nested("path", parts[1:])}) + b"\n"
    assert _parse(lines + whole, text_field=name) == (["doc 0", "doc 1", "doc 2", "whole"], 0)
    for bad, why in [({parts[0]: "flat"}, r"missing required field|Expected `object`"),
                     ({parts[0]: {"other": 1}}, "missing required field"),
                     ({"other": 1}, "missing required field"),
                     (nested(5, parts), r"Expected `str`, got `int`")]:
        with pytest.raises(DataError, match=why):
            _parse(msgspec.json.encode(bad) + b"\n", text_field=name)
        assert _parse(msgspec.json.encode(bad) + b"\n" + lines, text_field=name, on_bad="skip")[1] == 1


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(["a", "b.c", ""]),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["a", "b", "c", "a.b", "b.c", "x"]), inner, max_size=3),
                     max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(records=st.lists(st.dictionaries(st.sampled_from(["a", "b", "a.b", "a.b.c", "x", 'a"q']), _JSON, max_size=4),
                        min_size=1, max_size=8),
       name=st.sampled_from(["a.b", "a.b.c", "b.c", 'a"q.b']))
@example(records=[{"a": None, "a.b.c": "a"}], name="a.b.c")  # the key, beside a path of another type
@example(records=[{"a": {"b": 5}, "a.b.c": "a"}, {"a.b": 1, "a": {"b": "x"}}], name="a.b.c")
def test_a_dotted_text_field_against_an_oracle(records, name):
    """Random nested records: each gives the text that its key or its path holds, or is one
    counted bad record; the fast path and the any-key path (a quote in the name) alike."""
    def oracle(record):
        if name in record:
            return record[name]
        for part in name.split("."):
            record = record.get(part) if isinstance(record, dict) else None
        return record

    lines = b"".join(msgspec.json.encode(r) + b"\n" for r in records)
    want = [v for v in map(oracle, records) if isinstance(v, str)]
    assert _parse(lines, on_bad="skip", text_field=name) == (want, len(records) - len(want))


# ---- a shard name that is not UTF-8 ------------------------------------------------------------------

def test_a_shard_name_that_is_not_utf8_is_a_one_line_error(tmp_path):
    (tmp_path / "good.jsonl").write_bytes(_line(0))
    try:
        with open(os.fsencode(tmp_path) + b"/bad-\xff.jsonl", "wb") as fh:
            fh.write(_line(1))
    except OSError as exc:  # a file system that refuses such names cannot hold one either
        pytest.skip(f"cannot create a non-UTF-8 name here: {exc}")

    async def go():
        return await plan_source(LocalStore(tmp_path), "", "s", f"file://{tmp_path}/", "text", 1, 1024, "skip")
    with pytest.raises(DataError, match=r"^source 's': shard name b'bad-\\xff.jsonl' is not valid UTF-8 \(byte 4\): "
                                        r"rename the file$"):
        anyio.run(go)
