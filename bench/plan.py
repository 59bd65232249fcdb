"""Planning a source of many shards behind request latency: overlapped against one at a time.

    .venv/bin/python bench/plan.py [--shards 200] [--latency-ms 20] [--runs 3]

Every shard is planned at each start and each restore: a seek table or Parquet footer read, or a
walk of zstd frame headers. The shards here are real text (the Python FAQ of the Debian docs
that `make bench-data` fetches, else this repository's README), cut into `--shards` objects in a
MemoryStore whose every read and head first sleeps `--latency-ms` (S3's first-byte latency is
of that order). Three kinds: `.jsonl.zst` without a seek table (a probe for the table, then the
frame headers), `.jsonl.zst` with one, and Parquet. For each it times `plan_source` with
`PLAN_WORKERS` shards at once and with 1 (the code before the change), alternating, and prints
the medians (min - max) and their ratio. Then a mixture of `--sources` sources (the shards shared
out among them, each listing a request too): `plan_data` with `SOURCES_AT_ONCE` sources at once
and with 1 (the code before).
"""

from __future__ import annotations

import argparse
import functools
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zephon_stream.connectors import MemoryStore
from zephon_stream.formats.jsonl_zst import seek_table
from zephon_stream.loader import plan
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.operators import read
from zephon_stream.testing.stores import WrappedStore


class Latent(WrappedStore):
    def __init__(self, inner: MemoryStore, ms: float) -> None:
        super().__init__(inner)
        self.ms = ms

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        await anyio.sleep(self.ms / 1000)
        return await self.inner.read(key, start, end)

    async def head(self, key: str):
        await anyio.sleep(self.ms / 1000)
        return await self.inner.head(key)

    async def list(self, prefix: str = ""):
        await anyio.sleep(self.ms / 1000)
        return await self.inner.list(prefix)


def _texts() -> list[str]:
    from tools.corpus import ensure_debian_docs

    root = ensure_debian_docs()
    faq = root / "usr/share/doc/python3.11/html/_sources/faq" if root else None
    files = sorted(faq.glob("*.rst.txt")) if faq is not None and faq.is_dir() else [Path(__file__).parents[1] /
                                                                                      "README.md"]
    return [p for f in files for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def _store(kind: str, shards: int, texts: list[str]) -> MemoryStore:
    store = MemoryStore()
    per = max(1, len(texts) // shards)
    for i in range(shards):
        part = [texts[(i * per + j) % len(texts)] for j in range(per)]
        lines = [msgspec.json.encode({"text": t}) + b"\n" for t in part]
        if kind == "parquet":
            buf = io.BytesIO()
            pq.write_table(pa.table({"text": part}), buf)
            store.objects[f"s/{i:05d}.parquet"] = buf.getvalue()
            continue
        half = len(lines) // 2 or 1
        frames = [zstandard.ZstdCompressor().compress(b"".join(x)) for x in (lines[:half], lines[half:]) if x]
        table = seek_table([(len(f), len(b"".join(x))) for f, x in zip(frames, (lines[:half], lines[half:]))])
        store.objects[f"s/{i:05d}.jsonl.zst"] = b"".join(frames) + (table if kind == "zst-seekable" else b"")
    return store


async def _plan_sources(stores: list[MemoryStore], ms: float) -> float:
    cfg = Config(seed=0, seq_len=2048, global_batch_size=12, tokenizer="unused", lanes=12, split_bytes=1 << 20,
                 sources=[SourceConfig(name=f"s{i}", uri=f"memory://bench{i}/s/") for i in range(len(stores))])
    t = time.perf_counter()
    await plan.plan_data(cfg, [Latent(s, ms) for s in stores])
    return time.perf_counter() - t


async def _plan(store: MemoryStore, ms: float) -> float:
    t = time.perf_counter()
    await read.plan_source(Latent(store, ms), "s/", "bench", "memory://s/", "text", 12, 1 << 20, "error")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=200)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sources", type=int, default=8, help="a mixture of this many sources, --shards in all")
    args = ap.parse_args()
    texts = _texts()
    print(f"{args.shards} shards, {args.latency_ms:g} ms a request, {args.runs} runs each, alternating; "
          f"median (min - max) seconds")
    for kind in ("zst", "zst-seekable", "parquet"):
        store = _store(kind, args.shards, texts)
        _compare(f"{kind:>13}: ", "at a time", read, "PLAN_WORKERS", args.runs,
                 functools.partial(anyio.run, _plan, store, args.latency_ms))
    # a mixture: the sources planned one after another (the code before) and at once
    per = max(1, args.shards // args.sources)
    stores = [_store("zst-seekable", per, texts) for _ in range(args.sources)]
    _compare(f"{args.sources} sources of {per} zst-seekable shards: ", "source at a time", plan, "SOURCES_AT_ONCE",
             args.runs, functools.partial(anyio.run, _plan_sources, stores, args.latency_ms))


def _compare(label: str, unit: str, owner: object, setting: str, runs: int, run: Callable[[], float]) -> None:
    """Time `run` with `owner.setting` at 1 and at its value, alternating, and print both and their ratio."""
    many = getattr(owner, setting)
    times: dict[int, list[float]] = {1: [], many: []}
    try:
        for _ in range(runs):
            for n in times:
                setattr(owner, setting, n)
                times[n].append(run())
    finally:
        setattr(owner, setting, many)
    a, b = (statistics.median(times[n]) for n in (1, many))
    print(f"{label}one {unit} {a:.2f} ({min(times[1]):.2f} - {max(times[1]):.2f}), {many} at once {b:.2f} "
          f"({min(times[many]):.2f} - {max(times[many]):.2f}), ratio {a / b:.1f}x")

if __name__ == "__main__":
    main()
