"""zephon-stream: a deterministic streaming data loader and a delta-compressed weight refit relay."""

from __future__ import annotations

from ._exceptions import (
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

__version__ = "0.1.0"

__all__ = sorted([
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
    "RefitError",
    "Throttled",
    "ZephonError",
])
