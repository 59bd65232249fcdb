"""Fuzz the decoders of untrusted shard bytes: the seek table and the zstd frame walk.

Each must end in a clean DataError or a correct result, in bounded memory, never any other
exception; a plan from a damaged seek table must never read less (or more) than the shard holds.
"""

from __future__ import annotations

import struct

import anyio
import msgspec
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zephon_stream import DataError
from zephon_stream.connectors import MemoryStore
from zephon_stream.errors import root_error
from zephon_stream.formats.jsonl_zst import ZstdStream, seek_table
from zephon_stream.operators.read import Parser, SplitReader, plan_source

DOCS = [f"document {i} " * (i % 7 + 1) for i in range(48)]
LINES = [msgspec.json.encode({"text": t}) + b"\n" for t in DOCS]


def _shard(frames: int, checksum: bool = True) -> tuple[bytes, list[bytes], list[bytes]]:
    """(all frames, the frames, their decoded pieces): `frames` frames of whole lines."""
    per = -(-len(LINES) // frames)
    pieces = [b"".join(LINES[i:i + per]) for i in range(0, len(LINES), per)]
    c = zstandard.ZstdCompressor(level=1, write_checksum=checksum)
    compressed = [c.compress(p) for p in pieces]
    return b"".join(compressed), compressed, pieces


async def _plan_and_read(store: MemoryStore, lanes: int) -> tuple[list[str], int]:
    plan = await plan_source(store, "", "s", "memory://f/", "text", lanes, 1024, "error")
    planned = store.statistics().bytes_read
    parser, texts = Parser("text", "error"), []
    for split in plan.splits:
        reader = SplitReader(store, plan.shards[split.shard], split, 1 << 20)
        async for pos, block in reader.blocks():
            texts += [t for _, _, t in parser.parse(reader, pos, block)]
    return texts, planned


def _outcome(store: MemoryStore, lanes: int) -> tuple[list[str], int] | DataError:
    try:
        return anyio.run(_plan_and_read, store, lanes)
    except DataError as err:
        return err
    except BaseExceptionGroup as group:
        err = root_error(group)
        if isinstance(err, DataError):
            return err
        raise


def _mutate_table(data: bytes, table: bytes, kind: str, draw) -> bytes:
    body = bytearray(table)
    if kind == "tail":  # anything at all where the table was, ending in the seek table magic or not
        tail = draw(st.binary(max_size=80))
        return data + tail + (struct.pack("<I", 0x8F92EAB1) if draw(st.booleans()) else b"")
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(body) - 1))
            body[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "count":
        struct.pack_into("<I", body, len(body) - 9, draw(st.integers(0, 2**32 - 1)))
    elif kind == "entry":
        n = struct.unpack_from("<I", body, len(body) - 9)[0]
        struct.pack_into("<I", body, 8 + 8 * draw(st.integers(0, n - 1)), draw(st.integers(0, 2**32 - 1)))
    elif kind == "resize":  # entries moved between neighbours: sizes still add up to the data
        n = struct.unpack_from("<I", body, len(body) - 9)[0]
        if n > 1:
            i, shift = draw(st.integers(0, n - 2)), draw(st.integers(-40, 40))
            a, b = struct.unpack_from("<II", body, 8 + 8 * i)[0], struct.unpack_from("<I", body, 16 + 8 * i)[0]
            struct.pack_into("<I", body, 8 + 8 * i, max(0, a + shift))
            struct.pack_into("<I", body, 16 + 8 * i, max(0, b - shift))
    elif kind == "merge":  # two neighbouring frames listed as one entry (the case, in small)
        n = struct.unpack_from("<I", body, len(body) - 9)[0]
        if n > 1:
            sizes = [struct.unpack_from("<II", body, 8 + 8 * i) for i in range(n)]
            i = draw(st.integers(0, n - 2))
            sizes[i:i + 2] = [(sizes[i][0] + sizes[i + 1][0], sizes[i][1] + sizes[i + 1][1])]
            return data + seek_table(sizes)
    return data + bytes(body)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.integers(1, 8), lanes=st.sampled_from([1, 3, 16]),
       kind=st.sampled_from(["tail", "flip", "count", "entry", "resize", "merge"]), draw=st.data())
