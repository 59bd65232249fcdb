"""Mixtures through the loader: schedules and set_weights across the determinism matrix, the
decision log in checkpoints, visibility (source_tokens, statistics, inspect) and the 1-point goal.

A run whose trainer calls `set_weights(w, at_step=b)` at any time before step `b` must give
the batches of the run whose config has the schedule entry `(b, w)`: that is the baseline."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path

import msgspec
import pytest

from zephon_stream import ConfigError, IncompatibleState
from zephon_stream.cli.main import main
from zephon_stream.loader.config import Config, ScheduleEntry, SourceConfig
from zephon_stream.loader.loader import BatchStream, Loader
from zephon_stream.loader.state import check_lane_state
from zephon_stream.operators.collate import source_tokens
from zephon_stream.operators.shuffle import ShuffleState
from zephon_stream.testing.determinism import batch_records, run_world

from .conftest import batches_to, write_jsonl

STEPS = 16
W0 = {"a": 0.0, "b": 1.0}  # a paused
W1 = {"a": 0.1, "b": 0.9}
W2 = {"a": 0.5, "b": 0.5}
# (after the rank consumed this many steps, weights, at_step): two decisions, one made long before its
# step; the first pauses source a, the second brings it back
CALLS = [(2, W0, 6), (7, W2, 11)]


def _scheduled(config: Config, calls=CALLS) -> Config:
    return config.with_decisions([ScheduleEntry(b, w) for _, w, b in calls])


def run_calls(config: Config, dp_size: int, stop: int, *, backend: str, calls=CALLS, resume=None):
    """Every rank to global step `stop`, each making the `calls` as a trainer would (between batches)."""
    records, states = [], []
    for rank in range(dp_size):
        loader = Loader(config, dp_rank=rank, dp_size=dp_size, backend=backend)
        if resume:
            loader.load_state_dict(resume)

        def decide(loader=loader) -> None:
            for after, weights, at in calls:
                if after == loader.step:
                    loader.set_weights(weights, at_step=at)

        decide()
        if loader.step < stop:
            for batch in loader:
                records += batch_records(batch)
                decide()
                if loader.step == stop:
                    break
        states.append(loader.state_dict())
    return sorted(records, key=lambda r: r[1]), states


@pytest.fixture(params=["lane", "source"])
def mixing(config, request):
    """The conftest config with one shuffle window per lane after the mix, or one per source before it."""
    return config.replace(shuffle_scope=request.param)


@pytest.fixture()
def scheduled(mixing):
    return _scheduled(mixing)


_INLINE: dict[tuple[str, int], list] = {}  # (config TOML, steps) -> records (runs are pure functions of both)


def _inline(config: Config, steps: int = STEPS) -> list:
    """The records of the single-rank inline run of `config` to `steps`, computed once per session."""
    key = (config.to_toml(), steps)
    if key not in _INLINE:
        _INLINE[key] = run_world(config, 1, steps, backend="inline")[0]
    return list(_INLINE[key])


@pytest.fixture()
def baseline(mixing, scheduled):
    records, plain = _inline(scheduled), _inline(mixing)
    assert [r for r in records if r[0] < 6] == [r for r in plain if r[0] < 6]  # before the first change: unchanged
    assert [r for r in records if r[0] >= 6] != [r for r in plain if r[0] >= 6]
    return records


@pytest.mark.parametrize(("dp_size", "backend"), [(1, "threads"), (3, "inline"), (4, "threads"), (2, "processes")])
def test_scheduled_run_across_world_sizes_and_backends(scheduled, baseline, dp_size, backend):
    assert run_world(scheduled, dp_size, STEPS, backend=backend)[0] == baseline


@pytest.mark.parametrize(("cut", "before", "after"), [(5, (4, "threads"), (2, "processes")),
                                                      (6, (2, "inline"), (3, "threads")),
                                                      (12, (6, "threads"), (1, "inline"))])
def test_scheduled_run_resumed_onto_other_world(scheduled, baseline, cut, before, after):
    first, states = run_world(scheduled, before[0], cut, backend=before[1])
    rest, _ = run_world(scheduled, after[0], STEPS - cut, backend=after[1], resume=states)
    assert first + rest == baseline


@pytest.mark.parametrize(("dp_size", "backend"), [(1, "threads"), (1, "inline"), (3, "threads"), (2, "processes")])
def test_set_weights_gives_the_scheduled_batches(mixing, baseline, dp_size, backend):
    """Lanes that ran ahead past the decided step go back; batches before it are unchanged."""
    assert run_calls(mixing, dp_size, STEPS, backend=backend)[0] == baseline


@pytest.mark.parametrize("backend", ["inline", "threads", "processes"])
def test_decisions_for_the_next_step_and_one_far_ahead(mixing, backend):
    """Lanes go back to their state at the decided step: none of what they made ahead is kept for
    the next step, all of it for a step past their read-ahead; several calls before a batch too."""
    calls = [(3, W1, 3), (5, W2, 40), (5, W1, 30), (8, W2, 9)]
    want = _inline(_scheduled(mixing, calls), 12)
    assert run_calls(mixing, 2 if backend == "processes" else 1, 12, backend=backend, calls=calls)[0] == want


@pytest.mark.parametrize(("cut", "after"), [(4, (3, "threads")), (8, (2, "processes")), (9, (6, "inline"))])
def test_resume_between_a_call_and_its_step(mixing, baseline, cut, after):
    """Checkpoints at 4, 8 and 9 fall between a call (after step 2 / 7) and its step (6 / 11). The
    resumed trainer makes only the calls still to come (none after 8 or 9): the log holds the rest."""
    first, states = run_calls(mixing, 2, cut, backend="threads")
    rest, _ = run_calls(mixing, after[0], STEPS, backend=after[1], resume=states)
    assert first + rest == baseline


def test_the_resumed_trainer_repeating_its_calls_changes_nothing(mixing, baseline):
    first, states = run_calls(mixing, 2, 9, backend="threads")
    repeat = [(9, w, b) for _, w, b in CALLS]  # a trainer that replays its whole log at start: b=6 is consumed
    rest, _ = run_calls(mixing, 3, STEPS, backend="threads", calls=repeat, resume=states)
    assert first + rest == baseline


# decided for the very step being made: 3 and 8 (the call lands while batch 3 / 8 is in the making)
WHILE_MADE = [(3, W1, 3), (8, W2, 8)]


@pytest.mark.parametrize("backend", ["inline", "threads", "processes"])
def test_set_weights_from_another_task_while_a_batch_is_made(mixing, backend):
    """An async trainer whose other task decides the weights: the call lands while `__anext__` is
    taking the samples of the very step decided. That batch is made again with the new weights
    (it was made with the old ones, then the next batch failed or differed from the log's)."""
    async def main() -> list:
        loader, records = Loader(mixing, backend=backend), []
        async with loader.open() as stream:
            while loader.step < 12:
                decided = [(w, b) for after, w, b in WHILE_MADE if after == loader.step]
                wait = asyncio.ensure_future(stream.__anext__())
                while decided and not stream.taken:  # the batch is being made: some samples taken
                    assert not wait.done()
                    await asyncio.sleep(0)
                for weights, at in decided:
                    loader.set_weights(weights, at_step=at)
                records += batch_records(await wait)
        return records

    assert asyncio.run(main()) == _inline(_scheduled(mixing, WHILE_MADE), 12)


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_set_weights_from_another_thread_before_the_batch_is_handed_out(mixing, backend, monkeypatch):
    """A `for` loop, and a call from another thread that lands after the batch of its step was made,
    before the loop hands it out (the batch counts as consumed only then): it is made again."""
    loader = Loader(mixing, backend=backend)
    made = BatchStream.next_batch

    async def made_then_decided(stream: BatchStream) -> dict:
        batch = await made(stream)
        for after, weights, at in WHILE_MADE:
            if after == batch["step"] == loader.step and loader.decisions[-1:] != [ScheduleEntry(at, weights)]:
                caller = threading.Thread(target=loader.set_weights, args=(weights,), kwargs={"at_step": at})
                caller.start()
                caller.join()
        return batch

    monkeypatch.setattr(BatchStream, "next_batch", made_then_decided)
    records = []
    for batch in loader:
        records += batch_records(batch)
        if loader.step == 12:
            break
    assert len(loader.decisions) == 2 and records == _inline(_scheduled(mixing, WHILE_MADE), 12)


def test_decision_log_grows_one_entry_per_call(config):
    loader = Loader(config, backend="inline")
    sizes = [len(loader.state_dict()["meta"])]
    for b in range(1, 6):
        loader.set_weights({"a": 1.0 / b, "b": 1.0}, at_step=b)
        sizes.append(len(loader.state_dict()["meta"]))
    loader.set_weights({"a": 1.0 / 5, "b": 1.0}, at_step=5)  # a repeat: no entry
    assert len(loader.decisions) == 5 and len(loader.state_dict()["meta"]) == sizes[-1]
    growth = [b - a for a, b in zip(sizes, sizes[1:])]
    assert max(growth[1:]) <= 40, f"bytes per entry: {growth}"  # a small, fixed-size record per call


def test_a_decision_for_a_consumed_step_is_refused(config):
    loader = Loader(config, backend="inline")
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(ConfigError, match=r"set_weights\(at_step=2\): step 2 was already consumed .* batches "
                                          r"0\.\.2\); decide for a step >= 3"):
        loader.set_weights(W1, at_step=2)
    loader.set_weights(W1, at_step=3)  # the next batch's step is still open
    assert next(it)["step"] == 3
    it.close()


@pytest.mark.parametrize(("weights", "step", "match"), [
    ({"a": 1.0}, 3, r"must give a weight to each source, by name: \['a', 'b'\] \(no weight for 'b': 0 pauses"),
    ({"a": 1.0, "b": 1.0, "c": 1.0}, 3, "must give a weight to each source"),
    ({"a": 1.0, "c": 1.0}, 3, r"must give a weight to each source, by name: \['a', 'b'\] \('c' is not one\)"),
    ({"a": 0.0, "b": 0.0}, 3, r"weights = \{'a': 0.0, 'b': 0.0\}: one source needs a weight > 0"),
    ({"a": -1.0, "b": 1.0}, 3, r"weights.a = -1.0: must be a number >= 0 \(weights are relative; 0 pauses"),
    ({"a": float("nan"), "b": 1.0}, 3, r"weights.a = nan: must be a number >= 0"),
    ({"a": 1.0, "b": 1.0}, -1, r"at_step = -1: must be a global step"),
    ({"a": 1.0, "b": 1.0}, True, r"at_step = True: must be a global step"),
])
def test_bad_decisions_are_refused(config, weights, step, match):
    loader = Loader(config, backend="inline")
    with pytest.raises(ConfigError, match=match):
        loader.set_weights(weights, at_step=step)
    assert loader.decisions == []


def test_ranks_with_different_logs_are_refused(config):
    a, b = Loader(config, dp_rank=0, dp_size=2), Loader(config, dp_rank=1, dp_size=2)
    a.set_weights(W1, at_step=4)
    with pytest.raises(IncompatibleState, match="rank states hold different set_weights logs"):
        Loader(config, backend="inline").load_state_dict([a.state_dict(), b.state_dict()])


def test_a_log_for_other_sources_is_refused(config):
    loader = Loader(config)
    loader.set_weights(W1, at_step=4)
    state = loader.state_dict()
    renamed = config.replace(sources=[config.sources[0], SourceConfig(name="c", uri=config.sources[1].uri,
                                                                      weight=config.sources[1].weight)])
    other = Loader(renamed)
    other.order_digest = loader.order_digest  # only the log differs
    other.order_settings = loader.order_settings
    with pytest.raises(IncompatibleState, match=r"meta field decisions .*must give a weight to each source"):
        other.load_state_dict(state)


def test_schedule_in_toml_round_trips_and_is_validated(config, tmp_path):
    cfg = _scheduled(config)
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert Config.from_toml(path) == cfg
    assert "[[schedule]]\nstep = 6\nweights = { \"a\" = 0.0, \"b\" = 1.0 }" in cfg.to_toml()
    assert cfg.order_digest("t") != config.order_digest("t")
    path.write_text(config.to_toml() + "\n[[schedule]]\nstep = 4\nweights = { a = 1.0 }\n")
    with pytest.raises(ConfigError, match=r"schedule\[step=4\].weights = \{'a': 1.0\}: must give a weight"):
        Config.from_toml(path)
    path.write_text(config.to_toml() + "\n[[schedule]]\nstep = 4\nweights = { a = 1.0, b = 1 }\n"
                    "\n[[schedule]]\nstep = 4\nweights = { a = 2.0, b = 1 }\n")
    with pytest.raises(ConfigError, match=r"schedule = \[4, 4\]: steps must be strictly increasing"):
        Config.from_toml(path)


def test_a_paused_source_draws_nothing_until_its_weight_comes_back(config):
    """With one shuffle window per source (before the mix), no document of a paused source is
    drawn: its tokens stop once the samples of the step before the pause are done; the config's
    own weight 0 holds a source out from step 0; with max_epochs its documents come last."""
    cfg = _scheduled(config.replace(shuffle_scope="source"))
    per_step = [sum(row["a"] for row in source_tokens(b, ["a", "b"])) for b in batches_to(Loader(cfg), STEPS)]
    assert all(per_step[:6]) and not any(per_step[8:11]) and all(per_step[12:]), per_step
    a, b = config.sources
    held = config.replace(shuffle_scope="source", sources=[msgspec.structs.replace(a, weight=0.0), b])
    assert not any(sum(row["a"] for row in source_tokens(x, ["a", "b"])) for x in batches_to(Loader(held), 8))
    once = held.replace(max_epochs=1)
    tokens = [sum(row["a"] for row in source_tokens(x, ["a", "b"])) for x in Loader(once)]
    first_a = next(i for i, n in enumerate(tokens) if n)
    assert first_a > 0 and all(tokens[first_a + 1:-1]), tokens  # after b ended: a alone, to its end
    weighted = config.replace(shuffle_scope="source", max_epochs=1)
    assert sum(tokens) == sum(sum(row["a"] for row in source_tokens(x, ["a", "b"])) for x in Loader(weighted))
    assert Loader(once).statistics().weights == {"a": 0.0, "b": 1.0}


def test_source_tokens_and_realized_shares(config):
    loader = Loader(config, backend="inline")
    totals = {"a": 0, "b": 0}
    for batch in loader:
        for row, n in zip(source_tokens(batch, ["a", "b"]), batch["num_tokens"].tolist()):
            assert sum(row.values()) == n  # every real token has a source
            for k, v in row.items():
                totals[k] += v
        if loader.step == 6:
            break
    stats = loader.statistics()
    assert stats.source_tokens == totals and totals["a"] > 0 and totals["b"] > 0
    assert stats.source_shares["a"] == pytest.approx(totals["a"] / sum(totals.values()))
    assert stats.weights == {"a": 0.6, "b": 0.4}
    loader.set_weights(W1, at_step=6)
    assert loader.statistics().weights == W1


def test_cli_set_weights_digests_and_inspect(config, tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml())
    state = tmp_path / "s.state"
    assert main(["stream", str(path), "--steps", "12", "--digests", "--save-state", str(state), "--save-at", "8",
                 "--set-weights", "6:a=0,b=1", "--set-weights", "11:a=0.5,b=0.5"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    want, _ = run_world(_scheduled(config), 1, 12, backend="inline")
    assert [(d["step"], d["slot"], d["lane"], d["tokens"], d["sha256"]) for d in lines] == want
    assert all(set(d["source_tokens"]) == {"a", "b"} and sum(d["source_tokens"].values()) == d["tokens"]
               for d in lines)
    # the checkpoint carries the log: a resumed run needs no --set-weights, and repeating them is a no-op
    for extra in ([], ["--set-weights", "6:a=0,b=1"]):
        assert main(["stream", str(path), "--steps", "12", "--digests", "--resume", str(state), *extra]) == 0
        assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == [d for d in lines if d["step"] >= 8]
    assert main(["inspect", str(path), "--step", "7", "--set-weights", "6:a=0.1,b=0.9"]) == 0
    out = capsys.readouterr().out
    assert "⟦b⟧" in out and "⟦a⟧" in out
    with pytest.raises(SystemExit) as exit_:  # argparse took "-1:..." for an option: "expected one argument"
        main(["stream", str(path), "--steps", "1", "--set-weights", "-1:a=1,b=1"])
    assert exit_.value.code == 2 and "--set-weights: -1 is negative: give a step >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # a name given twice: the second weight won silently
        main(["stream", str(path), "--steps", "1", "--set-weights", "5:a=1,a=2,b=1"])
    assert exit_.value.code == 2 and "'5:a=1,a=2,b=1' gives a twice: give each source's weight once" in \
        capsys.readouterr().err


# ---- the 1-point goal ---------------------------------------------------------------------------------

SPAN, SETTLE = 100, 10


def _mixture_data(root: Path) -> None:
    """Two sources of different document lengths (prose-like and code-like), 12 shards each."""
    rng = random.Random(11)
    words = "the of and to in is that for it as with was on be by this are loader lane token".split()
    for name, (lo, hi) in (("a", (20, 200)), ("b", (60, 600))):
        (root / name).mkdir(parents=True)
        for shard in range(12):
            docs = [" ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))) for _ in range(150)]
            write_jsonl(root / name / f"{name}-{shard}.jsonl", docs)


def worst_gap(config: Config, steps: int) -> tuple[float, list[float]]:
    """The largest |share - weight| (points) over windows of SPAN steps from SETTLE steps past a change."""
    names = [s.name for s in config.sources]
    per_step = []
    with Loader(config, backend="threads") as loader:
        for batch in loader:
            per_step.append([sum(row[n] for row in source_tokens(batch, names)) for n in names])
            if loader.step == steps:
                break
    changes = config.weights_by_step()
    gaps = []
    for (start, weights), (end, _) in zip(changes, changes[1:] + [(steps, None)]):
        for first in range(start + SETTLE, end - SPAN + 1):
            window = per_step[first:first + SPAN]
            total = sum(map(sum, window))
            gaps.append(max(abs(sum(t[s] for t in window) / total - weights[s] / sum(weights)) for s in
                            range(len(names))) * 100)
    return max(gaps), gaps


def test_realized_shares_within_one_point_at_12_lanes(dataset, tmp_path):
    """shuffle_scope = "source": every window of 100 steps from 10 steps past a change (step 0 and
    step 115) is within 1 point of the weights, for both sources."""
    root, _ = dataset
    _mixture_data(tmp_path)
    change = SETTLE + SPAN + 5
    sources = [SourceConfig(name="a", uri=f"file://{tmp_path}/a/", weight=0.7),
               SourceConfig(name="b", uri=f"file://{tmp_path}/b/", weight=0.3)]
    config = Config(seed=99, lanes=12, seq_len=1024, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                    split_bytes=16384, shuffle_scope="source", sources=sources,
                    schedule=[ScheduleEntry(change, {"a": 0.3, "b": 0.7})])
    worst, gaps = worst_gap(config, change + SETTLE + SPAN + 5)
    assert len(gaps) == 12
    assert worst < 1.0, f"realized shares off by up to {worst:.2f} points"


def test_per_source_windows_are_checked(config):
    cfg = config.replace(shuffle_scope="source")
    loader = Loader(cfg, backend="inline")
    it = iter(loader)
    for _ in range(6):
        next(it)
    it.close()
    ls = next(ls for ls in loader.frontier.lanes.values() if all(w.window for w in ls.shuffles))
    assert len(ls.shuffles) == 2 and ls.shuffle == ShuffleState([], 0)
    check_lane_state(ls, cfg)
    with pytest.raises(IncompatibleState, match=f'lane {ls.lane} state field shuffles = .*shuffle_scope = "source"'):
        check_lane_state(ls, config)
    a, b = ls.shuffles
    more = msgspec.structs.replace(ls, shuffles=[msgspec.structs.replace(a, pulls=a.pulls + 1), b])
    with pytest.raises(IncompatibleState, match=r"the pulls of the sources' windows must add up to mix.position"):
        check_lane_state(more, cfg)
    mixed = msgspec.structs.replace(ls, shuffles=[msgspec.structs.replace(a, window=a.window[:-1] + b.window[:1]), b])
    with pytest.raises(IncompatibleState, match=r"shuffles\[0\].window = .*holds only documents of source 0"):
        check_lane_state(mixed, cfg)
    with pytest.raises(IncompatibleState, match=r"shuffle_scope: 'lane' in the checkpoint, 'source' now"):
        Loader(cfg).load_state_dict(Loader(config).state_dict())
