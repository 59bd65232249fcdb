"""User transforms and filters (`zephon_stream.operators.transforms`): what they do to the documents,
that a filter only removes documents (the order rules stay), counts, exactly once, functions passed
from Python, and the errors for bad paths and broken functions.

The determinism matrix for a filtered source is tests/core/test_transforms_matrix.py. The test
functions live in tests/core/transform_fns.py, importable by name in worker processes.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import anyio
import msgspec
import pytest

from tests.core import transform_fns as fns
from tests.core.test_formats_matrix import _plan
from zephon_stream import ConfigError, DataError, IncompatibleState
from zephon_stream.engine.rng import permutation
from zephon_stream.loader.config import Config, SourceConfig, TransformStep
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.state import LoaderState, split_at
from zephon_stream.operators.read import RecordCounts
from zephon_stream.operators.sources import make_parser, make_reader
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.transforms import Filter, Map, record_seed
from zephon_stream.testing.determinism import lane_documents, lane_token_streams, rank_records, run_world

STEPS = 24
FNS = "tests.core.transform_fns"


def step(kind: str, name: str) -> TransformStep:
    return TransformStep(**{kind: f"{FNS}:{name}"})


def with_steps(config: Config, **steps: list[TransformStep]) -> Config:
    """`config` with `transforms` set on the sources named."""
    return config.replace(sources=[msgspec.structs.replace(s, transforms=steps.get(s.name, s.transforms))
                                   for s in config.sources])


def records_of(config: Config, source: int, epoch: int = 0) -> tuple[list[tuple[int, int, object]], RecordCounts]:
    """Every (split, offset, payload) of `source`, split by split in plan order, through the loader's
    reader and parser (bound to `epoch`), and what the parser counted."""
    plan, stores = _plan(config)
    src = plan.sources[source]
    parser = make_parser(config, source, src)

    async def main():
        out = []
        for i, split in enumerate(src.splits):
            reader = make_reader(config, source, src, stores[source], split, None, parser.bad.at(epoch))
            async for pos, block in reader.blocks():
                out += [(i, off, payload) for off, _, payload in parser.parse(reader, pos, block)]
        return out
    return anyio.run(main), RecordCounts(dict(parser.bad.by_epoch), {source: dict(parser.bad.filtered_by_epoch)})


def texts(config: Config, source: int, epoch: int = 0) -> list[object]:
    return [payload for _, _, payload in records_of(config, source, epoch)[0]]


def bangs(docs: list[str]) -> int:
    return sum(d.endswith("!") for d in docs)


# ---- what they do to the documents ----------------------------------------------------------------

def test_maps_and_filters_change_the_documents(config, dataset):
    _, docs = dataset
    cfg = with_steps(config, a=[step("filter", "drop_bang"), step("map", "shout")])
    assert texts(cfg, 0) == ["LOUD " + d.upper() for d in docs["a"] if not d.endswith("!")]
    got, counts = records_of(cfg, 0)
    assert counts.filtered == {0: {0: bangs(docs["a"])}} and counts.skipped == {}
    assert texts(cfg, 1) == docs["b"]  # a source without transforms is untouched


def test_a_filter_may_answer_with_a_numpy_bool(config, dataset):
    _, docs = dataset
    cfg = with_steps(config, a=[step("filter", "drop_bang_numpy")])
    assert texts(cfg, 0) == [d for d in docs["a"] if not d.endswith("!")]


def test_steps_run_in_order(config, dataset):
    """shout then at_least_words counts the LOUD marker as a word: the other order does not."""
    _, docs = dataset
    first = with_steps(config, a=[step("map", "shout"), step("filter", "at_least_words")])
    second = with_steps(config, a=[step("filter", "at_least_words"), step("map", "shout")])
    assert texts(first, 0) == ["LOUD " + d.upper() for d in docs["a"] if len(d.split()) >= 7]
    assert texts(second, 0) == ["LOUD " + d.upper() for d in docs["a"] if len(d.split()) >= 8]


def test_parquet_records_hold_the_columns_read(parquet_config, dataset):
    """Parquet rows reach the steps as dicts of the columns read: `text`, or the struct `doc` (and
    `doc.body`, the dotted text field, under its own name)."""
    _, docs = dataset
    cfg = with_steps(parquet_config, a=[step("filter", "drop_bang"), step("map", "shout")],
                     b=[step("filter", "nested_lang_en")])
    assert texts(cfg, 0) == ["LOUD " + d.upper() for d in docs["a"] if not d.endswith("!")]
    assert texts(cfg, 1) == docs["b"]


def test_seeds_are_per_record_and_per_epoch(config, dataset):
    """A seeded map gets a seed of its own for each record, the same on every read of the record
    in an epoch, and a new one in the next epoch."""
    _, docs = dataset
    cfg = with_steps(config, a=[step("map", "seeded_word")])
    zero, again, one = texts(cfg, 0, epoch=0), texts(cfg, 0, epoch=0), texts(cfg, 0, epoch=1)
    assert zero == again
    assert [t.rsplit(" ", 1)[0] for t in zero] == docs["a"]
    assert len({t.rsplit(" ", 1)[1] for t in zero}) == 4  # the four words all drawn
    assert sum(a != b for a, b in zip(zero, one)) > len(zero) // 2
    seeds = {record_seed(cfg.seed, 0, 0, split, 0, off) for split, off, _ in records_of(cfg, 0)[0]}
    assert len(seeds) == len(zero)


def test_chat_payload_is_the_raw_messages_value(config, dataset):
    """For a chat source the payload is the `messages_field` value as decoded (the chat renderer
    checks it); a record without it is a bad record."""
    _, docs = dataset
    chat = SourceConfig(name="a", uri=config.sources[0].uri, messages_field="messages",
                        transforms=[step("map", "to_messages")])
    cfg = config.replace(sources=[chat])
    got = texts(cfg, 0)
    assert got[:2] == [fns.to_messages({"text": d})["messages"] for d in docs["a"][:2]]
    missing = cfg.replace(sources=[msgspec.structs.replace(chat, transforms=[])], on_bad_record="skip")
    got, counts = records_of(missing, 0)
    assert got == [] and counts.skipped == {0: len(docs["a"])}
    with pytest.raises(DataError, match="has no field 'messages'; the record's fields are 'id', 'text' \\(set on_bad"):
        records_of(missing.replace(on_bad_record="error"), 0)


def test_a_filter_acts_as_if_its_records_were_blank(config, dataset, tmp_path):
    """A filter changes which documents exist, not the order rules: the batches of a filtered run
    are byte-identical to those of an unfiltered run over the same shards with the filtered
    records blanked out (the same bytes, spaces: a blank line is no record, and every other record
    keeps its split and offset)."""
    root, _ = dataset
    blank = tmp_path / "a"
    blank.mkdir()
    for shard in sorted((root / "a").iterdir()):
        lines = shard.read_bytes().split(b"\n")
        kept = [ln if not ln or fns.drop_bang(msgspec.json.decode(ln)) else b" " * len(ln) for ln in lines]
        (blank / shard.name).write_bytes(b"\n".join(kept))
    filtered = with_steps(config, a=[step("filter", "drop_bang")])
    blanked = config.replace(sources=[msgspec.structs.replace(config.sources[0], uri=f"file://{blank}/"),
                                      config.sources[1]])
    want, _ = run_world(blanked, 1, STEPS, backend="inline")
    assert run_world(filtered, 1, STEPS, backend="inline")[0] == want
    assert run_world(filtered, 3, STEPS, backend="threads")[0] == want


# ---- counts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["inline", "threads", "processes"])
def test_filtered_records_counted_per_source_and_epoch(config, dataset, backend):
    _, docs = dataset
    cfg = with_steps(config, a=[step("filter", "drop_bang")]).replace(max_epochs=2)
    loader = Loader(cfg, backend=backend)
    for _ in loader:
        pass
    stats = loader.statistics()
    n = bangs(docs["a"])
    assert stats.filtered_records == {"a": 2 * n} and stats.filtered_by_epoch == {0: n, 1: n}, stats
    assert stats.skipped_records == 0


def _filtered_before(cfg: Config, plain: Config, states: list[dict]) -> int:
    """Records of source 0 that drop_bang drops before the lanes' cursors in `states` (one epoch)."""
    plan, _ = _plan(cfg)
    by_split = {}
    for split, off, text in records_of(plain, 0)[0]:
        by_split.setdefault(split, []).append((off, text))
    n_splits = len(plan.sources[0].splits)
    total = 0
    for state in states:
        for ls in LoaderState.from_dict(state).lane_states:
            cursor = ls.sources[0]
            for position in range(cursor.position + 1):
                at = split_at(n_splits, cfg.lanes, cfg.max_epochs, ls.lane, position)
                if at is None:
                    break
                split = permutation(n_splits, cfg.seed, 0, at[0])[at[1]]
                limit = cursor.offset if position == cursor.position else float("inf")
                total += sum(1 for off, text in by_split.get(split, []) if off < limit and text.endswith("!"))
    return total


