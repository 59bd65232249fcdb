"""Fuzzing the decoders of untrusted bytes on the refit side: MANIFESTs, safetensors headers and
local `.refit` records. Each input ends in a ZephonError or a valid result, in bounded memory:
never another exception, never an allocation sized by a number the input declares."""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import tempfile
import tracemalloc
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.refit._helpers import assert_same, model, step, zeros_like
from zephon_stream import ZephonError
from zephon_stream.connectors import MemoryStore
from zephon_stream.refit import LocalRecord, Publisher, Subscriber, safetensors
from zephon_stream.refit.manifest import decode_manifest
from zephon_stream.refit.subscriber import decode_record

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_FILES = settings(FUZZ, max_examples=120)  # each example writes and maps a file
BIG = [0, 1, 7, 8, 255, 1 << 16, 1 << 31, 1 << 32, 1 << 40, 1 << 44, 1 << 62, (1 << 64) - 1, -1, -(1 << 63)]


@functools.cache
def published() -> tuple[MemoryStore, list[dict[str, torch.Tensor]]]:
    """A prefix `p/` with a keyframe and a delta (with overwrite objects), built once."""
    store, states = MemoryStore(), [model(1), step(model(1), 2, frac=0.3)]

    async def go() -> None:
        async with Publisher("p/", store=store, chunk_bytes=64, keyframe_every=2, overwrite=True) as pub:
            for s in states:
                await pub.publish(s)

    anyio.run(go)
    return store, states


def manifests() -> list[bytes]:
    store, _ = published()
    return [store.objects[f"p/v{v}/MANIFEST"] for v in (1, 2)]


def _decodes_or_refuses(data: bytes) -> None:
    try:
        m, table = decode_manifest(data, "k")
    except ZephonError:
        return
    assert table.nbytes == m.model_bytes and sum(c.plain for c in m.chunks) % (1 << 64) == m.model_digest


# -- MANIFEST ------------------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=2048))
def test_manifest_random_bytes(data: bytes) -> None:
    _decodes_or_refuses(data)


@FUZZ
@given(st.sampled_from([0, 1]), st.data())
def test_manifest_flipped_and_truncated(which: int, draw: st.DataObject) -> None:
    data = bytearray(manifests()[which])
    for _ in range(draw.draw(st.integers(0, 8))):
        i = draw.draw(st.integers(0, len(data) - 1))
        data[i] ^= draw.draw(st.integers(1, 255))
    cut = draw.draw(st.integers(0, len(data)))
    _decodes_or_refuses(bytes(data[:cut]) if draw.draw(st.booleans()) else bytes(data))


