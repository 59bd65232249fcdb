"""Tokenize: HF `tokenizers` from a tokenizer.json, batched, with EOS after each document."""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from zephon_stream.engine.cpu import rayon_threads, usable_cores
from zephon_stream.engine.forks import ForkLock
from zephon_stream.errors import ConfigError

__all__ = ["WORD_CACHE_ENV", "WORD_CACHE_TOTAL", "Tokenize", "word_cache_size"]

_UINT32 = next(c for c in "IL" if array(c).itemsize == 4)  # the array typecode of 4-byte unsigned ints

#: Words that the tokenizer's threads keep in their BPE word caches, all together: each thread
#: keeps WORD_CACHE_TOTAL // threads, at least WORD_CACHE_MIN and at most the library's 10,000.
WORD_CACHE_TOTAL, WORD_CACHE_MIN, WORD_CACHE_MAX = 20_000, 2_500, 10_000
#: Environment variable that sets the words a thread keeps instead: a number (0: no cache), or
#: "tokenizers" to leave the library's own size.
WORD_CACHE_ENV = "ZEPHON_WORD_CACHE"
#: `Tokenize.each` encodes texts of at most this many characters in all on the calling thread.
INLINE_CHARS = 4096
#: Tokenizers that `Tokenize.shared` keeps for reuse in this process (the most recently used).
SHARED_KEEP = 4


