"""Files written whole or not at all: a checkpoint, a shard, a version record.

`atomic_write` writes into a temporary file beside the target (so the rename stays on one
filesystem), makes it durable with fsync, and renames it over the target. A crash, a full disk
or an exception from the data at any point leaves the old file as it was (and no temporary
file behind, except after a crash).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike[str], chunks: Iterable[bytes]) -> None:
    """Replace `path` with the concatenated `chunks`, atomically and durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.writelines(chunks)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
