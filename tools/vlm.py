"""The vision-language demo data: Tux Paint's stamps as tar shards, and a tokenizer that knows the
vision tokens.

A repository tool like ``tools/corpus.py`` (not in the wheel). ``build_vlm_demo(out_dir)`` writes

- ``out_dir/stamps/*.tar``: the stamps (``tools.stamps``; fetched once into the cache, GPL-2, so
  nothing derived is committed), and
- ``out_dir/tokenizer.json``: a byte-level BPE trained on the captions and on real English prose
  (the Debian manuals of ``tools.corpus``, when present), plus ``<|endoftext|>`` and the Qwen2-VL
  vision tokens ``<|image_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` as special tokens.

It returns None when the stamps cannot be fetched (no apt-get, no network).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import msgspec

__all__ = ["VISION_TOKENS", "VlmPaths", "build_vlm_demo"]

VISION_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"]
_PROSE_DOCS = 2000  # Debian manual sections beside the captions, so the vocabulary is not captions alone


class VlmPaths(msgspec.Struct, frozen=True):
    shards: str  # the directory of the tar shards
    tokenizer: str
    images: int


def build_vlm_demo(out_dir: str | Path, *, shard_mb: int = 4, vocab_size: int = 4096) -> VlmPaths | None:
    """Stamp shards and a vision tokenizer under `out_dir`; reused when already there."""
    from tools.corpus import debian_documents, train_tokenizer
    from tools.stamps import ensure_stamps, stamp_samples
    from zephon_stream.formats.tar import write_tar_shards

    out = Path(out_dir)
    shards, tok_path, done = out / "stamps", out / "tokenizer.json", out / ".built"
    if done.exists():
        return msgspec.json.decode(done.read_bytes(), type=VlmPaths)
    root = ensure_stamps()
    if root is None:
        return None
    samples = list(stamp_samples(root))
    print(f"writing {len(samples)} stamps as tar shards into {shards}", file=sys.stderr)
    write_tar_shards(samples, shards, shard_bytes=shard_mb << 20, prefix="stamps")
    captions = [(key, members["txt"].decode()) for key, members in samples]
    prose = list(itertools.islice(debian_documents(download=False), _PROSE_DOCS))
    train_tokenizer(captions + prose, tok_path, vocab_size=vocab_size)
    _add_special_tokens(tok_path, VISION_TOKENS)
    paths = VlmPaths(str(shards.resolve()), str(tok_path.resolve()), len(samples))
    done.write_bytes(msgspec.json.encode(paths))
    return paths


def _add_special_tokens(path: Path, tokens: list[str]) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tok.save(str(path), pretty=True)


if __name__ == "__main__":
    paths = build_vlm_demo(sys.argv[1] if len(sys.argv) > 1 else "data/vlm")
    print(paths)
    raise SystemExit(paths is None)
