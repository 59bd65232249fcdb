"""Record formats, readers and writers together: the seekable JSONL.zst format (`jsonl_zst`) and
WebDataset-style tar shards (`tar`)."""

from zephon_stream.formats.jsonl_zst import seek_table, write_jsonl_shards
from zephon_stream.formats.tar import TarIndex, TarSample, parse_samples, tar_index, write_tar_shards

__all__ = ["TarIndex", "TarSample", "parse_samples", "seek_table", "tar_index", "write_jsonl_shards",
           "write_tar_shards"]