def test_a_restore_re_read_counts_nothing_twice(config, dataset):
    """A resumed run counts the records its readers read from the cursors on; the documents its
    windows hold are read again, and the filtered records among them are not counted again."""
    _, docs = dataset
    plain = config.replace(sources=config.sources[:1], max_epochs=1, shuffle_window=6)
    cfg = with_steps(plain, a=[step("filter", "drop_bang")])
    _, states = run_world(cfg, 1, 4, backend="inline")
    loader = Loader(cfg, backend="inline")
    loader.load_state_dict(states)
    for _ in loader:
        pass
    before = _filtered_before(cfg, plain, states)
    assert 0 < before < bangs(docs["a"])
    assert loader.statistics().filtered_records == {"a": bangs(docs["a"]) - before}


# ---- exactly once -------------------------------------------------------------------------------

@pytest.mark.parametrize("dp_size", [1, 3])
def test_exactly_once_for_the_kept_documents(config, dataset, dp_size):
    """max_epochs = 1: every kept document, as the map made it, once; no filtered one."""
    _, docs = dataset
    cfg = with_steps(config.replace(max_epochs=1, sources=config.sources[:1]),
                     a=[step("filter", "drop_bang"), step("map", "shout")])
    tok = Tokenize(cfg.tokenizer, cfg.eos_token)
    batches = []
    for rank in range(dp_size):
        batches += list(Loader(cfg, dp_rank=rank, dp_size=dp_size, backend="threads"))
    got = Counter(d for s in lane_token_streams(batches).values() for d in lane_documents(s, tok.eos_id))
    kept = ["LOUD " + d.upper() for d in docs["a"] if not d.endswith("!")]
    assert got == Counter(tuple(ids.tolist()) for ids in tok(kept))


