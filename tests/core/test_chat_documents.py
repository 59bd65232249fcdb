"""Chat sources with retrieved documents: `documents_field` passes each record's documents to the
template as `documents`, as `transformers`' `apply_chat_template(documents=...)` does (checked
against it, with and without `{% generation %}` marks). JSON lines and Parquet (documents as a
list of structs or a JSON string) give the same documents and labels; `zephon shard` keeps and
checks them.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests._chat_data import train_tokenizer, word_conversations, write_jsonl_beside, write_parquet_beside
from tests.core.conftest import make_docs
from zephon_stream import ConfigError, DataError
from zephon_stream.chat import ChatTemplate, ChatTokens
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.operators.read import BadRecords
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import IGNORE, Conversation
from zephon_stream.shard import shard
from zephon_stream.testing.determinism import lane_documents, lane_token_streams

EOS = "<|endoftext|>"
# a retrieval-augmented template in the style of Granite's and Command R's: the documents in a system turn
RAG = ("{%- if documents %}{{- '<|im_start|>system\\nAnswer from these documents.\\n' }}"
       "{%- for d in documents %}{{- '[' ~ loop.index ~ '] ' ~ d.title ~ ': ' ~ d.text ~ '\\n' }}{%- endfor %}"
       "{{- '<|im_end|>\\n' }}{%- endif %}"
       "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
       "{%- if m.role == 'assistant' %}{% generation %}{{- m.content + '<|im_end|>' }}{% endgeneration %}"
       "{{- '\\n' }}{%- else %}{{- m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}")
RAG_PLAIN = RAG.replace("{% generation %}", "").replace("{% endgeneration %}", "")
N = 90


def _documents(rng: random.Random) -> list[dict[str, str]] | None:
    if rng.random() < 0.25:
        return None
    words = ["retrieved", "passage", "about", "the", "answer", "source", "page", "section"]
    return [{"title": f"doc {rng.randint(0, 99)}", "text": " ".join(rng.choices(words, k=rng.randint(3, 12)))}
            for _ in range(rng.randint(0, 3))]


@pytest.fixture(scope="module")
def rag_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[list, Any]]]:
    """`root/jsonl/` (documents a list, a JSON string, null or absent), `root/pq-list/` and
    `root/pq-str/` (the same in Parquet), the tokenizer and the template."""
    root = tmp_path_factory.mktemp("rag")
    rng = random.Random(8)
    pairs = [(conv, _documents(rng)) for conv in word_conversations(seed=9, n=N)]
    write_jsonl_beside(root / "jsonl", pairs, "retrieved", rng)
    write_parquet_beside(root, pairs, "retrieved", row_group_size=8)
    train_tokenizer(root / "tokenizer.json", make_docs(random.Random(5), 400, 40))
    (root / "rag.jinja").write_text(RAG)
    return root, pairs


def _config(root: Path, data: str = "jsonl", **changes: Any) -> Config:
    source = SourceConfig(name="rag", uri=f"file://{root}/{data}/", messages_field="messages",
                          documents_field="retrieved", chat_template=str(root / "rag.jinja"))
    cfg = Config(seed=3, lanes=4, seq_len=128, global_batch_size=8, tokenizer=str(root / "tokenizer.json"),
                 shuffle_window=8, split_bytes=8192, sample_batch=2, sources=[source])
    return cfg.replace(**changes)


def _epoch(cfg: Config) -> tuple[Counter, int]:
    batches = list(Loader(cfg.replace(max_epochs=1), backend="threads"))
    eos = Tokenize(cfg.tokenizer, EOS).eos_id
    docs = Counter(tuple(d) for s in lane_token_streams(batches).values() for d in lane_documents(s, eos))
    return docs, sum(int((b["labels"] != IGNORE).sum()) for b in batches)


@pytest.mark.parametrize("marked", [False, True], ids=["prefix-renders", "generation-markers"])
def test_documents_match_transformers(rag_data, marked):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    root, pairs = rag_data
    tok = Tokenize(str(root / "tokenizer.json"), EOS)
    tokens = ChatTokens(ChatTemplate(RAG if marked else RAG_PLAIN, "rag"), tok, "assistant")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(root / "tokenizer.json")),
                                              eos_token=EOS)
    docs = tokens([((0, 0, 0, 1), Conversation(c, None, d)) for c, d in pairs], BadRecords(), "test.jsonl")
    assert len(docs) == len(pairs)
    for (_, doc), (conv, documents) in zip(docs, pairs):
        got = hf.apply_chat_template(conv, documents=documents, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True, chat_template=RAG)
        ids, mask = list(got["input_ids"]), list(got["assistant_masks"])
        tail = [] if ids[-1:] == [tok.eos_id] else [tok.eos_id]
        assert doc.ids.tolist() == ids + tail
        assert doc.trained.astype(int).tolist() == mask + [0] * len(tail)
    # the documents reached the template, and a JSON string of them is the same documents
    with_docs = [(c, d) for c, d in pairs if d]
    bare = tokens([((0, 0, 0, 1), c) for c, _ in with_docs], None, "k")
    given = tokens([((0, 0, 0, 1), Conversation(c, None, json.dumps(d))) for c, d in with_docs], None, "k")
    assert with_docs and all(len(a.ids) > len(b.ids) for (_, a), (_, b) in zip(given, bare))
    assert [d.ids.tolist() for _, d in given] == [d.ids.tolist() for (_, d), (_, dd) in zip(docs, pairs) if dd]


def test_the_loader_gives_the_reference_documents_and_labels(rag_data):
    root, pairs = rag_data
    cfg = _config(root)
    tok = Tokenize(cfg.tokenizer, EOS)
    chat = ChatTokens.for_source(cfg, 0, tok)
    want = [d for _, d in chat([((0, 0, 0, 1), Conversation(c, None, d)) for c, d in pairs], None, "ref")]
    docs, labels = _epoch(cfg)
    assert docs == Counter(tuple(d.ids.tolist()) for d in want)
    assert labels == sum(int(d.trained[1:].sum()) for d in want) > 0  # a document's first token is no one's target


@pytest.mark.parametrize("data", ["pq-list", "pq-str"])
def test_parquet_gives_the_documents_and_labels_of_jsonl(rag_data, data):
    root, _ = rag_data
    assert _epoch(_config(root, data)) == _epoch(_config(root))


def test_documents_field_is_an_order_setting_absent_when_unset(rag_data):
    cfg = _config(rag_data[0])
    without = cfg.replace(sources=[msgspec.structs.replace(cfg.sources[0], documents_field=None)])
    assert cfg.order_digest("t") != without.order_digest("t")
    assert len(without.order_settings("t")["sources"][0][-1]) == 3  # unset: the settings of before
    as_tools = msgspec.structs.replace(cfg.sources[0], documents_field=None, tools_field="retrieved")
    tools = cfg.replace(sources=[as_tools])
    assert cfg.order_digest("t") != tools.order_digest("t")  # the same name as tools is another setting


@pytest.mark.parametrize("changes, problem", [
    ({"messages_field": None}, "documents_field = 'd': is for chat sources: set messages_field too"),
    ({"documents_field": "messages"}, "documents_field = 'messages': must name a field of its own"),
    ({"tools_field": "d"}, "documents_field = 'd': must name a field of its own, not the conversation's or the tools'"),
])
def test_documents_field_needs_a_chat_source(changes, problem):
    fields = {"name": "s", "uri": "file:///x/", "messages_field": "messages", "documents_field": "d", **changes}
    with pytest.raises(ConfigError, match=problem):
        SourceConfig(**fields)


@pytest.mark.parametrize("bad, problem", [
    ("[{not json", "the documents are a string that is not JSON"),
    ({"title": "t", "text": "x"}, r"the documents are dict .*, not a list of objects \(such as"),
    (["just text"], "the documents are list .*, not a list of objects"),
])
def test_bad_documents_are_bad_records(rag_data, tmp_path, bad, problem):
    root, pairs = rag_data
    rows = [{"messages": c, "retrieved": d} for c, d in pairs[:12]]
    rows[5]["retrieved"] = bad
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "part-0.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))
    source = msgspec.structs.replace(_config(root).sources[0], uri=f"file://{tmp_path}/d/")
    cfg = _config(root, lanes=1, global_batch_size=2, sources=[source])
    with pytest.raises(DataError, match=r"bad conversation in '.*part-0.jsonl' at byte \d+: "
                                        + problem):
        _epoch(cfg)
    loader = Loader(cfg.replace(on_bad_record="skip", max_epochs=1), backend="threads")
    docs = [d for s in lane_token_streams(list(loader)).values()
            for d in lane_documents(s, Tokenize(cfg.tokenizer, EOS).eos_id)]
    assert len(docs) == 11 and loader.statistics().skipped_records == 1
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes((tmp_path / "d" / "part-0.jsonl").read_bytes())
    with pytest.raises(DataError, match=r"bad conversation in 'a.jsonl' at byte \d+: " + problem):
        shard(str(tmp_path / "in"), str(tmp_path / "out"), messages_field="messages", documents_field="retrieved",
              progress=False)


@pytest.mark.parametrize("data", ["jsonl", "pq-list"])
def test_shard_keeps_conversations_and_documents(rag_data, tmp_path, data):
    root, _ = rag_data
    report = shard(str(root / data), str(tmp_path / "out"), messages_field="messages", documents_field="retrieved",
                   target_bytes=8_000, frame_bytes=1_000, progress=False)
    assert (report.documents, report.skipped) == (N, 0) and len(report.shards) > 1
    source = msgspec.structs.replace(_config(root).sources[0], uri=f"file://{tmp_path}/out/")
    assert _epoch(_config(root, sources=[source])) == _epoch(_config(root, data))
    with pytest.raises(ConfigError, match="documents_field is for chat data"):
        shard(str(root / data), str(tmp_path / "out2"), documents_field="retrieved")


def test_processes_backend_and_resume_on_another_backend_give_the_same_batches(rag_data):
    """The determinism matrix's backend and resume cases for records with documents: a checkpoint's
    documents are re-read through the same records path (conversation and documents) on restore."""
    from tests.core.test_chat_source import _batches, _same
    from zephon_stream.testing.determinism import rank_records

    cfg = _config(rag_data[0], "pq-str", workers=2)
    assert rank_records(Loader(cfg, backend="processes"), 6) == rank_records(Loader(cfg, backend="threads"), 6)
    whole, _ = _batches(cfg, 8, "inline")
    first, state = _batches(cfg, 3, "threads")
    rest, _ = _batches(cfg, 5, "processes", state)
    _same(whole, first + rest)
