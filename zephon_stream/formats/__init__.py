"""Record formats: the seekable JSONL.zst writer (the reader is `zephon_stream.operators.read`)."""

from zephon_stream.formats.jsonl_zst import write_jsonl_shards

__all__ = ["write_jsonl_shards"]
