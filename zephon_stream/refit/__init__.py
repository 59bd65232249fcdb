"""Bit-exact delta-compressed weight refit over object storage: codec, versions, publisher, subscriber.

The names below are imported on first use: the publisher and subscriber load torch, while the
key layout, MANIFESTs and codec (what a relay node needs) do not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zephon_stream.refit.layout import Sharding, TensorSpec, TensorTable
    from zephon_stream.refit.loop import PublishLoop, PublishStatistics
    from zephon_stream.refit.manifest import ChunkEntry, Manifest
    from zephon_stream.refit.publisher import Publisher, VersionConflict, VersionInfo
    from zephon_stream.refit.subscriber import LocalRecord, Subscriber
    from zephon_stream.refit.target import Fuse

_HOMES = {
    "ChunkEntry": "manifest",
    "Fuse": "target",
    "LocalRecord": "subscriber",
    "Manifest": "manifest",
    "Publisher": "publisher",
    "PublishLoop": "loop",
    "PublishStatistics": "loop",
    "Sharding": "layout",
    "Subscriber": "subscriber",
    "TensorSpec": "layout",
    "TensorTable": "layout",
    "VersionConflict": "publisher",
    "VersionInfo": "publisher",
}

__all__ = ["ChunkEntry", "Fuse", "LocalRecord", "Manifest", "PublishLoop", "PublishStatistics", "Publisher",
           "Sharding", "Subscriber", "TensorSpec", "TensorTable", "VersionConflict", "VersionInfo"]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zephon_stream.refit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"zephon_stream.refit.{home}"), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