# ---- functions passed from Python -----------------------------------------------------------------

def test_functions_passed_from_python_are_their_import_paths(config):
    """Map(fn)/Filter(fn) become the steps a config names by path: the same batches, the same
    order digest, so a checkpoint of one resumes under the other (on any backend)."""
    by_path = with_steps(config, a=[step("filter", "drop_bang"), step("map", "shout")])
    py = {"a": [Filter(fns.drop_bang), Map(fns.shout)]}
    loader = Loader(config, backend="inline", transforms=py)
    assert loader.config.sources[0].transforms == by_path.sources[0].transforms
    assert loader.order_digest == Loader(by_path, backend="inline").order_digest
    base, _ = run_world(by_path, 1, 8, backend="inline")
    first, states = run_world(by_path, 1, 5, backend="inline")
    resumed = Loader(config, backend="processes", transforms=py)
    resumed.load_state_dict(states)
    assert first + rank_records(resumed, 3) == base


@pytest.mark.parametrize(("fn", "match"), [
    (lambda r: r, "is a lambda"),
    (None, "inside a function"),
    (fns.shout.__get__(object()), "not a module-level function"),
    (Counter(), "not a module-level function"),
])
def test_python_functions_that_workers_cannot_import_are_refused(fn, match):
    if fn is None:
        def fn(record):
            return record
    with pytest.raises(ConfigError, match=match):
        Map(fn)


def test_transforms_for_unknown_sources_or_unwrapped_functions_are_refused(config):
    with pytest.raises(ConfigError, match=r"no such source; the sources are \['a', 'b'\]"):
        Loader(config, transforms={"c": [Map(fns.shout)]})
    with pytest.raises(ConfigError, match="wrap each function as Map"):
        Loader(config, transforms={"a": [fns.shout]})