def test_a_damaged_seek_table_reads_every_record_once_or_is_a_data_error(frames, lanes, kind, draw):
    data, compressed, pieces = _shard(frames)
    table = seek_table([(len(c), len(p)) for c, p in zip(compressed, pieces)])
    store = MemoryStore()
    store.objects["a.jsonl.zst"] = shard = _mutate_table(data, table, kind, draw.draw)
    got = _outcome(store, lanes)
    event(f"{kind}: {'refused' if isinstance(got, DataError) else 'read'}")
    if isinstance(got, DataError):
        assert "a.jsonl.zst" in str(got)
        return
    texts, planned = got
    assert texts == DOCS  # never fewer, never more, never reordered
    assert planned <= len(shard) + 9  # the table, or one walk of the shard: nothing sized by what it declares


def test_a_seek_table_declaring_2_pow_32_frames_is_refused_from_its_footer():
    data, compressed, pieces = _shard(4)
    table = bytearray(seek_table([(len(c), len(p)) for c, p in zip(compressed, pieces)]))
    struct.pack_into("<I", table, len(table) - 9, 2**32 - 1)
    store = MemoryStore()
    store.objects["a.jsonl.zst"] = data + bytes(table)
    with pytest.raises(DataError, match=r"corrupt seek table in 'a.jsonl.zst': 4294967295 frames do not fit"):
        anyio.run(_plan_and_read, store, 1)
    assert store.statistics().bytes_read == 9  # only the footer: nothing read or allocated for the entries


def _cuts(data: bytes, sizes: list[int]) -> list[bytes]:
    out, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        out.append(data[i:i + n])
        i, k = i + n, k + 1
    return out


def _decode(data: bytes, frames: list[int], sizes: list[int], skip: bool) -> list[bytes | str]:
    """Decoded output (joined between errors) and skipped frames' errors, feeding `data` in `sizes` pieces."""
    stream, out, run = ZstdStream("z", 0, frames, 0, skip_corrupt=skip), [], b""
    for piece in _cuts(data, sizes) + [b""]:
        while True:
            got, err = stream.pull(1 << 20, piece)
            assert len(got) <= (1 << 20) * 2 + (128 << 10)  # a pull's output is bounded, whatever the input
            piece, run = b"", run + got
            if err is not None:
                out += [run, str(err)]
                run = b""
            elif not got:
                break
    stream.expect_end(len(data))
    return out + [run]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.integers(1, 6), checksum=st.booleans(), draw=st.data(),
       cuts=st.lists(st.integers(1, 400), min_size=1, max_size=5), other=st.lists(st.integers(1, 4000), min_size=1,
                                                                                  max_size=3))
def test_zstd_walk_and_decode_of_damaged_frames(frames, checksum, draw, cuts, other):
    """Walk and decode end in a DataError or a result; skip mode skips the same whatever the cuts."""
    data, _, _ = _shard(frames, checksum)
    damaged = bytearray(data)
    for _ in range(draw.draw(st.integers(0, 3))):
        i = draw.draw(st.integers(0, len(damaged) - 1))
        damaged[i] ^= 1 << draw.draw(st.integers(0, 7))
    if draw.draw(st.booleans()):
        del damaged[draw.draw(st.integers(0, len(damaged))):]
    damaged = bytes(damaged)
    walk = ZstdStream("z", 0, decode=False)
    try:
        for piece in _cuts(damaged, cuts):
            walk.pull(1 << 20, piece)
        walk.expect_end(len(damaged))
    except DataError:
        event("walk refused")
        return
    planned = walk.starts + [len(damaged)]
    for skip in (False, True):
        try:
            first = _decode(damaged, planned, cuts, skip)
        except DataError:
            event(f"decode refused (skip={skip})")
            continue
        event(f"decoded (skip={skip}) with {len(first) // 2} frames skipped")
        assert first == _decode(damaged, planned, other, skip)  # the cuts never change the result
        if damaged == data:
            assert first == [b"".join(LINES)]
