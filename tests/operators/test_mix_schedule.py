"""Mix with weights by step (`Schedule`): counters restart at a change, state round trips, refusals."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import IncompatibleState
from zephon_stream.operators.mix import Mix, MixState, Schedule
from zephon_stream.testing.operators import ListSource, assert_roundtrip


def _docs(source: int, lengths: list[int]) -> list[tuple]:
    return [((source, 0, i * 100, 100), np.arange(n, dtype=np.uint32)) for i, n in enumerate(lengths)]


class _Empty(msgspec.Struct, frozen=True):
    pass


class Stepped:
    """The lane's part: before each document, tell Mix the step it is drawn for (here: one step
    per `per_step` documents)."""

    def __init__(self, mix: Mix, per_step: int) -> None:
        self.mix, self.per_step = mix, per_step

    async def next(self):
        self.mix.enter(self.mix.position // self.per_step)
        return await self.mix.next()

    def state(self) -> _Empty:
        return _Empty()

    def refs(self, state: _Empty) -> list:
        return []

    def restore(self, state: _Empty, resolve) -> None:
        pass


def _chain(sources, schedule: Schedule, per_step: int = 3):
    ups = [ListSource(s) for s in sources]
    mix = Mix(schedule, 7, 3, True, ups)
    return [*ups, mix, Stepped(mix, per_step)]


async def _drain(op, n: int | None = None) -> list:
    out = []
    while (n is None or len(out) < n) and (d := await op.next()) is not None:
        out.append(d)
    return out


def test_schedule_looks_up_the_weights_in_force() -> None:
    s = Schedule([(0, [1, 1]), (10, [1, 3]), (20, [2, 1])])
    assert [s.since(k) for k in (0, 9, 10, 19, 20, 10**9)] == [0, 0, 10, 10, 20, 20]
    assert s.at(10) == [1.0, 3.0] and s.at(11) is None


def test_schedule_drops_an_entry_that_changes_nothing() -> None:
    """A repeated decision (the weights already in force) must not restart the counters."""
    s = Schedule([(0, [1, 2]), (5, [1, 2]), (9, [2, 1]), (12, [2, 1])])
    assert s.steps == [0, 9]


@pytest.mark.parametrize(("entries", "match"), [
    ([(3, [1, 1])], "needs weights at step 0"),
    ([(0, [1, 1]), (4, [1])], "one finite weight >= 0 per source, one of them > 0"),
    ([(0, [0, 0])], "one finite weight >= 0 per source, one of them > 0"),
    ([(0, [1, -1])], "one finite weight >= 0 per source, one of them > 0"),
    ([(0, [1, float("inf")])], "one finite weight >= 0 per source, one of them > 0"),
])
def test_schedule_refuses_bad_entries(entries, match) -> None:
    with pytest.raises(ValueError, match=match):
        Schedule(entries)


def test_counters_restart_at_a_change_and_the_new_weights_hold_from_there() -> None:
    """After the change the documents drawn track 1:3, not a cumulative mix of 3:1 and 1:3."""
    sources = [_docs(0, [10] * 400), _docs(1, [10] * 400)]
    mix = _chain(sources, Schedule([(0, [3, 1]), (40, [1, 3])]), per_step=1)[-1]
    docs = anyio.run(_drain, mix, 200)
    before = [d[0][0] for d in docs[:40]]
    after = [d[0][0] for d in docs[40:]]
    assert abs(before.count(0) - 30) <= 1
    assert abs(after.count(1) - 120) <= 1  # 160 drawn since the change: 3/4 of them from source 1
    assert mix.mix.state().since == 40 and mix.mix.state().base == mix.mix.state().counts[:0] + [
        sum(len(d[1]) for d in docs[:40] if d[0][0] == s) for s in (0, 1)]


def test_a_weight_of_0_pauses_a_source_until_the_weighted_ones_end() -> None:
    """From the change on no document of the paused source is drawn while the others have some;
    then its rest comes, so every document still appears once; and again after a restart."""
    sources = [_docs(0, [10] * 30), _docs(1, [10] * 20), _docs(2, [10] * 10)]
    mix = _chain(sources, Schedule([(0, [1, 1, 1]), (10, [0, 2, 1]), (40, [0, 0, 1])]), per_step=1)[-1]
    got = [d[0][0] for d in anyio.run(_drain, mix)]
    assert sorted(got) == [0] * 30 + [1] * 20 + [2] * 10
    first_10 = got[:10]
    assert set(first_10) == {0, 1, 2}
    resumed = got[10:].index(0) + 10  # source 0 comes back only after 1 and 2 ended
    assert 1 not in got[resumed:] and 2 not in got[resumed:] and set(got[resumed:]) == {0}
    assert got.count(1) == 20 and got.count(2) == 10


@pytest.mark.parametrize("per_step", [1, 2, 5])
def test_roundtrip_at_every_point_across_changes(per_step: int) -> None:
    sources = [_docs(0, [5, 9, 2, 7, 3, 3, 8]), _docs(1, [30, 1, 4, 6]), _docs(2, [3] * 6)]
    schedule = Schedule([(0, [1, 2, 0.5]), (2, [3, 1, 1]), (4, [0.2, 0, 5])])
    n = anyio.run(lambda: assert_roundtrip(lambda: _chain(sources, schedule, per_step), resolve=lambda r: None))
    assert n == sum(map(len, sources))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), max_size=25), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(1, 30), st.lists(st.floats(0.1, 10) | st.just(0.0), min_size=3, max_size=3)),
                max_size=4),
       st.integers(1, 4))
def test_every_document_once_whatever_the_schedule(lengths, changes, per_step) -> None:
    n = len(lengths)
    sources = [_docs(s, ls) for s, ls in enumerate(lengths)]
    schedule = Schedule([(0, [1.0] * n)] + [(step, ws[:n]) for step, ws in changes if any(ws[:n])])
    got = [d[0] for d in anyio.run(_drain, _chain(sources, schedule, per_step)[-1])]
    assert sorted(got) == sorted(d[0] for s in sources for d in s)
    for s in range(n):
        assert [r for r in got if r[0] == s] == [d[0] for d in sources[s]]


def test_a_state_written_before_schedules_reads_as_step_0_weights() -> None:
    """Checkpoints from before schedules existed (two fields) still load."""
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([[3, 4], 2]), type=MixState) == MixState([3, 4], 2, 0, [])


def test_restore_refuses_a_change_this_run_does_not_have() -> None:
    mix = Mix(Schedule([(0, [1, 1]), (5, [1, 2])]), 7, 3, True, [ListSource([]), ListSource([])])
    with pytest.raises(IncompatibleState, match=r"mix.since = 4: weights change only at steps \[0, 5\]"):
        mix.restore(MixState([3, 3], 2, 4, [1, 1]), lambda r: None)
    with pytest.raises(IncompatibleState, match=r"mix.base = \[4, 1\]: needs one count per source, each in"):
        mix.restore(MixState([3, 3], 2, 5, [4, 1]), lambda r: None)
    mix.restore(MixState([3, 3], 2, 5, [1, 2]), lambda r: None)
    assert mix.weights == [1.0, 2.0] and mix.base == [1, 2]
