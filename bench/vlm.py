"""Image+text loader throughput against the Pillow work alone, peak RSS, and packing efficiency.

    .venv/bin/python bench/vlm.py [--repeats 5] [--epochs 3] [--backend threads] [--decode-processes N] [--no-fresh]

Data: Tux Paint's stamps (about 785 PNGs with human-written captions, `make vlm-data` or
`tools/vlm.py` fetch them into the cache) as tar shards, and a BPE with the Qwen2-VL vision tokens.
The *limit* is the loader's essential work done alone: every image of the same epochs decoded,
resized and cut into patches (`load_image` + `patchify`) in a pool of `cpu_threads` threads, on
the same cores. The *loader* streams the same epochs (`max_epochs`) at the defaults (12 lanes,
shuffle_window 64, Qwen2-VL's pixel bounds) with `seq_len` 2048; its time includes planning (the
tar index) and its first batch. `--decode-processes N` sets `vision.decode_processes` (the
decode calls go to N worker processes, out of the GIL; their CPU counts in the loader's).

Two protocols, both printed:
- *Same process* (the issue's): one process that imports torch, then `--repeats` rounds of limit
  and loader, the order swapped every round (limit first in rounds 0, 2, ...), each loader
  divided by the limit of its round. The first round's loader is the process's first: it pays
  the cold start (threads, the allocator's first touch of its pages) as a training job does once.
- *Fresh processes* (stricter, `--no-fresh` skips it): every run a new process, limit and loader
  alternating, so every loader run pays that cold start. Peak RSS and page faults come from these
  runs (the process's own, imports included): the loader's excess over the limit is memory the
  pipeline touches anew (collate's batch buffers are pooled, `collate.PixelBuffers`). So does
  each run's CPU by thread (`bench/loader.py`'s `ThreadCpu`): the loader's pool workers (decode,
  captions, reads, tar parse, collate), its event loop and the tokenizer's threads against the
  limit's pool.

Where the machine's noise hides the wall-clock ratio, images per CPU-second is the second figure;
the hypervisor's steal during the runs (/proc/stat) says how busy the host's other guests kept it.
Packing efficiency is the share of batch positions that hold a token, not padding, over a run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/loader.py's CPU count

from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.loader.config import VisionConfig


def config(shards: str, tokenizer: str, epochs: int, backend: str, decode_processes: int = 0) -> Config:
    vision = VisionConfig(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                          decode_processes=decode_processes)
    return Config(seed=0, lanes=12, seq_len=2048, global_batch_size=12, tokenizer=tokenizer, max_epochs=epochs,
                  backend=backend, vision=vision,
                  sources=[SourceConfig(name="stamps", uri=f"file://{shards}/", image_field="png", text_field="txt")])


def run_limit(cfg: Config) -> dict[str, float]:
    from tools.stamps import ensure_stamps, stamp_samples
    from zephon_stream.vision import load_image, patchify

    spec = cfg.vision.image_spec()
    images = [m["png"] for _, m in stamp_samples(ensure_stamps())] * cfg.max_epochs

    def one(data: bytes) -> int:
        return len(patchify(load_image(data, spec), spec))

    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(cfg.cpu_threads) as pool:
        patches = sum(pool.map(one, images, chunksize=8))
    seconds = time.perf_counter() - start
    return {"images": len(images), "patches": patches, "seconds": seconds, "cpu": time.process_time() - cpu}


def run_loader(cfg: Config) -> dict[str, float]:
    from loader import cpu_seconds  # this process and its descendants: the processes backend's workers too

    start, cpu = time.perf_counter(), cpu_seconds()
    images = tokens = positions = patches = 0
    first = None
    loader = Loader(cfg)
    for batch in loader:
        first = first if first is not None else time.perf_counter() - start
        images += len(batch["image_grid_thw"])
        patches += len(batch["pixel_values"])
        tokens += int(batch["num_tokens"].sum())
        positions += batch["input_ids"].numel()
    seconds = time.perf_counter() - start
    return {"images": images, "patches": patches, "tokens": tokens, "positions": positions, "seconds": seconds,
            "first_batch": first or 0.0, "cpu": cpu_seconds() - cpu}


def measured(mode: str, cfg: Config) -> dict[str, float]:
    """One run of `mode` in this process, with the hypervisor's steal during it."""
    from loader import steal_seconds

    steal = steal_seconds()
    out = run_limit(cfg) if mode == "limit" else run_loader(cfg)
    if steal is not None and (after := steal_seconds()) is not None:
        out["steal"] = after - steal
    return out


def child(mode: str, args: argparse.Namespace) -> None:
    import torch  # noqa: F401  (paid before any clock starts: the loader's batches are torch)

    cfg = config(args.shards, args.tokenizer, args.epochs, args.backend, args.decode_processes)
    if mode == "rounds":  # the same-process protocol: the order swapped every round
        rounds = []
        for r in range(args.repeats):
            order = ("limit", "loader") if r % 2 == 0 else ("loader", "limit")
            rounds.append({m: measured(m, cfg) for m in order})
            print(f"same process, round {r}: " + ", ".join(
                f"{m} {rounds[-1][m]['images'] / rounds[-1][m]['seconds']:.1f} images/s" for m in order),
                file=sys.stderr, flush=True)
        print(json.dumps(rounds))
        return
    from loader import ThreadCpu

    with ThreadCpu() as threads:
        out = measured(mode, cfg)
    out["threads"] = threads.seconds
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["peak_rss_mb"], out["page_faults"] = usage.ru_maxrss / 1024, usage.ru_minflt  # the process's, imports included
    print(json.dumps(out))


