"""Chat sources end to end: JSONL records with a `messages` field, rendered with a ChatML template.

Labels are checked against an oracle that reads the batch's own tokens (ChatML turns open with
the special token `<|im_start|>`, then the role and a newline, and close with `<|im_end|>`): a
label is the next token where that token lies in an assistant turn's content or end, else -100.
Exactly once, checkpoint resume and the processes backend are checked on the same data.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tests._chat_data import CHATML, faq_conversations, train_tokenizer, word_conversations
from tests.core.conftest import make_docs
from zephon_stream import ConfigError, DataError
from zephon_stream.chat import ChatTokens
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import IGNORE
from zephon_stream.testing.determinism import batch_records, lane_documents, lane_token_streams, rank_records

STEPS = 10


def _plain(conversations: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Contents without edge whitespace, so the oracle's header newline is a token of its own."""
    return [[{**m, "content": m["content"].strip() or "the"} for m in c] for c in conversations]


def _write(root: Path, conversations: list[list[dict[str, Any]]], shards: int = 3) -> None:
    root.mkdir(parents=True)
    per = -(-len(conversations) // shards)
    for s in range(shards):
        part = conversations[s * per:(s + 1) * per]
        (root / f"part-{s}.jsonl").write_bytes(b"".join(msgspec.json.encode({"id": i, "messages": c}) + b"\n"
                                                        for i, c in enumerate(part)))


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("chat")
    conversations = _plain(word_conversations(seed=21, n=360, turns=3))
    _write(root / "sft", conversations)
    train_tokenizer(root / "tokenizer.json", make_docs(random.Random(5), 400, 40))
    (root / "chatml.jinja").write_text(CHATML)
    return root, conversations


def _config(root: Path, **changes: Any) -> Config:
    cfg = Config(seed=1234, lanes=12, seq_len=64, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                 shuffle_window=8, split_bytes=4096, sample_batch=2,
                 sources=[SourceConfig(name="sft", uri=f"file://{root}/sft/", messages_field="messages",
                                       chat_template=str(root / "chatml.jinja"))])
    return cfg.replace(**changes)


@pytest.fixture()
def chat_config(chat_data) -> Config:
    return _config(chat_data[0])


def oracle_trained(ids: list[int], tok: Tokenizer) -> tuple[np.ndarray, int]:
    """Which tokens a ChatML assistant mask marks, read from the tokens alone; and the first
    position the oracle knows (a sample may open inside a turn: its role is not in the sample)."""
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    trained = np.zeros(len(ids), dtype=bool)
    role: str | None = None
    header: list[int] | None = None
    known = next((i for i, t in enumerate(ids) if t == start), len(ids))
    for i, t in enumerate(ids[known:], known):
        if t == start:
            header, role = [], None
        elif header is not None:
            header.append(t)
            if "\n" in tok.decode([t], skip_special_tokens=False):
                role, header = tok.decode(header, skip_special_tokens=False).strip(), None
        elif role == "assistant":
            trained[i] = True
            if t == end:
                role = None
    return trained, known


def _check_labels(batch: dict[str, Any], tok: Tokenizer) -> int:
    """Labels against the oracle in each document piece of every row; the number of positions
    checked that are trained. The label of a piece's last token is not checked: its target lies
    outside the row (the next piece of a cut document, or the next document)."""
    trained_seen = 0
    for row, labels, pieces in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                   batch["document_ids"].numpy()):
        for piece in np.unique(pieces[pieces >= 0]):
            lo, hi = np.flatnonzero(pieces == piece)[[0, -1]] + (0, 1)
            trained, known = oracle_trained(row[lo:hi], tok)
            for j in range(lo + known, hi - 1):
                assert labels[j] == (row[j + 1] if trained[j + 1 - lo] else IGNORE), (j, row, labels)
                trained_seen += bool(trained[j + 1 - lo])
        assert all(labels[j] == IGNORE for j in np.flatnonzero(pieces < 0)), "padding is never a target"
    return trained_seen


