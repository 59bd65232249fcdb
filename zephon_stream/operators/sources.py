"""Which reader and which parser a source gets: the one place that knows every input format.

Every reader keeps the same contract (`blocks(offset)` yields `(offset, bytes)` blocks of whole
records, offsets relative to the split), and every parser turns a block into
`(offset, length, payload)` records, so the lane's producer, restore and source check do not
depend on the format.
"""

from __future__ import annotations

from typing import Any

from zephon_stream.connectors.base import Store
from zephon_stream.loader.config import Config
from zephon_stream.operators.images import ImageParser, TarSplitReader
from zephon_stream.operators.read import Parser, SourcePlan, Split, SplitReader

__all__ = ["make_parser", "make_reader"]


def make_parser(config: Config, source: int, plan: SourcePlan) -> Parser | ImageParser:
    """A fresh parser (with its own bad-record counter) for `source`."""
    src = config.sources[source]
    if src.image_field is not None:
        return ImageParser(plan.text_field, src.image_extensions, config.on_bad_record, config.max_record_bytes)
    return Parser(plan.text_field, config.on_bad_record)


def make_reader(config: Config, source: int, plan: SourcePlan, store: Store, split: Split, run_cpu: Any,
                bad: Any, **window: Any) -> SplitReader | TarSplitReader:
    """The reader of `split` of `source`; `window` is `spawn=` and `read_ahead=` for read-ahead."""
    kind = TarSplitReader if config.sources[source].image_field is not None else SplitReader
    return kind(store, plan.shards[split.shard], split, config.max_record_bytes, run_cpu, bad=bad, **window)
