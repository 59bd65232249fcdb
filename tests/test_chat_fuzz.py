"""Fuzz: whatever a record's messages field holds (any JSON value), the chat tokenizer gives a
document whose ids and trained flags agree, or a DataError (or a counted skip): never another
exception, under each public template and loss scope."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._chat_data import TEMPLATES, train_tokenizer
from tests.core.conftest import make_docs
from zephon_stream.chat import ChatTemplate, ChatTokens
from zephon_stream.errors import DataError
from zephon_stream.operators.read import BadRecords
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import ChatDoc

REF = (0, 0, 0, 1)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "", "bot", "USER"]) | st.text(max_size=6)
CONTENT = st.text(max_size=40) | JSON
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLE | JSON, "content": CONTENT, "name": st.text(max_size=5)})
MESSAGES = st.lists(MESSAGE, max_size=5) | JSON


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("chat_fuzz") / "tokenizer.json",
                           make_docs(random.Random(9), 300, 30))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=MESSAGES, name=st.sampled_from(sorted(TEMPLATES)), marked=st.booleans(),
       loss_on=st.sampled_from(["assistant", "last_assistant", "all"]))
def test_any_messages_value_is_a_document_or_a_data_error(tokenizer_path, messages, name, marked, loss_on):
    plain, gen, eos, bos = TEMPLATES[name]
    template = ChatTemplate(gen if marked else plain, name, {"eos_token": eos, "bos_token": bos})
    tokens = ChatTokens(template, Tokenize(str(tokenizer_path), eos, bos), loss_on)
    try:
        docs = tokens([(REF, messages)], BadRecords(), "fuzz.jsonl")
    except DataError as exc:
        assert "fuzz.jsonl" in str(exc)
        skipping = BadRecords("skip")
        assert tokens([(REF, messages)], skipping, "fuzz.jsonl") == [] and skipping.count == 1
        return
    for _, doc in docs:
        assert isinstance(doc, ChatDoc) and len(doc.ids) == len(doc.trained) > 0
    skipping = BadRecords("skip")
    again = tokens([(REF, messages)], skipping, "fuzz.jsonl")
    assert [d.ids.tolist() for _, d in again] == [d.ids.tolist() for _, d in docs]