@pytest.mark.parametrize("packing", ["concat", "best_fit", "none"])
def test_labels_are_ignored_outside_assistant_turns(chat_config, packing):
    tok = Tokenizer.from_file(chat_config.tokenizer)
    seen = 0
    for step, batch in enumerate(Loader(chat_config.replace(packing=packing), backend="threads")):
        seen += _check_labels(batch, tok)
        if step == STEPS:
            break
    assert seen > 1000


def test_python_faq_conversations_end_to_end(tmp_path, chat_data):
    conversations = faq_conversations()
    _write(tmp_path / "sft", conversations, shards=2)
    cfg = _config(chat_data[0], seq_len=256, lanes=4, global_batch_size=8).replace(
        sources=[SourceConfig(name="faq", uri=f"file://{tmp_path}/sft/", messages_field="messages",
                              chat_template=str(chat_data[0] / "chatml.jinja"))])
    tok = Tokenizer.from_file(cfg.tokenizer)
    seen = sum(_check_labels(batch, tok) for batch in Loader(cfg.replace(max_epochs=1), backend="threads"))
    assert seen > 20_000


@pytest.mark.parametrize("dp_size", [1, 2])
def test_every_conversation_once_per_epoch_with_its_trained_labels(chat_config, chat_data, dp_size):
    _, conversations = chat_data
    cfg = chat_config.replace(max_epochs=1)
    tok = Tokenize(cfg.tokenizer, cfg.eos_token)
    batches = [b for rank in range(dp_size) for b in Loader(cfg, dp_rank=rank, dp_size=dp_size, backend="threads")]
    docs = [doc for _, doc in ChatTokens.for_source(cfg, 0, tok)([((0, 0, 0, 1), c) for c in conversations],
                                                                 None, "all")]
    got = Counter(tuple(d) for s in lane_token_streams(batches).values() for d in lane_documents(s, tok.eos_id))
    assert got == Counter(tuple(d.ids.tolist()) for d in docs)
    labels = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
    assert labels == sum(int(d.trained[1:].sum()) for d in docs)  # a document's first token is no one's target


def test_every_token_once_per_epoch_with_best_fit(chat_config, chat_data):
    """Whole conversations from a window, long ones cut into seq_len pieces: every token once, and
    every trained target once (at a cut, the label of a piece's last token is the next piece's first)."""
    _, conversations = chat_data
    cfg = chat_config.replace(max_epochs=1, packing="best_fit", packing_window=16)
    tok = Tokenize(cfg.tokenizer, cfg.eos_token)
    batches = list(Loader(cfg, backend="threads"))
    docs = [doc for _, doc in ChatTokens.for_source(cfg, 0, tok)([((0, 0, 0, 1), c) for c in conversations],
                                                                 None, "all")]
    assert Counter(t for s in lane_token_streams(batches).values() for t in s) == \
        Counter(t for d in docs for t in d.ids.tolist())
    assert any(len(d) > cfg.seq_len for d in docs), "some conversations are cut"
    labels = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
    assert labels == sum(int(d.trained[1:].sum()) for d in docs)


def _batches(cfg: Config, steps: int, backend: str, state: Any = None,
             records: list[tuple] | None = None) -> tuple[list[dict[str, Any]], Any]:
    """The first `steps` batches (copies of their tensors) and the state after them; each
    sample's record (`batch_records`) is appended to `records` when given."""
    loader = Loader(cfg, backend=backend)
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for step, batch in enumerate(loader):
        out.append({k: batch[k].clone() for k in ("input_ids", "labels", "position_ids")})
        if records is not None:
            records += batch_records(batch)
        if step + 1 == steps:
            break
    return out, loader.state_dict()


_WHOLE: dict[str, list[dict[str, Any]]] = {}  # config TOML -> its first STEPS batches on threads


