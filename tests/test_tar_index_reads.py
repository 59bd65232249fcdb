"""How many requests `tar_index` makes: few for samples smaller than a read, and large contents skipped.

A sample of an image and its caption (Tux Paint's stamps: about 40 KB) straddles the 64 KiB
reads, so a walk that skipped every content past a read would make one request (and one walk
call in a worker thread) per sample. The index must be the same whatever the reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from zephon_stream.connectors.memory import MemoryStore
from zephon_stream.formats.tar import INDEX_READ, TarIndex, tar_index, write_tar_shards

MAX = 1 << 24


def _data(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def _shard(tmp_path: Path, sizes: Iterator[int], n: int) -> bytes:
    samples = [(f"{i:05d}", {"png": _data(f"{i}.png", next(sizes)), "txt": _data(f"{i}.txt", 60)}) for i in range(n)]
    (path,) = write_tar_shards(samples, tmp_path, shard_bytes=1 << 40)
    return path.read_bytes()


def _index(data: bytes, read: int = INDEX_READ) -> tuple[TarIndex, MemoryStore]:
    store = MemoryStore()
    store.objects["s.tar"] = data
    return anyio.run(lambda: tar_index(store, "s.tar", len(data), MAX, read=read)), store


@pytest.mark.parametrize("png", [20_000, 40_000, 60_000])
def test_samples_smaller_than_a_read_take_few_requests(tmp_path: Path, png: int) -> None:
    data = _shard(tmp_path, iter(range(png, png + 400)), 200)
    idx, store = _index(data)
    whole, _ = _index(data, read=len(data))  # one read: nothing skipped
    assert idx == whole and len(idx.starts) == 201
    assert store.statistics().requests <= len(data) // (1 << 20) + 8  # reads grew to 1 MiB, not one per sample


def test_a_large_content_after_small_ones_is_skipped_unread(tmp_path: Path) -> None:
    sizes = [30_000] * 60 + [8 << 20] + [30_000] * 60  # reads have grown to 1 MiB when the large one comes
    data = _shard(tmp_path, iter(sizes), len(sizes))
    idx, store = _index(data)
    assert len(idx.starts) == len(sizes) + 1 and idx == _index(data, read=len(data))[0]
    assert store.statistics().bytes_read < len(data) - (6 << 20)  # most of the 8 MiB member was not read
