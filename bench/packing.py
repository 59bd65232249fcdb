"""Padding share of the packing strategies on the bench data (real text), and documents dropped.

    .venv/bin/python bench/packing.py [--mb 48] [--seq-len 2048] [--data data/bench] [--only none,truncate]

Data: bench/loader.py's (Debian's kernel and Python documentation, topped up with the standard
library's sources: real English text and code, fetched beforehand by `make bench-data`), one
source, one epoch (max_epochs = 1) through the Loader (threads backend, 12 lanes, seq_len 2048).
Strategies: `concat`, `best_fit` with windows of 16, 64 and 256 documents, `none`, and `none`
with `truncate`. For each:

- padding share: padding positions over all positions of the samples that hold data (what
  the strategy itself wastes), as the median over the 12 lanes (min, max), and over the epoch;
- tail: the samples of only padding at the epoch's end, where some lanes have ended and others
  not (the same cause for every strategy; its size follows how evenly the lanes end);
- documents dropped: documents in the data whose end (EOS) never reaches a batch; tokens lost:
  tokens in the data that no batch holds. Zero for every strategy but `truncate`, which cuts
  documents at seq_len and counts them (`Loader.statistics().truncated_*`).

The figures are pure functions of the config and the data (determinism), so one run each.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from zephon_stream import Config, Loader, SourceConfig  # noqa: E402
from zephon_stream.operators.tokenize import Tokenize  # noqa: E402

STRATEGIES = {"concat": ("concat", {}), "best_fit16": ("best_fit", {"packing_window": 16}),
              "best_fit64": ("best_fit", {"packing_window": 64}), "best_fit256": ("best_fit", {"packing_window": 256}),
              "none": ("none", {}), "truncate": ("none", {"truncate": True})}


def bench_prepare(root: Path, mb: int) -> tuple[list[str], Path]:
    """bench/loader.py's `prepare`: the same documents, shards and tokenizer (built once, reused)."""
    spec = importlib.util.spec_from_file_location("bench_loader", ROOT / "bench" / "loader.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prepare(root, mb)


def epoch(config: Config) -> dict[str, object]:
    """One epoch: per-lane real tokens and positions of the samples with data, tail samples, EOS count."""
    eos = Tokenize.for_config(config).eos_id
    real = np.zeros(config.lanes, np.int64)
    positions = np.zeros(config.lanes, np.int64)
    tail = ends = 0
    loader = Loader(config)
    t = time.perf_counter()
    for batch in loader:
        ids, n = batch["input_ids"].numpy(), batch["num_tokens"].numpy()
        lanes = batch["lanes"].numpy()
        inside = np.arange(ids.shape[1])[None, :] < n[:, None]  # real tokens open every sample
        ends += int(((ids == eos) & inside).sum())
        data = n > 0
        tail += int((~data).sum())
        np.add.at(real, lanes[data], n[data])
        np.add.at(positions, lanes[data], config.seq_len)
    stats = loader.statistics()
    return {"real": real, "positions": positions, "tail": tail, "ends": ends, "seconds": time.perf_counter() - t,
            "truncated": stats.truncated_documents, "dropped": stats.truncated_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "bench")
    ap.add_argument("--only", default="", help="comma-separated names to run: concat, best_fit16, best_fit64, "
                    "best_fit256, none, truncate (default: all)")
    args = ap.parse_args()
    texts, tok = bench_prepare(args.data.resolve(), args.mb)
    lengths = np.array([len(ids) for ids in Tokenize(str(tok), "<|endoftext|>")(texts)])
    tokens_in = int(lengths.sum())
    print(f"data: {len(texts)} documents, {tokens_in:,} tokens (with EOS); document length in tokens: median "
          f"{int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, max {lengths.max()}; "
          f"{(lengths > args.seq_len).mean():.1%} longer than seq_len {args.seq_len}", flush=True)
    base = Config(seed=1, lanes=12, seq_len=args.seq_len, global_batch_size=24, tokenizer=str(tok), max_epochs=1,
                  backend="threads", sources=[SourceConfig(name="text", uri=f"file://{tok.parent}/text/")])
    print("strategy                padding share: lanes median (min, max)   epoch   tail samples   documents "
          "dropped   tokens lost   time", flush=True)
    for key in args.only.split(",") if args.only else STRATEGIES:
        packing, extra = STRATEGIES[key]
        run = epoch(base.replace(packing=packing, **extra))
        per_lane = 1 - run["real"] / run["positions"]
        share = 1 - run["real"].sum() / run["positions"].sum()
        lost = tokens_in - int(run["real"].sum())
        name = packing + "".join(f" {k}={v}" for k, v in extra.items())
        print(f"{name:28s} {statistics.median(per_lane):7.2%} ({per_lane.min():.2%}, {per_lane.max():.2%})"
              f"      {share:7.2%}   {run['tail']:8d}   {len(texts) - run['ends']:12d}   {lost:11,d}   "
              f"{run['seconds']:5.0f} s", flush=True)
        if lost != run["dropped"]:
            raise SystemExit(f"{name}: {lost} tokens lost but {run['dropped']} counted as dropped by truncate")


if __name__ == "__main__":
    main()