def _whole(cfg: Config) -> list[dict[str, Any]]:
    """The first STEPS batches of an uninterrupted threads run: the reference of the resume and the
    processes cases, made once per config (a run is a pure function of its config)."""
    key = cfg.to_toml()
    if key not in _WHOLE:
        _WHOLE[key] = _batches(cfg, STEPS, "threads")[0]
    return _WHOLE[key]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in x:
            assert x[k].equal(y[k]), k


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_resume_gives_the_same_batches(chat_config, packing):
    cfg = chat_config.replace(packing=packing)
    whole = _whole(cfg)
    first, state = _batches(cfg, 4, "threads")
    rest, _ = _batches(cfg, STEPS - 4, "threads", state)
    _same(whole, first + rest)


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_processes_backend_gives_the_batches_of_threads(chat_config, packing):
    cfg = chat_config.replace(packing=packing)
    threads = _whole(cfg)
    records: list[tuple] = []  # from the same processes run: one start of its workers, not two
    processes, _ = _batches(cfg.replace(workers=2), STEPS, "processes", records=records)
    _same(threads, processes)
    assert rank_records(Loader(cfg, backend="inline"), STEPS) == records


def _world(cfg: Config, dp_size: int, steps: int, backend: str, resume: Any = None) -> tuple[list[tuple], list]:
    """Every rank's samples as (step, slot, input_ids digest, labels digest), by slot; each rank's state."""
    rows, states = [], []
    for rank in range(dp_size):
        loader = Loader(cfg, dp_rank=rank, dp_size=dp_size, backend=backend)
        if resume:
            loader.load_state_dict(resume)
        for b, batch in enumerate(loader):
            rows += [(batch["step"], slot, hashlib.sha256(ids.tobytes()).hexdigest(),
                      hashlib.sha256(labels.tobytes()).hexdigest())
                     for slot, ids, labels in zip(batch["slots"].tolist(), batch["input_ids"].numpy(),
                                                  batch["labels"].numpy())]
            if b + 1 == steps:
                break
        states.append(loader.state_dict())
    return sorted(rows, key=lambda r: (r[0], r[1])), states


def test_world_sizes_and_resume_onto_another_world_with_best_fit(chat_config):
    """The determinism matrix's cases for a chat source packed best_fit, labels compared too."""
    cfg = chat_config.replace(packing="best_fit", packing_window=8)
    baseline, _ = _world(cfg, 1, STEPS, "inline")
    assert len({r[2] for r in baseline}) == len(baseline)
    assert _world(cfg, 3, STEPS, "threads")[0] == baseline
    first, states = _world(cfg, 2, 4, "threads")
    rest, _ = _world(cfg, 4, STEPS - 4, "inline", resume=states)
    assert first + rest == baseline


# ---- bad input and configuration -------------------------------------------------------------

_BAD = [[], [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}], [{"content": "x"}],
        [{"role": "user", "content": {"text": "x"}}]]


def _with_bad(tmp_path: Path, chat_data) -> Path:
    good = chat_data[1][:40]
    rows = good[:30] + _BAD + good[30:]  # the bad ones in a later split than the first (split_bytes 4096)
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "part-0.jsonl").write_bytes(b"".join(msgspec.json.encode({"messages": c}) + b"\n"
                                                             for c in rows))
    return tmp_path / "sft"


def _source(uri: Path, root: Path, **more: Any) -> list[SourceConfig]:
    return [SourceConfig(name="sft", uri=f"file://{uri}/", messages_field="messages",
                         chat_template=str(root / "chatml.jinja"), **more)]


