"""Bit-exact delta-compressed weight refit over object storage: codec, versions, publisher, subscriber."""

from __future__ import annotations

from .layout import Sharding, TensorSpec, TensorTable
from .manifest import ChunkEntry, Manifest
from .publisher import Publisher, VersionConflict, VersionInfo
from .subscriber import LocalRecord, Subscriber

__all__ = sorted([
    "ChunkEntry",
    "LocalRecord",
    "Manifest",
    "Publisher",
    "Sharding",
    "Subscriber",
    "TensorSpec",
    "TensorTable",
    "VersionConflict",
    "VersionInfo",
])
