"""Record formats, readers and writers together: the seekable JSONL.zst format (`jsonl_zst`)."""

from zephon_stream.formats.jsonl_zst import seek_table, write_jsonl_shards

__all__ = ["seek_table", "write_jsonl_shards"]
