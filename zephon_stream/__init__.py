"""zephon-stream: a deterministic streaming data loader and a delta-compressed weight refit relay."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zephon_stream.errors import (
    AccessDenied,
    AlreadyExists,
    BaseVersionMismatch,
    BucketNotFound,
    CheckpointError,
    ConfigError,
    ConnectorError,
    DataError,
    DecodeWorkerError,
    DigestMismatch,
    IncompatibleState,
    ObjectNotFound,
    RefitError,
    Throttled,
    ZephonError,
)

if TYPE_CHECKING:
    from zephon_stream.loader.config import Config, ScheduleEntry, SourceConfig, TransformStep, VisionConfig
    from zephon_stream.loader.loader import BatchStream, Loader, LoaderStatistics
    from zephon_stream.loader.state import LaneState, LoaderState, StateHeader, state_from_bytes, state_to_bytes
    from zephon_stream.operators.transforms import Filter, Map
    from zephon_stream.refit import Publisher, Sharding, Subscriber, VersionConflict

__version__ = "0.1.0"

#: Where each lazily loaded name lives. Importing the package loads only the errors: a process that
#: needs no loader (the relay, the refit command) starts without numpy, the tokenizer or the vision
#: code, and a loader worker process never loads the refit API (it imports torch).
_HOMES = {
    **dict.fromkeys(("Config", "ScheduleEntry", "SourceConfig", "TransformStep", "VisionConfig"),
                    "zephon_stream.loader.config"),
    **dict.fromkeys(("BatchStream", "Loader", "LoaderStatistics"), "zephon_stream.loader.loader"),
    **dict.fromkeys(("LaneState", "LoaderState", "StateHeader", "state_from_bytes", "state_to_bytes"),
                    "zephon_stream.loader.state"),
    **dict.fromkeys(("Filter", "Map"), "zephon_stream.operators.transforms"),
    **dict.fromkeys(("Publisher", "Sharding", "Subscriber", "VersionConflict"), "zephon_stream.refit"),
}


def __getattr__(name: str) -> object:
    """The loader and refit API, imported on first use (`from zephon_stream import Loader` works as
    ever); the value is cached in the package's namespace, so this runs once per name."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zephon_stream' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = [
    "BatchStream",
    "Config",
    "Filter",
    "LaneState",
    "Loader",
    "LoaderState",
    "LoaderStatistics",
    "Map",
    "ScheduleEntry",
    "SourceConfig",
    "StateHeader",
    "TransformStep",
    "VisionConfig",
    "state_from_bytes",
    "state_to_bytes",
    "AccessDenied",
    "AlreadyExists",
    "BaseVersionMismatch",
    "BucketNotFound",
    "CheckpointError",
    "ConfigError",
    "ConnectorError",
    "DataError",
    "DecodeWorkerError",
    "DigestMismatch",
    "IncompatibleState",
    "ObjectNotFound",
    "Publisher",
    "Sharding",
    "Subscriber",
    "VersionConflict",
    "RefitError",
    "Throttled",
    "ZephonError",
]