def _paths(obj: object, path: tuple = ()) -> list[tuple]:
    """Every path to a scalar inside decoded msgpack."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _paths(v, (*path, k))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _paths(v, (*path, i))]
    return [path]


def _set(obj: object, path: tuple, value: object) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


@FUZZ
@given(st.sampled_from([0, 1]), st.data())
def test_manifest_fields_set_to_huge_or_odd_values(which: int, draw: st.DataObject) -> None:
    """Any field (a count, a size, a shape, a digest) replaced by an extreme or ill-typed value."""
    raw = msgspec.msgpack.decode(manifests()[which])
    paths = _paths(raw)
    for _ in range(draw.draw(st.integers(1, 4))):
        path = draw.draw(st.sampled_from(paths))
        value = draw.draw(st.one_of(st.sampled_from(BIG), st.integers(-(1 << 63), (1 << 64) - 1), st.text(max_size=8),
                                    st.none(), st.booleans(), st.lists(st.integers(0, 1 << 40), max_size=3)))
        _set(raw, path, value)
    _decodes_or_refuses(msgspec.msgpack.encode(raw))


def _hostile(shape: list[int], world: int, chunk_bytes: int, chunks: int, split: bool) -> bytes:
    raw = msgspec.msgpack.decode(manifests()[0])
    raw["table"] = [["w", "float64", shape, 0]]
    raw["world_size"], raw["chunk_bytes"] = world, chunk_bytes
    raw["split_dims"] = {"w": 0} if split else {}
    raw["chunks"] = raw["chunks"][:1] * chunks
    raw["model_bytes"] = min(8 * math.prod(shape), (1 << 64) - 1)  # what the table says, as far as it fits
    return msgspec.msgpack.encode(raw)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 3, 1 << 20, 1 << 40]), max_size=4), st.sampled_from([1, 2, 1 << 16]),
       st.sampled_from([8, 1 << 20, 1 << 30, 1 << 32]), st.integers(0, 64), st.booleans())
def test_manifest_declaring_huge_layouts_allocates_nothing_for_them(shape, world, chunk_bytes, chunks, split) -> None:
    """2**40 elements, 65536 ranks, 2**32-byte chunks: refused (or laid out) in a few MB."""
    data = _hostile(shape, world, chunk_bytes, chunks, split)
    tracemalloc.start()
    try:
        _decodes_or_refuses(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20


def test_manifest_with_two_to_the_forty_chunks_is_refused_cheaply() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ZephonError):
            decode_manifest(_hostile([1 << 40], 1, 8, 1, False), "k")  # 2**40 chunks of 8 bytes declared
        with pytest.raises(ZephonError):
            decode_manifest(_hostile([1 << 16, 1 << 10], 1 << 16, 8, 64, True), "k")  # 65536 ranks
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


# -- safetensors header --------------------------------------------------------------------------

def _load_or_refuse(data: bytes) -> None:
    fd, name = tempfile.mkstemp(suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        for writable in (False, True):
            try:
                state = safetensors.load(name, writable=writable)
            except ZephonError as exc:
                assert "\n" not in str(exc)
                continue
            for t in state.values():
                assert t.numel() * t.element_size() <= len(data)
                t.view(-1).view(torch.uint8).sum()  # every byte of it readable
            del state
    finally:
        Path(name).unlink()


@FUZZ
@given(st.binary(max_size=256))
def test_safetensors_random_bytes(data: bytes) -> None:
    _load_or_refuse(data)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "BOOL", "F64", "I64", "F128", ""]) | _json_values,
    "shape": st.lists(st.integers(-2, 6), max_size=3) | _json_values,
    "data_offsets": st.lists(st.integers(-8, 80), min_size=2, max_size=2) | _json_values,
})


@FUZZ_FILES
@given(st.dictionaries(st.text(max_size=4), _entries | _json_values, max_size=4), st.integers(0, 96), st.integers(0, 3))
def test_safetensors_structured_headers(header: dict, data_bytes: int, pad: int) -> None:
    text = json.dumps(header).encode() + b" " * pad
    _load_or_refuse(struct.pack("<Q", len(text)) + text + bytes(range(256))[:data_bytes])


@FUZZ_FILES
@given(st.data())
def test_safetensors_mutated_valid_file(draw: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        safetensors.save(path, {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int8)})
        data = bytearray(path.read_bytes())
    for _ in range(draw.draw(st.integers(1, 6))):
        i = draw.draw(st.integers(0, len(data) - 1))
        data[i] = draw.draw(st.integers(0, 255))
    _load_or_refuse(bytes(data[: draw.draw(st.integers(0, len(data)))]))


@FUZZ_FILES
@given(st.binary(max_size=128) | st.just(b"[" * 200_000 + b"]" * 200_000) | st.just(b"1" * 5000)
       | st.builds(lambda v: json.dumps(v).encode(), _json_values) | st.builds(
    lambda m: json.dumps({"weight_map": m}).encode(),
    st.dictionaries(st.sampled_from(["a", "b", "c", ""]), st.sampled_from(
        ["w.safetensors", "x.safetensors", "../w.safetensors", "", "w.safetensors/", "nope"]) | _json_values,
        max_size=3)))
def test_safetensors_index_of_any_bytes_loads_or_is_one_line(data: bytes) -> None:
    """A sharded checkpoint's index names files beside it: whatever it holds, the load maps the
    files it names (beside it, holding what it says) or raises one ZephonError line."""
    with tempfile.TemporaryDirectory() as tmp:
        safetensors.save(Path(tmp) / "w.safetensors", {"a": torch.arange(6, dtype=torch.float32),
                                                        "b": torch.ones(3, dtype=torch.int8)})
        index = Path(tmp) / "model.safetensors.index.json"
        index.write_bytes(data)
        try:
            state = safetensors.load_index(index)
        except ZephonError as exc:
            assert "\n" not in str(exc)
            return
        assert sorted(state) == ["a", "b"] and state.files == [str(Path(tmp) / "w.safetensors")]


# -- local .refit record -------------------------------------------------------------------------

@functools.cache
def record_bytes() -> bytes:
    store, states = published()
    sub = Subscriber("p/", store=store)
    anyio.run(sub.pull, zeros_like(states[0]))
    return msgspec.msgpack.encode(sub.record)


@FUZZ
@given(st.binary(max_size=512))
def test_record_random_bytes(data: bytes) -> None:
    try:
        assert isinstance(decode_record(data, "r"), LocalRecord)
    except ZephonError:
        pass


@FUZZ
@given(st.data())
def test_record_mutated(draw: st.DataObject) -> None:
    data = bytearray(record_bytes())
    for _ in range(draw.draw(st.integers(1, 6))):
        i = draw.draw(st.integers(0, len(data) - 1))
        data[i] = draw.draw(st.integers(0, 255))
    try:
        decode_record(bytes(data[: draw.draw(st.integers(0, len(data)))]), "r")
    except ZephonError:
        pass


_records = st.builds(
    LocalRecord,
    version=st.sampled_from([0, 1, 2, 3, 1 << 40]),
    target=st.none() | st.sampled_from([1, 2, 3, 1 << 40]),
    geometry=st.sampled_from(["", "x"]),
    digests=st.lists(st.integers(0, (1 << 64) - 1), max_size=40),
    model_digest=st.integers(0, (1 << 64) - 1),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_records, st.booleans(), st.booleans())
def test_pull_with_any_decodable_record_gives_the_right_bytes(rec: LocalRecord, real_geometry: bool,
                                                              real_digests: bool) -> None:
    """A record that decodes but lies (versions, target, digests of any length) costs a
    re-verify, never wrong bytes or a raw exception."""
    store, states = published()
    good = msgspec.msgpack.decode(record_bytes(), type=LocalRecord)
    if real_geometry:
        rec = msgspec.structs.replace(rec, geometry=good.geometry)
    if real_digests:
        rec = msgspec.structs.replace(rec, digests=good.digests)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rec"
        path.write_bytes(msgspec.msgpack.encode(rec))
        replica = zeros_like(states[0])
        version = anyio.run(Subscriber("p/", store=store, record=path).pull, replica)
    assert version == 2
    assert_same(states[1], replica)
