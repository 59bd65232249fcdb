"""Bit-exact delta-compressed weight refit over object storage: codec, versions, publisher, subscriber."""

from __future__ import annotations

from zephon_stream.refit.layout import Sharding, TensorSpec, TensorTable
from zephon_stream.refit.manifest import ChunkEntry, Manifest
from zephon_stream.refit.publisher import Publisher, VersionConflict, VersionInfo
from zephon_stream.refit.subscriber import LocalRecord, Subscriber

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
