"""Tokenize: each document's ids as uint32, EOS after them and BOS before them when configured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from zephon_stream.operators.tokenize import Tokenize

TEXTS = ["", "a", "the loader reads the shard", "ünïcødé → 日本語 🙂", "x" * 5000, "two\nlines\n"]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|bos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("bos", [None, "<|bos|>"])
def test_ids_then_eos_and_bos_first(tokenizer_path: Path, bos: str | None) -> None:
    tok = Tokenize(str(tokenizer_path), "<|endoftext|>", bos)
    ref = Tokenizer.from_file(str(tokenizer_path))
    out = tok(TEXTS)
    assert len(out) == len(TEXTS)
    for text, arr in zip(TEXTS, out):
        want = ([] if bos is None else [ref.token_to_id(bos)]) + ref.encode(text, add_special_tokens=False).ids
        want.append(ref.token_to_id("<|endoftext|>"))
        assert arr.dtype == np.uint32
        assert arr.tolist() == want


def test_arrays_are_separate_and_writable(tokenizer_path: Path) -> None:
    """Each document's array owns its memory: writing one changes no other (packing slices them)."""
    a, b = Tokenize(str(tokenizer_path), "<|endoftext|>")(["same text", "same text"])
    assert a.flags.writeable and b.flags.writeable
    before = b.tolist()
    a[:] = 0
    assert b.tolist() == before


@pytest.mark.parametrize("bos", [None, "<|bos|>"])
@pytest.mark.parametrize("texts", [TEXTS[:4], TEXTS, ["<|endoftext|> inside a caption", "a", ""], []],
                         ids=["short", "over-inline-chars", "special-token-text", "none"])
def test_each_gives_the_batch_ids(tokenizer_path: Path, bos: str | None, texts: list[str]) -> None:
    """`each` (captions, encoded one by one on the caller's thread while short) gives what a batch
    call gives, on either side of INLINE_CHARS (TEXTS holds 5,000 characters)."""
    tok = Tokenize(str(tokenizer_path), "<|endoftext|>", bos)
    assert [a.tolist() for a in tok.each(texts)] == [a.tolist() for a in tok(texts)]
    assert all(a.dtype == np.uint32 and a.flags.writeable for a in tok.each(texts))


@pytest.mark.parametrize("setting", ["padding", "truncation"])
def test_a_tokenizer_files_padding_and_truncation_are_not_applied(tokenizer_path: Path, tmp_path: Path,
                                                                  setting: str) -> None:
    """A tokenizer.json made for a model's inputs may pad a batch to its longest text or cut texts at
    a length: a document's ids are its whole text whatever the call holds, batch or `each`."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    if setting == "padding":
        tok.enable_padding(pad_id=1, pad_token="<|bos|>")
    else:
        tok.enable_truncation(max_length=4)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    plain = Tokenize(str(tokenizer_path), "<|endoftext|>")
    ours = Tokenize(str(path), "<|endoftext|>")
    assert [a.tolist() for a in ours(TEXTS)] == [a.tolist() for a in plain(TEXTS)]
    assert [a.tolist() for a in ours.each(TEXTS[:4])] == [a.tolist() for a in plain.each(TEXTS[:4])]
