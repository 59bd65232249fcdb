"""Fuzz the checkpoint decoders: any bytes end in a CheckpointError or a valid, checked state.

The path a state file takes is `state_from_bytes` -> `LoaderState.from_dict` (header, lane
entries) -> `Loader.load_state_dict` (compatibility, field checks) -> `check_lane_state` against
the plan. Random bytes, byte-level mutations of a real state file and field-level mutations of
its lane entries must never raise anything but a CheckpointError, and decoding hostile length
prefixes must not allocate what they declare.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_stream import CheckpointError
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.state import (
    LaneState,
    LoaderState,
    check_lane_state,
    state_from_bytes,
    state_to_bytes,
)
from zephon_stream.operators.feed import FeedState
from zephon_stream.operators.mix import MixState
from zephon_stream.operators.pack import PackState
from zephon_stream.operators.shuffle import ShuffleState

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
INTS = st.one_of(st.integers(-3, 3000), st.integers(-(1 << 63), (1 << 64) - 1))


@pytest.fixture(scope="module")
def run(dataset) -> Any:
    """A loader of the test dataset, its plan, and the bytes of a real state file after 3 steps."""
    from tests.core.conftest import Config, SourceConfig

    root, _ = dataset
    cfg = Config(seed=99, lanes=4, seq_len=64, global_batch_size=4, tokenizer=str(root / "tokenizer.json"),
                 shuffle_window=4, split_bytes=4096, max_epochs=1,
                 sources=[SourceConfig(name="a", uri=f"file://{root}/a/"),
                          SourceConfig(name="b", uri=f"file://{root}/b/")])
    loader = Loader(cfg, backend="inline")
    it = iter(loader)
    for _ in range(3):
        next(it)
    it.close()
    return Loader(cfg, backend="inline"), loader.data_plan, state_to_bytes(loader.state_dict())


def _apply(run: Any, blob: bytes) -> None:
    """Decode, load and check `blob` as a state file; a CheckpointError is a clean refusal."""
    loader, plan, _ = run
    try:
        state = state_from_bytes(blob)
        loaded = LoaderState.from_dict(state)
        loader.load_state_dict(state)
        for ls in loaded.lane_states:
            check_lane_state(ls, loader.config, plan)
    except CheckpointError:
        pass


def test_the_unmutated_state_file_loads(run) -> None:
    loader, plan, blob = run
    loader.load_state_dict(state_from_bytes(blob))
    for ls in LoaderState.from_dict(state_from_bytes(blob)).lane_states:
        check_lane_state(ls, loader.config, plan)


@FUZZ
@given(blob=st.binary(max_size=600))
def test_random_bytes(run, blob: bytes) -> None:
    _apply(run, blob)


@FUZZ
@given(data=st.data())
def test_byte_mutations_of_a_state_file(run, data: st.DataObject) -> None:
    blob = bytearray(run[2])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        kind = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if kind == "flip":
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            blob[i] = data.draw(st.sampled_from([0x00, 0x7F, 0xC0, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]))
        elif kind == "insert":
            blob[i:i] = data.draw(st.binary(min_size=1, max_size=9))
        elif kind == "delete":
            del blob[i:i + data.draw(st.integers(1, 9))]
        else:
            del blob[i:]
        if not blob:
            break
    _apply(run, bytes(blob))


_LANE_FIELDS = LaneState.__struct_fields__
_REF = st.tuples(INTS, INTS, INTS, INTS)
_FIELD_VALUES = {
    "lane": INTS, "samples": INTS, "done": st.booleans(),
    "sources": st.lists(st.builds(FeedState, INTS, INTS), max_size=3),
    "mix": st.builds(MixState, st.lists(INTS, max_size=3), INTS, INTS, st.lists(INTS, max_size=3)),
    "shuffle": st.builds(ShuffleState, st.lists(_REF, max_size=6), INTS),
    "shuffles": st.lists(st.builds(ShuffleState, st.lists(_REF, max_size=6), INTS), max_size=3),
    "pack": st.builds(PackState, st.none() | _REF, INTS),
}


@FUZZ
@given(data=st.data())
def test_field_mutations_of_lane_entries(run, data: st.DataObject) -> None:
    """Each lane entry decoded, some fields set to any value of their type (or of another), re-encoded."""
    state = state_from_bytes(run[2])
    for key in sorted(k for k in state if k.startswith("lane_")):
        fields = list(msgspec.msgpack.decode(state[key]))
        for name in data.draw(st.lists(st.sampled_from(_LANE_FIELDS), max_size=3)):
            i = _LANE_FIELDS.index(name)
            fields[i] = data.draw(_FIELD_VALUES[name] | st.sampled_from([None, "x", 1.5, [], [[1]], -1]))
        state[key] = msgspec.msgpack.encode(fields)
    _apply(run, state_to_bytes(state))


@FUZZ
@given(lane_state=st.builds(LaneState, **_FIELD_VALUES))
def test_any_lane_state_is_accepted_or_refused_by_field(run, lane_state: LaneState) -> None:
    loader, plan, _ = run
    try:
        check_lane_state(lane_state, loader.config, plan)
    except CheckpointError as exc:
        assert " state field " in str(exc), str(exc)


def _nest(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"


# msgpack prefixes that declare 4 GiB (str, bin, array, map) or deep nesting, with no data behind them
HOSTILE = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
           _nest(100_000)]


@pytest.mark.parametrize("payload", HOSTILE, ids=["str", "bin", "array", "map", "nested"])
def test_hostile_lengths_and_nesting_cost_no_memory(run, payload: bytes) -> None:
    meta = state_from_bytes(run[2])["meta"]
    order_at = meta.index(b"\xa5order")  # the header's free-form `order` map: nesting is legal there
    blobs = [payload, b"\x81\xa4meta" + payload,
             msgspec.msgpack.encode({"meta": meta[:order_at + 6] + b"\x81\xa1k" + payload}),
             msgspec.msgpack.encode({"meta": meta, "lane_0000": payload})]
    tracemalloc.start()
    try:
        for blob in blobs:
            _apply(run, blob)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_entries_that_are_not_bytes() -> None:
    for state in ({"meta": 10**12}, {"meta": None}, {1: b""}, [("meta", b"")], {"meta": "text"}):
        with pytest.raises(CheckpointError):
            LoaderState.from_dict(state)