def test_a_main_function_is_refused_on_ray(config, monkeypatch):
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "zephon_test_fn", fns.shout, raising=False)
    cfg = config.replace(sources=[msgspec.structs.replace(config.sources[0],
                                                          transforms=[TransformStep(map="__main__:zephon_test_fn")])])
    Loader(cfg, backend="threads")  # imports here
    with pytest.raises(ConfigError, match="Ray actors do not import the driver's script"):
        Loader(cfg, backend="ray")


def test_other_transforms_are_another_order(config):
    filtered = with_steps(config, a=[step("filter", "drop_bang")])
    _, states = run_world(filtered, 1, 3, backend="inline")
    for other in (config, with_steps(config, a=[step("filter", "at_least_words")])):
        loader = Loader(other, backend="inline")
        with pytest.raises(IncompatibleState, match="sources"):
            loader.load_state_dict(states)


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "match"), [
    ("tests.core.no_such_module:f", r"source 'a' transform 'tests.core.no_such_module:f': no module "
                                    r"'tests.core.no_such_module'"),
    (f"{FNS}:no_such_function", r"source 'a' transform '.*:no_such_function': .*has no attribute"),
    (f"{FNS}:NOT_CALLABLE", r"source 'a' transform '.*:NOT_CALLABLE' is int 3, not callable"),
    (f"{FNS}:is_async", r"source 'a' transform '.*:is_async' is an async or generator function"),
])
def test_bad_import_paths_are_refused_before_workers_start(config, path, match):
    cfg = config.replace(sources=[msgspec.structs.replace(config.sources[0], transforms=[TransformStep(map=path)])])
    with pytest.raises(ConfigError, match=match):
        Loader(cfg, backend="processes")


@pytest.mark.parametrize(("kind", "name", "match"), [
    ("map", "returns_none", r"map '.*:returns_none' returned None, not a dict"),
    ("map", "returns_list", r"map '.*:returns_list' returned \['.*, not a dict"),
    ("filter", "returns_str", r"filter '.*:returns_str' returned '.*, not a bool"),
    ("map", "raises", r"map '.*:raises' raised KeyError: 'no such thing'"),
])
def test_broken_functions_are_data_errors_naming_function_shard_and_offset(config, kind, name, match):
    """Raised whatever on_bad_record says: a broken function is not bad data."""
    cfg = with_steps(config.replace(on_bad_record="skip"), a=[step(kind, name)])
    with pytest.raises(DataError, match=match) as info:
        texts(cfg, 0)
    assert info.value.key.endswith(".jsonl") and info.value.offset >= 0
    assert f"of {info.value.key!r}" in str(info.value) and "byte " in str(info.value)


@pytest.mark.parametrize("backend", ["inline", "processes"])
def test_a_broken_function_stops_the_loader_with_its_error(config, backend):
    cfg = with_steps(config, a=[step("map", "returns_none")])
    with pytest.raises(DataError, match="returned None, not a dict"):
        next(iter(Loader(cfg, backend=backend)))


def test_a_filter_that_drops_everything_is_named(config):
    cfg = with_steps(config.replace(sources=config.sources[:1]), a=[step("filter", "nested_lang_en")])
    with pytest.raises(DataError, match="its transforms' filters drop all 600 of its records"):
        next(iter(Loader(cfg, backend="inline")))


def test_image_sources_take_no_transforms(vision_config):
    img = msgspec.structs.replace(vision_config.sources[0], transforms=[step("map", "shout")])
    with pytest.raises(ConfigError, match="image\\+text sources take no transforms"):
        Loader(vision_config.replace(sources=[img, vision_config.sources[1]]))


def test_transforms_round_trip_through_toml(config, tmp_path: Path):
    cfg = with_steps(config, a=[step("filter", "drop_bang"), step("map", "shout")], b=[step("map", "seeded_word")])
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert Config.from_toml(path) == cfg


# ---- ray ----------------------------------------------------------------------------------------

def ray_transforms_config(config: Config) -> Config:
    """The config of the ray case (tests/core/test_ray.py's `test_transforms_on_ray`, in the one Ray
    child): source a alone, filtered and mapped, to the end of its data."""
    return with_steps(config.replace(max_epochs=1, sources=config.sources[:1]),
                      a=[step("filter", "drop_bang"), step("map", "seeded_word")])