def test_bad_conversations_are_errors_naming_the_shard(tmp_path, chat_data):
    cfg = _config(chat_data[0], lanes=1, global_batch_size=2, sources=_source(_with_bad(tmp_path, chat_data),
                                                                              chat_data[0]))
    with pytest.raises(DataError, match=r"bad conversation in '.*part-0.jsonl' .*: the conversation is empty") as info:
        for _ in Loader(cfg.replace(max_epochs=1), backend="threads"):
            pass
    # named at its byte in the file, as a bad text record is (it was its byte in its split: 4096 less)
    lines = (tmp_path / "sft" / "part-0.jsonl").read_bytes().split(b"\n")
    at = sum(len(line) + 1 for line in lines[:30])
    assert at > 4096 and f"part-0.jsonl' at byte {at}: the conversation is empty" in str(info.value), str(info.value)


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_bad_conversations_are_skipped_and_counted(tmp_path, chat_data, backend):
    cfg = _config(chat_data[0], lanes=1, global_batch_size=2, max_epochs=2, on_bad_record="skip",
                  sources=_source(_with_bad(tmp_path, chat_data), chat_data[0]))
    loader = Loader(cfg, backend=backend)
    tok = Tokenize(cfg.tokenizer, cfg.eos_token)
    batches = list(loader)
    docs = [d for s in lane_token_streams(batches).values() for d in lane_documents(s, tok.eos_id)]
    assert len(docs) == 2 * 40
    stats = loader.statistics()
    assert stats.skipped_records == 2 * len(_BAD) and stats.skipped_by_epoch == {0: len(_BAD), 1: len(_BAD)}


def test_a_chat_source_without_a_template_is_refused_before_reading(tmp_path, chat_data):
    root = chat_data[0]
    (tmp_path / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    cfg = _config(root, tokenizer=str(tmp_path / "tokenizer.json"),
                  sources=[SourceConfig(name="sft", uri=f"file://{root}/sft/", messages_field="messages")])
    with pytest.raises(ConfigError, match="source 'sft' is a chat source .*without a chat template.*Set chat_template"):
        next(iter(Loader(cfg, backend="threads")))
    (tmp_path / "tokenizer_config.json").write_text(msgspec.json.encode({"chat_template": CHATML}).decode())
    batch = next(iter(Loader(cfg, backend="threads")))  # the template next to the tokenizer
    assert _check_labels(batch, Tokenizer.from_file(cfg.tokenizer)) > 0


async def _first_batch(cfg: Config, backend: str) -> Any:
    with anyio.fail_after(60):  # before the fix: no batch, no error, forever
        async with Loader(cfg, backend=backend).open() as stream:
            return await stream.__anext__()


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_source_whose_conversations_are_all_bad_is_an_error_not_a_spin(tmp_path, chat_data, backend):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "part-0.jsonl").write_bytes(b"".join(
        msgspec.json.encode({"messages": [{"role": "robot", "content": w}]}) + b"\n" for w in "the of and to".split()))
    cfg = _config(chat_data[0], lanes=2, global_batch_size=2, on_bad_record="skip",
                  sources=_source(tmp_path / "sft", chat_data[0]))
    with pytest.raises(DataError, match=r"source 'sft' .* yields no document in a whole epoch .*: all 4 of its records "
                                        r"are bad and skipped .*the first: bad conversation in 'part-0.jsonl' .*: "
                                        r"message 0 has role 'robot'"):
        anyio.run(_first_batch, cfg, backend)


