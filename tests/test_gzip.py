"""gzip sources: members found at planning, a bounded decoder whose output never depends on how
the input was cut, and clear errors for what is not gzip, truncated or corrupt."""

from __future__ import annotations

import gzip
import random
import zlib

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import DataError
from zephon_stream.connectors.memory import MemoryStore
from zephon_stream.formats.gzip import _HOLD, GzipStream, find_members
from zephon_stream.operators.read import BadRecords, Split, SplitReader, plan_source


def _members(rng: random.Random, n: int) -> list[bytes]:
    out = []
    for i in range(n):
        lines = b"".join(b'{"text": "%d %s"}\n' % (i, b"x" * rng.randint(0, 300)) for _ in range(rng.randint(0, 40)))
        out.append(gzip.compress(lines, compresslevel=rng.choice([1, 6, 9]), mtime=0))
    return out


def _starts(members: list[bytes]) -> list[int]:
    starts = [0]
    for m in members:
        starts.append(starts[-1] + len(m))
    return starts


async def _find(data: bytes, key: str = "k.jsonl.gz") -> list[int]:
    store = MemoryStore()
    await store.put(key, data)
    return await find_members(store, key, len(data))


def _decode(data: bytes, frames: list[int], cuts: list[int], skip: bool = False) -> tuple[bytes, list[str]]:
    stream = GzipStream("k", 0, frames, skip_corrupt=skip)
    out, errors = [], []
    bounds = sorted({0, len(data), *(c for c in cuts if 0 < c < len(data))})
    for a, b in zip(bounds, bounds[1:]):
        piece = data[a:b]
        while True:
            got, err = stream.pull(1 << 16, piece)
            piece = b""
            out.append(got)
            if err is not None:
                errors.append(str(err))
            elif len(got) < 1 << 16:
                break
    stream.expect_end(len(data))
    return b"".join(out), errors


def test_members_are_found_exactly():
    rng = random.Random(3)
    for n in (1, 2, 9):
        members = _members(rng, n)
        assert anyio.run(_find, b"".join(members)) == _starts(members)


def test_header_fields_and_empty_members():
    named = zlib.compressobj(9, zlib.DEFLATED, 31)
    body = named.compress(b'{"text": "a"}\n') + named.flush()
    with_name = body[:3] + bytes([body[3] | 0x08]) + body[4:10] + b"name.jsonl\x00" + body[10:]  # FNAME
    members = [gzip.compress(b"", mtime=0), with_name, gzip.compress(b'{"text": "b"}\n', mtime=0)]
    data = b"".join(members)
    assert gzip.decompress(data) == b'{"text": "a"}\n{"text": "b"}\n'
    frames = anyio.run(_find, data)
    assert frames == _starts(members)
    assert _decode(data, frames, [5, 17])[0] == gzip.decompress(data)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 1 << 30), st.lists(st.integers(0, 20000), max_size=12))
def test_output_does_not_depend_on_cuts(seed, cuts):
    members = _members(random.Random(seed), 4)
    data = b"".join(members)
    assert _decode(data, _starts(members), cuts)[0] == gzip.decompress(data)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 1 << 30), st.lists(st.integers(0, 20000), max_size=8), st.data())
def test_a_corrupt_member_is_skipped_the_same_way_whatever_the_cuts(seed, cuts, draw):
    rng = random.Random(seed)
    members = _members(rng, 4)
    bad = draw.draw(st.integers(0, 3))
    m = bytearray(members[bad])
    at = draw.draw(st.integers(10, max(10, len(m) - 9)))
    m[at] ^= 0xFF
    members[bad] = bytes(m)
    data = b"".join(members)
    frames = _starts(members)
    whole = _decode(data, frames, [], skip=True)
    assert _decode(data, frames, cuts, skip=True) == whole
    good = b"".join(gzip.decompress(x) for i, x in enumerate(members) if i != bad)
    if whole[1]:  # the damage was detected: that member is dropped, all of it (members are < 1 MiB)
        assert whole[0] == good and len(whole[1]) == 1 and f"at compressed byte {frames[bad]}:" in whole[1][0]
    else:  # a flip that inflate cannot see (say in a stored header field) must leave the text as it was
        assert whole[0] == gzip.decompress(data)


def test_a_corrupt_member_is_an_error_without_skip():
    members = _members(random.Random(1), 3)
    data = bytearray(b"".join(members))
    data[_starts(members)[1] + 12] ^= 0xFF
    with pytest.raises(DataError, match=r"corrupt gzip member in 'k' at compressed byte \d+"):
        _decode(bytes(data), _starts(members), [])


