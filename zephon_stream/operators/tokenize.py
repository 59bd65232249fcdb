"""Tokenize: HF `tokenizers` from a tokenizer.json, batched, with EOS after each document."""

from __future__ import annotations

import hashlib
from array import array
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from zephon_stream.errors import ConfigError

__all__ = ["Tokenize"]

_UINT32 = next(c for c in "IL" if array(c).itemsize == 4)  # the array typecode of 4-byte unsigned ints


class Tokenize:
    """Encodes batches of texts into uint32 token arrays, each ending with the EOS id.

    Stateless: a document's tokens depend only on its text, so restore re-tokenizes the few
    documents a checkpoint refers to.
    """

    def __init__(self, path: str, eos_token: str, bos_token: str | None = None) -> None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            hub = not Path(path).exists() and "/" not in path.strip("/") and not path.endswith(".json")
            why = ("is not a file; pass the path of a tokenizer.json (models on a hub are not downloaded)" if hub
                   else f"cannot be read: {exc}")
            raise ConfigError(f"tokenizer {path!r} {why}") from exc
        try:
            self._tok = Tokenizer.from_str(raw.decode())
        except Exception as exc:  # the `tokenizers` library raises bare Exceptions for a malformed file
            raise ConfigError(f"tokenizer {path!r} is not a tokenizer.json file ({exc}): give the path of a "
                              "Hugging Face `tokenizers` JSON file") from exc
        self.path, self.sha256 = path, hashlib.sha256(raw).hexdigest()
        self.eos_id = self.token_id(eos_token, "eos_token")
        self.bos_id = None if bos_token is None else self.token_id(bos_token, "bos_token")
        self.vocab_size = self._tok.get_vocab_size()

    def __repr__(self) -> str:
        return f"Tokenize({self.path!r}, eos_id={self.eos_id})"

    def token_id(self, token: str, setting: str) -> int:
        """The id of `token`, named by config `setting`; a ConfigError listing the special tokens if absent."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            special = sorted(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)
            raise ConfigError(f"{setting} {token!r} is not in the vocabulary of {self.path}: set {setting} to one of "
                              f"its special tokens: {', '.join(special) or '(it has none)'}")
        return tid

    @classmethod
    def for_config(cls, config: Any) -> Tokenize:
        return cls(config.tokenizer, config.eos_token, config.bos_token)

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, then EOS (and BOS first, with a `bos_token`).

        The ids list goes through an `array.array` (its constructor reads a list of ints in one C
        loop, about 4x faster than numpy's element-wise assignment) into an array of exactly the
        document's size, which the pipeline keeps until the tokens are packed."""
        first = 0 if self.bos_id is None else 1
        out = []
        for enc in self._tok.encode_batch_fast(texts, add_special_tokens=False):
            ids = np.frombuffer(array(_UINT32, enc.ids), dtype=np.uint32)
            arr = np.empty(len(ids) + 1 + first, dtype=np.uint32)
            if first:
                arr[0] = self.bos_id
            arr[first:-1] = ids
            arr[-1] = self.eos_id
            out.append(arr)
        return out

    def encodings(self, texts: list[str]) -> list[Any]:
        """The `tokenizers` Encodings of `texts` (ids and character offsets), no special tokens added."""
        return self._tok.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
