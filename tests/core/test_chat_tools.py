"""Chat sources with tool use: `tools_field` passes each record's tools to the template, and an
assistant message that only calls tools (null or no content, `tool_calls`) is a message, not a
bad record. JSON lines and Parquet (tools as a JSON string or as nested columns) give the same
documents and labels, which are those of `ChatTokens` on the same conversations (itself checked
against `transformers` in tests/test_chat.py); the processes backend gives the batches of threads.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests._chat_data import QWEN_TOOLS, tool_conversations, train_tokenizer, write_jsonl_beside, write_parquet_beside
from tests.core.conftest import make_docs
from zephon_stream import ConfigError, DataError
from zephon_stream.chat import ChatTokens
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import IGNORE, Conversation
from zephon_stream.shard import shard
from zephon_stream.testing.determinism import lane_documents, lane_token_streams, rank_records

N = 160


def _uniform(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as a Parquet row holds it: every message with role, content and tool_calls
    (null where absent), each call `function`-wrapped with JSON-string arguments."""
    def call(c: dict[str, Any]) -> dict[str, Any]:
        f = c.get("function", c)
        args = f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"])
        return {"type": "function", "function": {"name": f["name"], "arguments": args}}
    return [{"role": m["role"], "content": m.get("content"),
             "tool_calls": [call(c) for c in m["tool_calls"]] if m.get("tool_calls") else None} for m in conv]


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[list, Any]]]:
    """`root/raw/` (the conversations as generated, tools a list, a JSON string or absent),
    `root/jsonl/`, `root/pq-str/` and `root/pq-list/` (the same conversations in Parquet's uniform
    shape), the tokenizer and the template."""
    root = tmp_path_factory.mktemp("tools")
    rng = random.Random(4)
    pairs = tool_conversations(seed=11, n=N)
    write_jsonl_beside(root / "raw", pairs, "tools", rng)
    uniform = [(_uniform(conv), tools) for conv, tools in pairs]
    (root / "jsonl").mkdir()
    for s in range(3):
        (root / "jsonl" / f"part-{s}.jsonl").write_bytes(b"".join(
            msgspec.json.encode({"messages": c, "tools": t}) + b"\n" for c, t in uniform[s::3]))
    write_parquet_beside(root, uniform, "tools", row_group_size=16)
    train_tokenizer(root / "tokenizer.json", make_docs(random.Random(5), 400, 40))
    (root / "qwen-tools.jinja").write_text(QWEN_TOOLS)
    return root, pairs


def _config(root: Path, data: str = "raw", **changes: Any) -> Config:
    source = SourceConfig(name="agent", uri=f"file://{root}/{data}/", messages_field="messages", tools_field="tools",
                          chat_template=str(root / "qwen-tools.jinja"))
    cfg = Config(seed=7, lanes=6, seq_len=128, global_batch_size=12, tokenizer=str(root / "tokenizer.json"),
                 shuffle_window=8, split_bytes=8192, sample_batch=2, sources=[source])
    return cfg.replace(**changes)


def _epoch(cfg: Config, backend: str = "threads") -> tuple[Counter, int]:
    batches = list(Loader(cfg.replace(max_epochs=1), backend=backend))
    eos = Tokenize(cfg.tokenizer, cfg.eos_token).eos_id
    docs = Counter(tuple(d) for s in lane_token_streams(batches).values() for d in lane_documents(s, eos))
    return docs, sum(int((b["labels"] != IGNORE).sum()) for b in batches)


def _reference(cfg: Config, pairs: list[tuple[list, Any]]) -> tuple[Counter, int]:
    tok = Tokenize(cfg.tokenizer, cfg.eos_token)
    chat = ChatTokens.for_source(cfg, 0, tok)
    docs = [d for _, d in chat([((0, 0, 0, 1), Conversation(c, t)) for c, t in pairs], None, "ref")]
    assert len(docs) == len(pairs)
    # a document's first token is no one's target
    return Counter(tuple(d.ids.tolist()) for d in docs), sum(int(d.trained[1:].sum()) for d in docs)