def test_truncated_file():
    members = _members(random.Random(2), 2)
    data = b"".join(members)[:-5]
    with pytest.raises(DataError, match=rf"gzip member in 'k' at compressed byte {len(members[0])}: it does not "
                                        rf"end at byte {len(data)}, .* damaged or truncated"):
        _decode(data, [0, len(members[0]), len(data)], [])


def test_output_is_bounded_for_a_bomb():
    bomb = gzip.compress(bytes(64 << 20), mtime=0)  # 64 MiB of zeros in ~64 KiB
    stream = GzipStream("k", 0, [0, len(bomb)])
    got, err = stream.pull(1 << 16, bomb)
    assert err is None and len(got) <= (1 << 16) + _HOLD


def test_magic_inside_a_member_is_never_a_silent_loss():
    """A stored (level 0) member whose payload is itself a gzip member: the scan takes the inner one
    for a member start, and the reader of the outer one finds it running past it: a DataError."""
    inner = gzip.compress(b'{"text": "inner"}\n' * 50, mtime=0)
    outer = gzip.compress(inner, compresslevel=0, mtime=0)
    data = gzip.compress(b'{"text": "x"}\n', mtime=0) + outer
    frames = anyio.run(_find, data)
    assert len(frames) == 4  # the fake start was taken
    with pytest.raises(DataError, match=rf"member in 'k' at compressed byte {frames[1]}: it does not end at byte "
                                        rf"{frames[2]}, where the plan's next member starts"):
        _decode(data, frames, [])


def _plan(files: dict[str, bytes], on_bad: str = "error"):
    async def main():
        store = MemoryStore()
        for key, data in files.items():
            await store.put(key, data)
        return store, await plan_source(store, "", "src", "memory://x/", "text", 4, 1024, on_bad)
    return anyio.run(main)


def test_not_gzip_is_refused_at_planning_naming_the_file():
    with pytest.raises(DataError, match=r"'b.jsonl.gz' is not a gzip file: it starts with 7b 22 74"):
        _plan({"a.jsonl.gz": gzip.compress(b'{"text": "a"}\n'), "b.jsonl.gz": b'{"text": "b"}\n'})
    _, plan = _plan({"a.jsonl.gz": gzip.compress(b'{"text": "a"}\n'), "b.jsonl.gz": b'{"text": "b"}\n'}, "skip")
    assert plan.skipped_shards == ["b.jsonl.gz"]


def test_single_member_is_one_split_and_members_split():
    rng = random.Random(4)
    words = [b"lane", b"shard", b"token", b"mix", b"frame", b"split", b"seed", b"epoch"]
    lines = b"".join(b'{"text": "%s"}\n' % b" ".join(rng.choices(words, k=rng.randint(0, 40))) for _ in range(400))
    members = [gzip.compress(lines[i:i + 3000], mtime=0) for i in range(0, len(lines), 3000)]  # cut mid-line
    store, plan = _plan({"one.json.gz": gzip.compress(lines, mtime=0), "many.jsonl.gz": b"".join(members)})
    by_key = {plan.shards[s.shard].key: [] for s in plan.splits}
    for s in plan.splits:
        by_key[plan.shards[s.shard].key].append(s)
    assert len(by_key["one.json.gz"]) == 1 and len(by_key["many.jsonl.gz"]) > 3

    async def read(split: Split) -> bytes:
        reader = SplitReader(store, plan.shards[split.shard], split, 1 << 20, bad=BadRecords())
        return b"".join([block async for _, block in reader.blocks()])

    for key, splits in by_key.items():  # the splits own every line once, members cut lines anywhere
        assert b"".join(anyio.run(read, s) for s in splits) == lines, key


def test_a_place_in_a_gzip_shard_is_named_after_its_member_not_a_frame():
    """zstd has frames, gzip members: an error's place says which (a new-user trial read 'frame')."""
    members = [gzip.compress(b'{"text": "a"}\n' * 50, mtime=0) for _ in range(3)]
    store, plan = _plan({"a.jsonl.gz": b"".join(members), "b.jsonl.zst": zstd_frames(b'{"text": "b"}\n', 3)})
    where = {plan.shards[s.shard].key: SplitReader(store, plan.shards[s.shard], s, 1 << 20).where(7)
             for s in plan.splits}
    assert where["a.jsonl.gz"].startswith("decompressed byte 7 after the gzip member at compressed byte ")
    assert where["b.jsonl.zst"].startswith("decompressed byte 7 after the frame at compressed byte ")


def zstd_frames(line: bytes, n: int) -> bytes:
    import zstandard

    c = zstandard.ZstdCompressor()
    return b"".join(c.compress(line * 20) for _ in range(n))