@pytest.mark.parametrize("labels", ["shifted", "unshifted"])
def test_inspect_marks_the_text_trained_on(chat_config, tmp_path, capsys, labels):
    """`zephon inspect` puts ⟦+⟧ ... ⟦-⟧ around each run of trained tokens of a chat source: each
    run is the end of an assistant turn (content and <|im_end|>), never a user or system turn."""
    from zephon_stream.cli.main import main

    path = tmp_path / "c.toml"
    path.write_text(chat_config.replace(labels=labels).to_toml())
    assert main(["inspect", str(path), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "in chat sources ⟦+⟧ opens and ⟦-⟧ closes the text trained on" in out.splitlines()[0]
    samples = out.split("\n## slot ")[1:]
    runs = [m for sample in samples for m in re.finditer(r"⟦\+⟧(.*?)⟦-⟧", sample, re.S)]
    assert len(runs) > 4 and all("<|im_start|>" not in r[1] for r in runs)
    # a run ends with the turn's <|im_end|>, unless the sample (or the document piece) ends first
    assert all(r[1].endswith("<|im_end|>") for r in runs if r.end() < len(r.string.rstrip("\n"))
               and not r.string.startswith("⟦sft⟧", r.end()))
    checked = 0
    for sample in samples:
        for before in sample.split("⟦+⟧")[:-1]:  # the text before each run, within its sample
            if "<|im_start|>" in before:  # else the sample opens inside the turn: its role is not shown
                assert before.rsplit("<|im_start|>", 1)[1].replace("⟦-⟧", "") == "assistant\n", before[-80:]
                checked += 1
    assert checked >= len(runs) // 2


def test_inspect_marks_a_sample_s_first_token_as_its_lane_s_previous_sample_trains_it(chat_config, tmp_path, capsys):
    """Under shifted labels a sample's first token is the target of the last label of its lane's
    previous sample: inspect showed it untrained always, outside the ⟦+⟧ it belongs in."""
    from zephon_stream.cli.main import main

    batches = list(itertools.islice(Loader(chat_config, backend="inline"), 3))
    last: dict[int, torch.Tensor] = {}
    opens_trained = []  # the step-2 samples whose first token the previous sample's last label targets
    for batch in batches:
        for row, lane in enumerate(batch["lanes"].tolist()):
            if lane in last and last[lane] != IGNORE:
                assert last[lane] == batch["input_ids"][row, 0]  # the label is that very token
                if batch["step"] == 2:
                    opens_trained.append(row)
            last[lane] = batch["labels"][row, -1]
    assert opens_trained
    path = tmp_path / "c.toml"
    path.write_text(chat_config.to_toml())
    assert main(["inspect", str(path), "--step", "2"]) == 0
    samples = capsys.readouterr().out.split("\n## slot ")[1:]
    assert all(samples[row].split("\n", 1)[1].startswith("⟦sft⟧⟦+⟧") for row in opens_trained)
    untrained = [row for row in range(len(samples)) if row not in opens_trained]
    assert not any(samples[row].split("\n", 1)[1].startswith("⟦sft⟧⟦+⟧") for row in untrained)


def test_a_dotted_messages_field_reads_nested_conversations(tmp_path, chat_data):
    """`messages_field = "x.messages"` reaches into a nested object in JSON lines, as in Parquet.
    The nested lines have the flat lines' lengths (the flat ones carry a pad), so the splits are
    the same and so must be the batches."""
    root, conversations = chat_data
    per = -(-len(conversations) // 3)
    for name, line in (("flat", lambda i, c: {"p": 0, "id": i, "messages": c}),
                       ("nested", lambda i, c: {"id": i, "x": {"messages": c}})):
        (tmp_path / name).mkdir()
        for s in range(3):
            part = conversations[s * per:(s + 1) * per]
            (tmp_path / name / f"part-{s}.jsonl").write_bytes(
                b"".join(msgspec.json.encode(line(i, c)) + b"\n" for i, c in enumerate(part)))
    assert [p.stat().st_size for p in sorted((tmp_path / "flat").iterdir())] == \
        [p.stat().st_size for p in sorted((tmp_path / "nested").iterdir())]
    flat = _config(root)
    flat = flat.replace(sources=[msgspec.structs.replace(flat.sources[0], uri=f"file://{tmp_path}/flat/")])
    nested = flat.replace(sources=[msgspec.structs.replace(flat.sources[0], uri=f"file://{tmp_path}/nested/",
                                                           messages_field="x.messages")])
    want = _batches(flat, 4, "threads")[0]
    _same(want, _batches(nested, 4, "threads")[0])
    _same(want, _batches(nested, 4, "processes")[0])