def test_tool_conversations_give_their_documents_and_trained_labels(tool_data):
    root, pairs = tool_data
    cfg = _config(root)
    docs, labels = _epoch(cfg)
    want_docs, want_labels = _reference(cfg, pairs)
    assert docs == want_docs and labels == want_labels
    assert labels > 20_000
    # the tools reached the template: without them the documents are others
    no_tools = _reference(cfg, [(c, None) for c, t in pairs if t])[0]
    assert not (Counter(want_docs) & no_tools)


@pytest.mark.parametrize("data", ["pq-str", "pq-list"])
def test_parquet_gives_the_documents_and_labels_of_jsonl(tool_data, data):
    root, _ = tool_data
    assert _epoch(_config(root, data)) == _epoch(_config(root, "jsonl"))


def test_processes_backend_gives_the_batches_of_threads(tool_data):
    cfg = _config(tool_data[0], workers=2)
    threads = rank_records(Loader(cfg, backend="threads"), 8)
    assert rank_records(Loader(cfg, backend="processes"), 8) == threads


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_resume_on_another_backend_gives_the_same_batches(tool_data, packing):
    """The determinism matrix's resume case for tool-use records: a checkpoint's documents are
    re-read through the same records path (conversation and tools) on restore."""
    from tests.core.test_chat_source import _batches, _same

    cfg = _config(tool_data[0], packing=packing)
    whole, _ = _batches(cfg, 10, "inline")
    first, state = _batches(cfg, 4, "threads")
    rest, _ = _batches(cfg, 6, "processes", state)
    _same(whole, first + rest)


def test_tools_field_is_an_order_setting_absent_when_unset(tool_data):
    cfg = _config(tool_data[0])
    without = cfg.replace(sources=[msgspec.structs.replace(cfg.sources[0], tools_field=None)])
    assert cfg.order_digest("t") != without.order_digest("t")
    # unset, a chat source's settings are those of before tools_field: old checkpoints still load
    assert len(without.order_settings("t")["sources"][0][-1]) == 3


@pytest.mark.parametrize("changes, problem", [
    ({"messages_field": None}, "tools_field = 'tools': is for chat sources: set messages_field too"),
    ({"tools_field": "messages"}, "tools_field = 'messages': must name a field of its own"),
])
def test_tools_field_needs_a_chat_source(changes, problem):
    fields = {"name": "s", "uri": "file:///x/", "messages_field": "messages", "tools_field": "tools", **changes}
    with pytest.raises(ConfigError, match=problem):
        SourceConfig(**fields)


_BAD_TOOLS = [({"tools": "[{not json"}, "the tools are a string that is not JSON"),
              ({"tools": {"name": "f"}}, "the tools are dict .*, not a list of objects"),
              ({"tools": ["f"]}, "the tools are list .*, not a list of objects"),
              ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
               r"message 1 \(assistant\) has content that is null, not a string \(or null, with tool_calls\)"),
              ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "f()"}]},
               "message 1 .assistant. has tool_calls that are str 'f..', not a list of objects"),
              ({"messages": [{"role": "user", "content": None, "tool_calls": [{"name": "f"}]}]},
               r"message 0 \(user\) has content that is null, not a string or a list of text parts$")]


@pytest.mark.parametrize("bad, problem", _BAD_TOOLS)
def test_bad_tools_and_tool_calls_are_bad_records(tool_data, tmp_path, bad, problem):
    root, pairs = tool_data
    good = [{"messages": c, "tools": t} for c, t in pairs[:20]]
    rows = good[:5] + [{**good[5], **bad}] + good[6:]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "part-0.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))
    cfg = _config(root, lanes=1, global_batch_size=2,
                  sources=[msgspec.structs.replace(_config(root).sources[0], uri=f"file://{tmp_path}/d/")])
    with pytest.raises(DataError, match=r"bad conversation in '.*part-0.jsonl' at byte \d+: "
                                        + problem):
        _epoch(cfg)
    loader = Loader(cfg.replace(on_bad_record="skip", max_epochs=1), backend="threads")
    docs = [d for s in lane_token_streams(list(loader)).values()
            for d in lane_documents(s, Tokenize(cfg.tokenizer, cfg.eos_token).eos_id)]
    assert len(docs) == 19 and loader.statistics().skipped_records == 1


