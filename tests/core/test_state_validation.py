"""A lane state is checked field by field against the config and the data before it is used.

Every hand edit below once changed the stream silently or failed with a raw IndexError or
ValueError; each must now be refused with `IncompatibleState` naming the lane and the field.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from zephon_stream import CheckpointError, IncompatibleState
from zephon_stream.engine.rng import permutation
from zephon_stream.loader.lane import Lanes
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.state import LaneState, LoaderState, check_lane_state, lane_key, split_at
from zephon_stream.operators.feed import FeedState

Edit = Callable[[LaneState], LaneState]
rep = msgspec.structs.replace


@pytest.fixture(scope="module")
def base(dataset) -> Any:
    """A config with max_epochs = 1 and the state of its run at the first step (of 20) where lane 0
    has a full window, a carried document of source 1, and cursors into both sources (source 0 is JSONL)."""
    from tests.core.conftest import Config, SourceConfig

    root, _ = dataset
    cfg = Config(seed=1234, lanes=12, seq_len=64, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                 shuffle_window=8, split_bytes=4096, sample_batch=2, max_epochs=1,
                 sources=[SourceConfig(name="a", uri=f"file://{root}/a/", weight=0.6),
                          SourceConfig(name="b", uri=f"file://{root}/b/", weight=0.4)])
    loader = Loader(cfg, backend="inline")
    it = iter(loader)
    for _ in range(20):
        next(it)
        state = loader.state_dict()
        lane0 = LoaderState.from_dict(state).lane_states[0]
        if (lane0.shuffle.window and lane0.pack.carry is not None and lane0.pack.carry[0] == 1
                and lane0.sources[0].offset > 0):
            it.close()
            return cfg, state, lane0
    raise AssertionError("no step of the first 20 gives lane 0 the state the tests need")


def _with(state: dict[str, bytes], ls: LaneState, key: str | None = None) -> dict[str, bytes]:
    out = dict(state)
    out[key or lane_key(ls.lane)] = msgspec.msgpack.encode(ls)
    return out


def _start(cfg: Any, state: dict[str, bytes] | list[dict[str, bytes]]) -> None:
    """Load `state` and start streaming (which plans the data and checks the state against it)."""
    loader = Loader(cfg, backend="inline")
    loader.load_state_dict(state)
    it = iter(loader)
    try:
        next(it)
    finally:
        it.close()


def _mix(ls: LaneState, **changes: Any) -> LaneState:
    return rep(ls, mix=rep(ls.mix, **changes))


def _shuffle(ls: LaneState, **changes: Any) -> LaneState:
    return rep(ls, shuffle=rep(ls.shuffle, **changes))


def _pack(ls: LaneState, **changes: Any) -> LaneState:
    return rep(ls, pack=rep(ls.pack, **changes))


def _window(ls: LaneState, i: int, ref: tuple[int, int, int, int]) -> LaneState:
    window = list(ls.shuffle.window)
    window[i] = ref
    return _shuffle(ls, window=window)


def _cursor(ls: LaneState, s: int, cursor: tuple[int, int]) -> LaneState:
    sources = list(ls.sources)
    sources[s] = FeedState(*cursor)
    return rep(ls, sources=sources)


def _longer_window(ls: LaneState) -> LaneState:
    """More (distinct, already read) documents in the window than shuffle_window = 8 (the window
    grows as it is drawn from: it may not be full yet), counters kept consistent."""
    extra = [(0, 0, off, 1) for off in range(9 - len(ls.shuffle.window))]
    return _mix(_shuffle(ls, window=list(ls.shuffle.window) + extra), position=ls.mix.position + len(extra))


def _at(ls: LaneState, s: int) -> int:
    return ls.sources[s].offset


EDITS: list[tuple[str, Edit, str]] = [
    ("negative samples", lambda ls: rep(ls, samples=-1), r"field samples = -1"),
    ("negative position", lambda ls: _mix(ls, position=-1), r"field mix.position = -1"),
    ("negative pulls", lambda ls: _shuffle(ls, pulls=-1), r"field shuffle.pulls = -1"),
    ("pulls that do not add up", lambda ls: _shuffle(ls, pulls=ls.shuffle.pulls + 1),
     r"field shuffle.pulls = .*must equal mix.position"),
    ("negative carry offset", lambda ls: _pack(ls, offset=-1), r"field pack.offset = -1"),
    ("done while data remains", lambda ls: rep(ls, done=True), r"field done = True"),
    ("a cursor missing", lambda ls: rep(ls, sources=ls.sources[:1]), r"field sources = .*one cursor per source"),
    ("a negative cursor", lambda ls: _cursor(ls, 0, (-1, _at(ls, 0))), r"field sources\[0\] = \(-1,"),
    ("a cursor reset", lambda ls: _cursor(ls, 0, (0, 0)), r"field sources\[0\] = \(0, 0\): mix.counts\[0\]"),
    ("a count missing", lambda ls: _mix(ls, counts=ls.mix.counts[:1]),
     r"field mix.counts = .*one count >= 0 per source"),
    ("a negative count", lambda ls: _mix(ls, counts=[-5, ls.mix.counts[1]]), r"field mix.counts = \[-5,"),
    ("counts below the documents taken", lambda ls: _mix(ls, counts=[1, 1]),
     r"field mix.counts = \[1, 1\]: .*mix.position"),
    ("a window over shuffle_window", _longer_window, r"field shuffle.window = .*shuffle_window = 8"),
    ("a duplicate window reference", lambda ls: _window(ls, 1, ls.shuffle.window[0]),
     r"field shuffle.window\[1\] = .*twice"),
    ("a window reference to no source", lambda ls: _window(ls, 0, (5, 0, 0, 10)),
     r"field shuffle.window\[0\] = \(5,"),
    ("a window reference of length 0", lambda ls: _window(ls, 0, (0, 0, 0, 0)),
     r"field shuffle.window\[0\] = \(0, 0, 0, 0"),
    ("a window reference not read yet", lambda ls: _window(ls, 0, (0, 0, _at(ls, 0), 10)),
     r"field shuffle.window\[0\] = .*past sources\[0\]"),
    ("a carry that is also in the window", lambda ls: _pack(ls, carry=ls.shuffle.window[0]),
     r"field pack.carry = .*twice"),
    ("a carry not read yet", lambda ls: _pack(ls, carry=(1, 0, _at(ls, 1), 5)),
     r"field pack.carry = .*past sources\[1\]"),
    ("a carry offset with nothing carried", lambda ls: _pack(ls, carry=None),
     r"field pack.offset = \d+: .*no document"),
    # against the data (the plan), once streaming starts
    ("a cursor past the last epoch", lambda ls: _cursor(ls, 0, (10**6, 5)),
     r"field sources\[0\] = \(1000000, 5\): split position 1000000 .* past the end of the data"),
    ("a cursor past its split's shard", lambda ls: _cursor(ls, 0, (0, 10**9)),
     r"field sources\[0\] = \(0, 1000000000\): .*outside"),
    ("a window reference outside its split",
     lambda ls: _window(_cursor(ls, 0, (1, 5)), 0, (0, 0, 10**6, 10)),
     r"field shuffle.window\[0\] = \(0, 0, 1000000, 10\).*outside"),
]


@pytest.mark.parametrize("name, edit, field", EDITS, ids=[e[0] for e in EDITS])
def test_a_hand_edited_field_is_refused_by_name(base, name, edit, field) -> None:
    cfg, state, lane0 = base
    with pytest.raises(IncompatibleState, match=field) as err:
        _start(cfg, _with(state, edit(lane0)))
    assert str(err.value).startswith("lane 0 state field"), str(err.value)


def test_the_unedited_state_loads(base) -> None:
    cfg, state, lane0 = base
    _start(cfg, _with(state, lane0))  # the helpers above change only what each edit names


def test_a_lane_id_out_of_range_or_under_another_name(base) -> None:
    cfg, state, lane0 = base
    with pytest.raises(IncompatibleState, match=r"lane 99 state field lane = 99: the config has lanes = 12"):
        _start(cfg, _with(state, rep(lane0, lane=99)))
    with pytest.raises(IncompatibleState, match=r"entry 'lane_0000' has lane field 1"):
        _start(cfg, _with(state, rep(lane0, lane=1), key="lane_0000"))


def test_a_negative_step_and_disagreeing_files(base) -> None:
    cfg, state, lane0 = base
    head = LoaderState.from_dict(state).header
    with pytest.raises(IncompatibleState, match=r"header field step = -1"):
        _start(cfg, {**state, "meta": msgspec.msgpack.encode(rep(head, step=-1))})
    step = LoaderState.from_dict(state).header.step
    means = rf"field samples = {lane0.samples + 1}: step {step} means {lane0.samples}"
    with pytest.raises(IncompatibleState, match=means):
        _start(cfg, _with(state, rep(lane0, samples=lane0.samples + 1)))
    other = _with(state, _mix(lane0, counts=[lane0.mix.counts[0] + 1, lane0.mix.counts[1]]))
    with pytest.raises(IncompatibleState, match="lane 0 has two different states"):
        _start(cfg, [state, other])
    _start(cfg, [state, state])  # the same files twice agree


def test_a_cursor_inside_a_record_is_refused_naming_the_field(base) -> None:
    cfg, state, lane0 = base
    p, off = lane0.sources[0].position, lane0.sources[0].offset
    with pytest.raises(IncompatibleState, match=r"lane 0 state field sources\[0\] = .*is not a record start"):
        _start(cfg, _with(state, _cursor(lane0, 0, (p, off + 3))))


def test_a_carry_offset_past_the_carried_document_is_refused(base) -> None:
    cfg, state, lane0 = base
    with pytest.raises(IncompatibleState, match=r"lane 0 state field pack.offset = 1000000: the carried document"):
        _start(cfg, _with(state, _pack(lane0, offset=10**6)))


def test_a_reference_whose_length_does_not_match_its_record_is_refused(base) -> None:
    cfg, state, lane0 = base
    s, p, off, n = lane0.pack.carry
    with pytest.raises(IncompatibleState, match=r"lane 0 state field window or carry = .*no such documents"):
        _start(cfg, _with(state, _pack(lane0, carry=(s, p, off, n - 1))))


# ---- no false refusals: every state a run writes passes, against its plan ----------------------

@pytest.mark.parametrize("changes", [
    {},  # tokens mix, shuffle window 8, one epoch to the end: done lanes included
    {"mix": "documents", "shuffle_window": 0, "global_batch_size": 6},  # a step reads half the lanes
], ids=["tokens-window", "documents-no-window"])
def test_every_state_a_run_writes_passes(base, changes) -> None:
    cfg = base[0].replace(**changes)
    loader = Loader(cfg, backend="inline")
    checked = done = 0
    for _ in itertools.chain(loader, [None]):  # and once more after the end
        for ls in LoaderState.from_dict(loader.state_dict()).lane_states:
            check_lane_state(ls, cfg, loader.data_plan)
            checked += 1
            done += ls.done
    assert checked > 100 and done >= cfg.lanes, (checked, done)


def test_split_at_agrees_with_the_lanes_reader(base) -> None:
    cfg = base[0].replace(max_epochs=2)
    loader = Loader(cfg, backend="inline")
    it = iter(loader)
    next(it)
    it.close()
    plan = loader.data_plan
    lanes = Lanes(cfg, plan, [None, None], loader.tokenizer, None)
    for source, lane, position in itertools.product(range(2), (0, 5, 11), range(12)):
        splits = plan.sources[source].splits
        reader = lanes.reader(source, lane, position)
        at = split_at(len(splits), cfg.lanes, cfg.max_epochs, lane, position)
        if reader is None:
            assert at is None
        else:
            assert at is not None and reader.split == splits[permutation(len(splits), cfg.seed, source, at[0])[at[1]]]


def test_a_refusal_is_a_checkpoint_error() -> None:
    assert issubclass(IncompatibleState, CheckpointError)  # callers catching CheckpointError see every refusal
