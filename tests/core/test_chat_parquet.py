"""Chat sources stored as Parquet: a `messages` column of list<struct<role, content>> (as Hugging
Face datasets write conversations) gives the documents and labels of the same conversations as
JSON lines."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from tests.core import test_chat_source
from tests.core.test_chat_source import _check_labels
from tests.core.test_chat_source import _config as chat_config_at
from zephon_stream import DataError
from zephon_stream.loader.config import SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import IGNORE
from zephon_stream.testing.determinism import lane_documents, lane_token_streams

chat_data = test_chat_source.chat_data  # the conversations and template, shared with those tests


def _write_parquet(root, conversations, shards: int = 2, row_group: int = 40) -> None:
    root.mkdir(parents=True)
    per = -(-len(conversations) // shards)
    for s in range(shards):
        part = conversations[s * per:(s + 1) * per]
        table = pa.table({"id": list(range(len(part))), "messages": part})
        pq.write_table(table, root / f"part-{s}.parquet", row_group_size=row_group)


def _source(root, name: str = "sft") -> SourceConfig:
    return SourceConfig(name=name, uri=f"file://{root}/", messages_field="messages",
                        chat_template=str(root.parent / "chatml.jinja"))


def _epoch(cfg) -> tuple[Counter, int]:
    batches = list(Loader(cfg.replace(max_epochs=1), backend="threads"))
    eos = Tokenize(cfg.tokenizer, cfg.eos_token).eos_id
    docs = Counter(tuple(d) for s in lane_token_streams(batches).values() for d in lane_documents(s, eos))
    return docs, sum(int((b["labels"] != IGNORE).sum()) for b in batches)


def test_parquet_conversations_give_the_documents_and_labels_of_jsonl(chat_data, tmp_path):
    root, conversations = chat_data
    (tmp_path / "chatml.jinja").write_text((root / "chatml.jinja").read_text())
    _write_parquet(tmp_path / "pq", conversations)
    jsonl = chat_config_at(root)
    parquet = jsonl.replace(sources=[_source(tmp_path / "pq")])
    assert pa.types.is_list(pq.read_schema(tmp_path / "pq" / "part-0.parquet").field("messages").type)
    assert _epoch(parquet) == _epoch(jsonl)
    tok = Tokenizer.from_file(parquet.tokenizer)
    for step, batch in enumerate(Loader(parquet, backend="threads")):
        assert _check_labels(batch, tok) > 0
        if step == 3:
            break


def test_a_messages_column_that_is_not_a_list_is_refused(chat_data, tmp_path):
    root, _ = chat_data
    (tmp_path / "chatml.jinja").write_text((root / "chatml.jinja").read_text())
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"messages": ["not a conversation"] * 4}), tmp_path / "pq" / "part-0.parquet")
    cfg = chat_config_at(root).replace(sources=[_source(tmp_path / "pq")])
    with pytest.raises(DataError, match=r"column 'messages' .* is string, not a list of messages .*messages_field"):
        next(iter(Loader(cfg, backend="threads")))