def test_a_parquet_file_without_the_tools_column_is_refused(tool_data, tmp_path):
    root, _ = tool_data
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "x"}]]}), tmp_path / "pq" / "part-0.parquet")
    cfg = _config(root, sources=[msgspec.structs.replace(_config(root).sources[0], uri=f"file://{tmp_path}/pq/")])
    with pytest.raises(DataError, match=r"has no column 'tools' \(its columns: messages\): set tools_field to one"):
        next(iter(Loader(cfg, backend="threads")))


# ---- zephon shard: chat data -----------------------------------------------------------------

@pytest.mark.parametrize("data", ["raw", "pq-list"])
def test_shard_keeps_conversations_and_tools(tool_data, tmp_path, data):
    """Sharded with --messages-field/--tools-field, JSON lines (lines as they are) or Parquet (each row
    a line of the two fields) give the documents and labels of the source they came from."""
    root, _ = tool_data
    report = shard(str(root / data), str(tmp_path / "out"), messages_field="messages", tools_field="tools",
                   target_bytes=20_000, frame_bytes=2_000, progress=False)
    assert (report.documents, report.skipped) == (N, 0) and len(report.shards) > 1
    source = msgspec.structs.replace(_config(root).sources[0], uri=f"file://{tmp_path}/out/")
    assert _epoch(_config(root, sources=[source])) == _epoch(_config(root, data))


def test_shard_checks_conversations_as_a_chat_source_reads_them(tool_data, tmp_path):
    root, pairs = tool_data
    rows = [{"messages": c, "tools": t} for c, t in pairs[:10]]
    rows[3] = {"messages": [{"role": "robot", "content": "x"}]}
    rows[6] = {"messages": rows[6]["messages"], "tools": "{not json"}
    rows[8] = {"id": 8}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(json.dumps(rows, indent=2))
    with pytest.raises(DataError, match=r"bad conversation in 'a.json' at record 3 of its JSON array: message 0 has "
                                        r"role 'robot'"):
        shard(str(tmp_path / "in"), str(tmp_path / "out"), messages_field="messages", tools_field="tools",
              progress=False)
    report = shard(str(tmp_path / "in"), str(tmp_path / "out2"), messages_field="messages", tools_field="tools",
                   on_bad="skip", progress=False)
    assert (report.documents, report.skipped) == (7, 3)
    (tmp_path / "in" / "a.json").unlink()
    (tmp_path / "in" / "b.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))
    with pytest.raises(DataError, match=r"bad conversation in 'b.jsonl' at byte \d+: message 0 has role 'robot'"):
        shard(str(tmp_path / "in"), str(tmp_path / "out3"), messages_field="messages", progress=False)
    with pytest.raises(ConfigError, match="give messages_field alone"):
        shard(str(tmp_path / "in"), str(tmp_path / "out4"), messages_field="messages", text_field="text")
    with pytest.raises(ConfigError, match="tools_field is for chat data"):
        shard(str(tmp_path / "in"), str(tmp_path / "out4"), tools_field="tools")


def test_shard_cli_names_its_flags_for_chat_data(tool_data, tmp_path, capsys):
    from zephon_stream.cli.main import main

    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"conversation": [[{"role": "user", "content": "x"}]]}), tmp_path / "pq" / "p.parquet")
    assert main(["shard", str(tmp_path / "pq"), str(tmp_path / "out"), "--messages-field", "messages"]) == 2
    err = capsys.readouterr().err
    assert "has no column 'messages' (its columns: conversation): pass one of them to --messages-field" in err, err
    assert main(["shard", str(tmp_path / "pq"), str(tmp_path / "out"), "--messages-field", "m",
                 "--text-field", "t"]) == 2
    assert "give --messages-field alone (and --tools-field, --documents-field)" in capsys.readouterr().err
