"""The whole determinism matrix (tests/core/test_determinism.py) for best_fit packing: the same
tests, collected again here with `config` a chat source (ChatML conversations of the test words,
labels -100 outside the assistant turns) mixed with the text config's source `a`, packed
best-fit from a window of 8 documents per lane (whose contents every checkpoint holds as
references). One config covers both kinds of documents in the window; the processes cases that
tests/core/conftest.py keeps for the text config alone are left out here as for every other."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from tests._chat_data import CHATML, train_tokenizer, word_conversations
from tests.core.conftest import make_docs
from tests.core.test_determinism import (  # noqa: F401  (collected here with this module's `config`)
    baseline,
    test_buffer_capacities,
    test_epochs_to_the_end_and_resume_at_epoch_boundary,
    test_injected_read_latency,
    test_read_ahead_window_does_not_change_order,
    test_refuses_world_that_cannot_keep_order,
    test_resume_on_both_sides_of_the_first_epoch_crossing,
    test_resume_onto_other_world_and_backend,
    test_resume_twice,
    test_world_sizes_and_backends,
)


@pytest.fixture(scope="module")
def chat_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated conversations of the test words (3 JSONL shards) and a tokenizer with ChatML's tokens."""
    root = tmp_path_factory.mktemp("chat_matrix")
    (root / "sft").mkdir()
    conversations = word_conversations(seed=13, n=360, turns=3)
    for s in range(3):
        part = conversations[s * 120:(s + 1) * 120]
        (root / "sft" / f"part-{s}.jsonl").write_bytes(b"".join(
            msgspec.json.encode({"id": i, "messages": c}) + b"\n" for i, c in enumerate(part)))
    train_tokenizer(root / "tokenizer.json", make_docs(random.Random(3), 300, 40))
    (root / "chatml.jinja").write_text(CHATML)
    return root


@pytest.fixture(params=["chat_best_fit"])
def config(request, chat_root: Path):
    text = request.getfixturevalue("config").replace(packing="best_fit", packing_window=8)
    chat = msgspec.structs.replace(text.sources[0], name="sft", uri=f"file://{chat_root}/sft/", weight=0.6,
                                   messages_field="messages", chat_template=str(chat_root / "chatml.jinja"))
    return text.replace(tokenizer=str(chat_root / "tokenizer.json"),
                        sources=[chat, msgspec.structs.replace(text.sources[0], weight=0.4)])
