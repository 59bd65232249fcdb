"""Which reader and which parser a source gets: the one place that knows every input format.

Every reader keeps the same contract (`blocks(offset)` yields `(offset, bytes)` blocks of whole
records, offsets relative to the split), and every parser turns a block into
`(offset, length, payload)` records, so the lane's producer, restore and source check do not
depend on the format. A source's format is its plan's `format` (`read.FORMATS`: JSON lines,
Parquet or tar), set by the planner from its shards' suffixes.
"""

from __future__ import annotations

from typing import Any

from zephon_stream.connectors.base import Store
from zephon_stream.loader.config import Config
from zephon_stream.operators.images import ImageParser, TarSplitReader
from zephon_stream.operators.parquet import ParquetParser, ParquetSplitReader
from zephon_stream.operators.read import Parser, SourcePlan, Split, SplitReader
from zephon_stream.operators.transforms import Records

__all__ = ["make_parser", "make_reader"]


def make_parser(config: Config, source: int, plan: SourcePlan) -> Parser | ImageParser | ParquetParser:
    """A fresh parser (with its own bad-record counter) for `source`."""
    src = config.sources[source]
    records = Records(src, source, config.seed)  # the source's transforms (resolved here, in every process) and payload
    if plan.format == "parquet":
        return ParquetParser(plan.text_field, src.image_field, config.on_bad_record, config.max_record_bytes, records)
    if plan.format == "tar":
        return ImageParser(plan.text_field, src.image_extensions, config.on_bad_record, config.max_record_bytes)
    return Parser(plan.text_field, config.on_bad_record, records)


def make_reader(config: Config, source: int, plan: SourcePlan, store: Store, split: Split, run_cpu: Any,
                bad: Any, **window: Any) -> SplitReader | TarSplitReader | ParquetSplitReader:
    """The reader of `split` of `source`; `window` is `spawn=` and `read_ahead=` for read-ahead."""
    shard = plan.shards[split.shard]
    if plan.format == "parquet":
        image = config.sources[source].image_field
        kind = "messages" if config.sources[source].messages_field is not None else "text"
        src = config.sources[source]
        columns = ([(plan.text_field, kind)] + ([(image, "image")] if image else [])
                   + [(name, what) for name, what in ((src.tools_field, "tools"), (src.documents_field, "documents"))
                      if name is not None])
        if config.sources[source].transforms:  # the steps get whole rows: every column is fetched
            columns.append(("*", "record"))
        return ParquetSplitReader(store, shard, split, config.max_record_bytes, run_cpu, columns=columns, bad=bad,
                                  **window)
    kind = TarSplitReader if plan.format == "tar" else SplitReader
    return kind(store, shard, split, config.max_record_bytes, run_cpu, bad=bad, **window)