def word_cache_size(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """Words a thread of the tokenizer's pool keeps in its BPE word cache: `ZEPHON_WORD_CACHE`
    if set ("tokenizers": None, the library's own size), else the share of `WORD_CACHE_TOTAL` of
    one of the pool's threads (`RAYON_NUM_THREADS` as Rayon reads it, `engine.cpu.rayon_threads`,
    else one a core this process may run on)."""
    spec = environ.get(WORD_CACHE_ENV, "").strip()
    if spec == "tokenizers":
        return None
    if spec:
        if not spec.isdigit():
            raise ConfigError(f"{WORD_CACHE_ENV}={spec!r}: give a number of words (0 turns the cache off) or "
                              f"'tokenizers' for the library's own size")
        return int(spec)
    n = rayon_threads(environ) or usable_cores()
    return min(WORD_CACHE_MAX, max(WORD_CACHE_MIN, WORD_CACHE_TOTAL // n))


class Tokenize:
    """Encodes batches of texts into uint32 token arrays, each ending with the EOS id.

    Stateless: a document's tokens depend only on its text, so restore re-tokenizes the few
    documents a checkpoint refers to.

    A BPE model's word cache is bounded (`word_cache` words a thread; by default
    `word_cache_size()`; None leaves the library's size). `tokenizers` (0.23) keeps one cache per
    thread of its pool, one thread per core, of up to 10,000 words (about 350-460 bytes each in
    use), filled as each thread meets new words and never emptied: memory that grows with the
    cores and for minutes, with every thread's words pinning pages of its own malloc arena. With
    32 threads on the bench text, the bytes in use after 20 s were 138 MB at 10,000 words a
    thread, 53 MB at 2,500 and 25 MB without a cache. So the threads share 20,000 words: 10,000
    each on 2 cores, as before, and 2,500 each from 8 cores on. On one thread, 2,500 words cost
    0-3% of the tokens per CPU-second against 10,000 (both bench BPEs; on 2 threads about 1.5%),
    1,000 up to 5%, none 8-10%. The cache only saves work: the ids are the same at any size.
    """

    def __init__(self, path: str, eos_token: str, bos_token: str | None = None,
                 word_cache: int | None | bool = True, *, raw: bytes | None = None) -> None:
        raw = _read(path) if raw is None else raw  # `raw`: the file's bytes, already read
        try:
            self._tok = Tokenizer.from_str(raw.decode())
        except Exception as exc:  # the `tokenizers` library raises bare Exceptions for a malformed file
            raise ConfigError(f"tokenizer {path!r} is not a tokenizer.json file ({exc}): give the path of a "
                              "Hugging Face `tokenizers` JSON file") from exc
        # a tokenizer.json may pad or truncate its encodings (set for a model's inputs): a document's ids
        # are its whole text, as long as it is, whatever else is in the call
        self._tok.no_padding()
        self._tok.no_truncation()
        size = word_cache_size() if word_cache is True else word_cache
        resize = getattr(self._tok.model, "_resize_cache", None)  # BPE models (tokenizers >= 0.15)
        if size is not None and resize is not None:
            resize(size)
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
        return cls.shared(config.tokenizer_file, config.eos_token, config.bos_token)

    @classmethod
    def shared(cls, path: str, eos_token: str, bos_token: str | None = None) -> Tokenize:
        """The process's Tokenize for this file (by its bytes), tokens and word cache size: one
        instance serves every Loader (and worker) of the process that asks for the same.

        `tokenizers` (0.23) keeps its BPE word caches in thread-local maps keyed by model
        instance, and a model that goes away leaves its entries there: every instance that has
        run on the pool adds up to a full cache to each of its threads, for as long as the
        process lives. On the bench, the second, third and fourth Loader of a process (a new
        instance each) spent 5%, 17% and 19% more tokenizer CPU than the first (6-8% with one
        shared instance), and each left its caches behind. Tokenize holds no state of its own
        between calls, and the library's encode calls may run on many threads at once.
        """
        raw = _read(path)
        key = (os.path.realpath(path), hashlib.sha256(raw).hexdigest(), eos_token, bos_token, word_cache_size())
        with _SHARED_LOCK:
            if (tok := _SHARED.get(key)) is not None:
                _SHARED.move_to_end(key)
                return tok
        tok = cls(path, eos_token, bos_token, raw=raw)  # outside the lock: seconds for a large vocabulary
        with _SHARED_LOCK:
            tok = _SHARED.setdefault(key, tok)  # a thread that made the same one first wins
            _SHARED.move_to_end(key)
            while len(_SHARED) > SHARED_KEEP:
                _SHARED.popitem(last=False)
        return tok

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, then EOS (and BOS first, with a `bos_token`).

        The ids list goes through an `array.array` (its constructor reads a list of ints in one C
        loop, about 4x faster than numpy's element-wise assignment) into an array of exactly the
        document's size, which the pipeline keeps until the tokens are packed."""
        return [self._document(enc.ids) for enc in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def each(self, texts: list[str]) -> list[np.ndarray]:
        """`self(texts)`, encoded on the calling thread when the texts are short (at most
        `INLINE_CHARS` in all): for threads that are parallel already, as the image path's
        decode threads with their captions. Longer texts go to `self(texts)`.

        A batch call hands its texts to the tokenizer's Rayon pool and waits for them there: a
        hand-off each way, with Rayon's threads spinning for work on the cores that decode. On
        the bench's captions (21 characters; calls of about 10) that cost more than the
        encoding: 12.8 us a caption in calls of 10, 7.5 us encoded one by one; and the image
        loader's involuntary context switches went from 10,300 to 4,300 a run. One by one, the
        encoding holds the GIL (the library releases it for batches only): about 8 us a caption.
        The calling threads keep BPE word caches of their own, as Rayon's threads do (see the
        class docstring): for the image path, `vision.decode_threads` more caches of captions' words.
        """
        if sum(map(len, texts)) > INLINE_CHARS:
            return self(texts)
        encode = self._tok.encode
        return [self._document(encode(text, add_special_tokens=False).ids) for text in texts]

    def _document(self, ids: list[int]) -> np.ndarray:
        first = 0 if self.bos_id is None else 1
        arr = np.empty(len(ids) + 1 + first, dtype=np.uint32)
        if first:
            arr[0] = self.bos_id
        arr[first:-1] = np.frombuffer(array(_UINT32, ids), dtype=np.uint32)
        arr[-1] = self.eos_id
        return arr

    def encodings(self, texts: list[str]) -> list[Any]:
        """The `tokenizers` Encodings of `texts` (ids and character offsets), no special tokens added."""
        return self._tok.encode_batch(texts, add_special_tokens=False)

    @property
    def tokenizer(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` behind this Tokenize (shared by every Loader of the process
        that uses the same file: read it, do not change its settings)."""
        return self._tok

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


_SHARED: OrderedDict[tuple[Any, ...], Tokenize] = OrderedDict()  # see Tokenize.shared
_SHARED_LOCK = ForkLock()


def _read(path: str) -> bytes:
    """The bytes of the tokenizer file `path`, or a ConfigError that says what to pass instead."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        # a model's name ("gpt2", "Qwen/Qwen2-0.5B"; a config file's is made absolute from its folder)
        hub = not Path(path).exists() and not path.endswith(".json")
        why = ("is not a file; pass the path of a tokenizer.json (models on a hub are not downloaded)"
               if hub and "/" not in path.strip("/") else
               "is not a file or a model's directory; pass the path of a tokenizer.json (in a config file, relative "
               "to it; models on a hub are not downloaded)" if hub
               else "is a directory with no tokenizer.json in it: pass the path of a tokenizer.json"
               if Path(path).is_dir() else f"cannot be read: {exc}")
        raise ConfigError(f"tokenizer {path!r} {why}") from exc
