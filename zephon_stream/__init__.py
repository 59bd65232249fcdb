"""zephon-stream: a deterministic streaming data loader and a delta-compressed weight refit relay."""

from __future__ import annotations

from zephon_stream.errors import (
    AccessDenied,
    AlreadyExists,
    BaseVersionMismatch,
    CheckpointError,
    ConfigError,
    ConnectorError,
    DataError,
    DigestMismatch,
    IncompatibleState,
    ObjectNotFound,
    RefitError,
    Throttled,
    ZephonError,
)
from zephon_stream.loader.config import Config, ScheduleEntry, SourceConfig, TransformStep, VisionConfig
from zephon_stream.loader.loader import BatchStream, Loader, LoaderStatistics
from zephon_stream.loader.state import LaneState, LoaderState, StateHeader, state_from_bytes, state_to_bytes
from zephon_stream.operators.transforms import Filter, Map

__version__ = "0.1.0"

_REFIT = ("Publisher", "Sharding", "Subscriber", "VersionConflict")


def __getattr__(name: str) -> object:
    """The refit API, imported on first use (it loads torch; loader worker processes never do)."""
    if name in _REFIT:
        from zephon_stream import refit

        return getattr(refit, name)
    raise AttributeError(f"module 'zephon_stream' has no attribute {name!r}")

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
    "CheckpointError",
    "ConfigError",
    "ConnectorError",
    "DataError",
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
