"""Time to the first batch, fresh and after a restore, at the default order settings, on real text.

    .venv/bin/python bench/first_batch.py [--runs 5] [--step 200] [--mb 48] [--data data/bench]

The bench data of `bench/loader.py` (`make bench-data` first): JSONL.zst shards of the Debian
documentation and a byte-level BPE trained on it. The config is the defaults (12 lanes,
`shuffle_window` 64, threads) with `seq_len` 2048 and 24 samples a global batch, as there.

- fresh: `Loader(config)` to its first batch;
- restore: a new `Loader(config)`, `load_state_dict` of the state at `--step`, to its first batch.

The two alternate, `--runs` times each; each prints the median and the spread (min, max) of the
wall time, and of the CPU-seconds this process used meanwhile (every thread of it: the lanes,
the tokenizer's): on a shared machine the wall time is noisy, the CPU time much less so. It
also counts the documents and tokens tokenized before the first batch (every lane together),
which no other load on the machine changes, and the bytes and requests read from the store
(every read: planning, the restore's documents, the lanes' read-ahead). torch is imported
before any clock starts: the Loader imports it, and a trainer has it already.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: F401  (before the clocks: see above)

from bench.loader import prepare
from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.connectors.base import Store
from zephon_stream.loader.lane import Lanes
from zephon_stream.testing.stores import WrappedStore


class TokenizeCount:
    """Documents and tokens passed through `Lanes.tokenize` while installed (every lane, every thread)."""

    def __init__(self) -> None:
        self.docs = self.tokens = self.reread = 0  # reread: documents a restore read again (the rest: new ones)
        self._lock = threading.Lock()
        self._original: Callable[..., Any] = Lanes.tokenize

    def __enter__(self) -> TokenizeCount:
        original, counter = self._original, self

        def counted(lanes: Lanes, source: int, docs: list[Any], key: str, *args: Any, **kwargs: Any) -> Any:
            out = original(lanes, source, docs, key, *args, **kwargs)
            with counter._lock:
                counter.docs += len(out)
                counter.reread += len(out) if key == "a checkpoint's documents" else 0
                counter.tokens += sum(len(payload) for _, payload in out)
            return out

        Lanes.tokenize = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Lanes.tokenize = self._original  # type: ignore[method-assign]


class ReadCount(WrappedStore):
    """Bytes and requests read through the store (a `wrap_store`: every store of the loader)."""

    totals = [0, 0]  # bytes, requests: of every store wrapped since the last reset

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data = await self.inner.read(key, start, end)
        ReadCount.totals[0] += len(data)
        ReadCount.totals[1] += 1
        return data


def counting(store: Store) -> Store:
    return ReadCount(store)


Run = tuple[float, float, int, int, int, int, int]


def first_batch(config: Config, state: dict[str, bytes] | None) -> Run:
    """(wall seconds, CPU-seconds, documents tokenized, tokens tokenized, documents of those re-read for the
    restore, bytes read, read requests) from `Loader(config)` to its first batch."""
    gc.collect()
    ReadCount.totals[:] = [0, 0]
    with TokenizeCount() as count:
        t, c = time.perf_counter(), time.process_time()
        loader = Loader(config, wrap_store=counting)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        next(it)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        docs, tokens, reread = count.docs, count.tokens, count.reread
        read, requests = ReadCount.totals
    loader.close()
    return wall, cpu, docs, tokens, reread, read, requests


def state_at(config: Config, step: int) -> dict[str, bytes]:
    loader = Loader(config)
    for _ in loader:
        if loader.step == step:
            break
    state = loader.state_dict()
    loader.close()
    return state


def spread(xs: list[float], unit: str = "s") -> str:
    return f"median {statistics.median(xs):.2f} {unit} (min {min(xs):.2f}, max {max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--step", type=int, default=200)
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--data", type=Path, default=Path("data/bench"))
    args = ap.parse_args()
    _, tok = prepare(args.data.resolve(), args.mb)
    config = Config(seed=1, lanes=12, seq_len=2048, global_batch_size=24, tokenizer=str(tok), max_epochs=0,
                    sources=[SourceConfig(name="text", uri=f"file://{tok.parent}/text/")])
    print(f"config: {config.lanes} lanes, shuffle_window {config.shuffle_window}, seq_len {config.seq_len}, "
          f"global batch {config.global_batch_size}, backend {config.backend}; data {tok.parent / 'text'}")
    t = time.perf_counter()
    state = state_at(config, args.step)
    print(f"state at step {args.step} taken in {time.perf_counter() - t:.1f} s")
    runs: dict[str, list[Run]] = {"fresh": [], f"restore at step {args.step}": []}
    for r in range(args.runs):
        for name, st in zip(runs, (None, state)):
            run = first_batch(config, st)
            runs[name].append(run)
            print(f"  run {r} {name}: first batch after {run[0]:.2f} s, {run[1]:.2f} CPU-s; {run[2]} documents, "
                  f"{run[3]:,} tokens tokenized ({run[4]} documents re-read); {run[5] / 1e6:.2f} MB read in "
                  f"{run[6]} requests")
    for name, rs in runs.items():
        print(f"{name}: wall {spread([r[0] for r in rs])}; CPU {spread([r[1] for r in rs], 'CPU-s')}; tokenized "
              f"before it: median {statistics.median(r[2] for r in rs):.0f} documents, "
              f"{statistics.median(r[3] for r in rs):,.0f} tokens; read: median "
              f"{statistics.median(r[5] for r in rs) / 1e6:.2f} MB in "
              f"{statistics.median(r[6] for r in rs):.0f} requests")


if __name__ == "__main__":
    main()
