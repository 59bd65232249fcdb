"""The whole determinism matrix (tests/core/test_determinism.py) for best_fit packing: the same
tests, collected again here with `config` a chat source (ChatML conversations of the test words,
labels -100 outside the assistant turns) mixed with the text config's source `a`, packed
best-fit from a window of 8 documents per lane (whose contents every checkpoint holds as
references). One config covers both kinds of documents in the window; the processes cases that
tests/core/conftest.py keeps for the text config alone are left out here as for every other."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tests._chat_data import write_word_chats
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
    return write_word_chats(tmp_path_factory.mktemp("chat_matrix"), n=360, shards=3)


@pytest.fixture(params=["chat_best_fit"])
def config(request, chat_root: Path):
    text = request.getfixturevalue("config").replace(packing="best_fit", packing_window=8)
    chat = msgspec.structs.replace(text.sources[0], name="sft", uri=f"file://{chat_root}/sft/", weight=0.6,
                                   messages_field="messages", chat_template=str(chat_root / "chatml.jinja"))
    return text.replace(tokenizer=str(chat_root / "tokenizer.json"),
                        sources=[chat, msgspec.structs.replace(text.sources[0], weight=0.4)])