def spawn(mode: str, args: argparse.Namespace) -> Any:
    cmd = [sys.executable, __file__, "--child", mode, "--epochs", str(args.epochs), "--backend", args.backend,
           "--shards", args.shards, "--tokenizer", args.tokenizer, "--repeats", str(args.repeats),
           "--decode-processes", str(args.decode_processes)]
    run = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=None if mode == "rounds" else subprocess.PIPE,
                         text=True)
    return json.loads(run.stdout.splitlines()[-1])


def fmt(xs: list[float], unit: str = "", digits: int = 1) -> str:
    return f"{statistics.median(xs):,.{digits}f}{unit} (min {min(xs):,.{digits}f}, max {max(xs):,.{digits}f})"


def report(limit: list[dict[str, float]], loader: list[dict[str, float]]) -> None:
    """The throughput lines of paired runs (`limit[i]` against `loader[i]`)."""
    ratios = [b["images"] / b["seconds"] / (a["images"] / a["seconds"]) for a, b in zip(limit, loader)]
    cpu_ratios = [b["images"] / b["cpu"] / (a["images"] / a["cpu"]) for a, b in zip(limit, loader)]
    print(f"  limit: {fmt([a['images'] / a['seconds'] for a in limit], ' images/s')}")
    print(f"  loader: {fmt([b['images'] / b['seconds'] for b in loader], ' images/s')}, "
          f"{fmt([b['tokens'] / b['seconds'] for b in loader], ' tokens/s')}; "
          f"first batch {fmt([b['first_batch'] for b in loader], ' s')}")
    print(f"  loader / limit: {fmt(ratios, digits=3)}  (goal >= 0.85); per run: "
          + ", ".join(f"{r:.3f}" for r in ratios))
    print(f"  images per CPU-second: limit {fmt([a['images'] / a['cpu'] for a in limit])}, loader "
          f"{fmt([b['images'] / b['cpu'] for b in loader])}; loader / limit: {fmt(cpu_ratios, digits=3)}")
    if all("steal" in run for run in limit + loader):
        print("  hypervisor steal (CPU-s the host gave its other guests during a run, all CPUs): limit "
              f"{fmt([a['steal'] for a in limit], ' s', 2)}, loader {fmt([b['steal'] for b in loader], ' s', 2)}; "
              f"share of the run's CPU-s {fmt([x['steal'] / x['cpu'] for x in limit + loader], '', 3)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--backend", default="threads")
    ap.add_argument("--decode-processes", type=int, default=0, help="vision.decode_processes (0: decode on threads)")
    ap.add_argument("--data", default="data/vlm")
    ap.add_argument("--no-fresh", action="store_true", help="only the same-process rounds")
    ap.add_argument("--child", choices=["limit", "loader", "rounds"])
    ap.add_argument("--shards")
    ap.add_argument("--tokenizer")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args)
    from tools.vlm import build_vlm_demo

    paths = build_vlm_demo(args.data)
    if paths is None:
        raise SystemExit("the stamps could not be fetched: run `make vlm-data` (apt-get download) first")
    args.shards, args.tokenizer = paths.shards, paths.tokenizer
    rounds = spawn("rounds", args)
    limit, loader = [], []
    if not args.no_fresh:
        for r in range(args.repeats):
            limit.append(spawn("limit", args))
            loader.append(spawn("loader", args))
            print(f"fresh processes, run {r}: limit {limit[-1]['images'] / limit[-1]['seconds']:.1f} images/s, "
                  f"loader {loader[-1]['images'] / loader[-1]['seconds']:.1f} images/s", file=sys.stderr)
    threads = config(paths.shards, paths.tokenizer, 1, "threads").cpu_threads
    print(f"data: {paths.images} stamps x {args.epochs} epochs; backend {args.backend}, decode_processes "
          f"{args.decode_processes}; limit: load_image + "
          f"patchify on {threads} threads; {args.repeats} rounds of each protocol")
    print("same process (limit and loader in one process, the order swapped every round):")
    report([r["limit"] for r in rounds], [r["loader"] for r in rounds])
    if loader:
        print("fresh processes (every run a new process, each loader paying the cold start):")
        report(limit, loader)
        print(f"  peak RSS: limit {fmt([a['peak_rss_mb'] for a in limit], ' MB')}, loader "
              f"{fmt([b['peak_rss_mb'] for b in loader], ' MB')}")
        print(f"  page faults (whole process): limit {fmt([a['page_faults'] for a in limit], digits=0)}, "
              f"loader {fmt([b['page_faults'] for b in loader], digits=0)}")
        for name, runs in (("limit", limit), ("loader", loader)):
            kinds = sorted({k for run in runs for k in run["threads"]}, key=lambda k: -runs[0]["threads"].get(k, 0))
            print(f"  {name} CPU-s by thread: " + ", ".join(
                f"{k} {statistics.median(run['threads'].get(k, 0.0) for run in runs):.2f}" for k in kinds)
                + f"; the whole run, worker processes included, {statistics.median(run['cpu'] for run in runs):.2f}")
    last = rounds[-1]["loader"]
    print(f"packing efficiency (non-padding share): {last['tokens'] / last['positions']:.3f}; "
          f"images per run {last['images']} (limit {rounds[-1]['limit']['images']})")


if __name__ == "__main__":
    main()
