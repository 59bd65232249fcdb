"""Record formats, readers and writers together: the seekable JSONL.zst format (`jsonl_zst`),
gzip members (`gzip`), Parquet footers and column chunks (`parquet`) and WebDataset-style tar
shards (`tar`)."""

from zephon_stream.formats.gzip import GzipStream, find_members
from zephon_stream.formats.jsonl_zst import seek_table, write_jsonl_shards
from zephon_stream.formats.parquet import ParquetFooter, read_footer
from zephon_stream.formats.tar import TarIndex, TarSample, parse_samples, tar_index, write_tar_shards

__all__ = ["GzipStream", "ParquetFooter", "TarIndex", "TarSample", "find_members", "parse_samples", "read_footer",
           "seek_table", "tar_index", "write_jsonl_shards", "write_tar_shards"]
