"""Image+text loader throughput against the Pillow work alone, peak RSS, and packing efficiency.

    .venv/bin/python bench/vlm.py [--repeats 5] [--epochs 3] [--backend threads]

Data: Tux Paint's stamps (about 785 PNGs with human-written captions, `make vlm-data` or
`tools/vlm.py` fetch them into the cache) as tar shards, and a BPE with the Qwen2-VL vision tokens.
The *limit* is the loader's essential work done alone: every image of the same epochs decoded,
resized and cut into patches (`load_image` + `patchify`) in a pool of `cpu_threads` threads, in a
process of its own, on the same cores. The *loader* streams the same epochs (`max_epochs`) at the
defaults (12 lanes, shuffle_window 64, Qwen2-VL's pixel bounds) with `seq_len` 2048. Each run is a
fresh process (so peak RSS is its own) that imports torch before its clock starts; limit and
loader runs alternate; the loader's time includes planning (the tar index) and its first batch. Packing efficiency is
the share of batch positions that hold a token, not padding, over the whole run. Where the
machine's noise hides the wall-clock ratio, images per CPU-second of the process is the second figure;
the hypervisor's steal during the runs (/proc/stat) says how busy the host's other guests kept it.
Page faults are the process's minor faults (imports included): the loader's excess over the limit
is memory the pipeline touches anew (collate's batch buffers are pooled, `collate.PixelBuffers`).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/loader.py's CPU count

from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.loader.config import VisionConfig


def config(shards: str, tokenizer: str, epochs: int, backend: str) -> Config:
    vision = VisionConfig(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>")
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


def child(mode: str, args: argparse.Namespace) -> None:
    import torch  # noqa: F401  (both modes pay the import before the clock starts: the loader's batches are torch)
    from loader import steal_seconds

    cfg = config(args.shards, args.tokenizer, args.epochs, args.backend)
    steal = steal_seconds()
    out = run_limit(cfg) if mode == "limit" else run_loader(cfg)
    if steal is not None and (after := steal_seconds()) is not None:
        out["steal"] = after - steal
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["peak_rss_mb"], out["page_faults"] = usage.ru_maxrss / 1024, usage.ru_minflt  # the process's, imports included
    print(json.dumps(out))


def spawn(mode: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", mode, "--epochs", str(args.epochs), "--backend", args.backend,
           "--shards", args.shards, "--tokenizer", args.tokenizer]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def fmt(xs: list[float], unit: str = "", digits: int = 1) -> str:
    return f"{statistics.median(xs):,.{digits}f}{unit} (min {min(xs):,.{digits}f}, max {max(xs):,.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--backend", default="threads")
    ap.add_argument("--data", default="data/vlm")
    ap.add_argument("--child", choices=["limit", "loader"])
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
    limit, loader = [], []
    for r in range(args.repeats):
        limit.append(spawn("limit", args))
        loader.append(spawn("loader", args))
        print(f"run {r}: limit {limit[-1]['images'] / limit[-1]['seconds']:.1f} images/s, loader "
              f"{loader[-1]['images'] / loader[-1]['seconds']:.1f} images/s", file=sys.stderr)
    ratios = [b["images"] / b["seconds"] / (a["images"] / a["seconds"]) for a, b in zip(limit, loader)]
    cpu_ratios = [b["images"] / b["cpu"] / (a["images"] / a["cpu"]) for a, b in zip(limit, loader)]
    threads = config(paths.shards, paths.tokenizer, 1, "threads").cpu_threads
    print(f"data: {paths.images} stamps x {args.epochs} epochs; backend {args.backend}; "
          f"{args.repeats} alternating runs")
    print(f"limit  (load_image + patchify, {threads} threads): "
          f"{fmt([a['images'] / a['seconds'] for a in limit], ' images/s')}; "
          f"peak RSS {fmt([a['peak_rss_mb'] for a in limit], ' MB')}")
    print(f"loader: {fmt([b['images'] / b['seconds'] for b in loader], ' images/s')}, "
          f"{fmt([b['tokens'] / b['seconds'] for b in loader], ' tokens/s')}")
    print(f"        peak RSS {fmt([b['peak_rss_mb'] for b in loader], ' MB')}; "
          f"first batch {fmt([b['first_batch'] for b in loader], ' s')}")
    print(f"page faults (whole process): limit {fmt([a['page_faults'] for a in limit], digits=0)}, "
          f"loader {fmt([b['page_faults'] for b in loader], digits=0)}")
    print(f"loader / limit: {fmt(ratios, digits=3)}  (goal >= 0.85)")
    print(f"images per CPU-second: limit {fmt([a['images'] / a['cpu'] for a in limit])}, loader "
          f"{fmt([b['images'] / b['cpu'] for b in loader])}; loader / limit: {fmt(cpu_ratios, digits=3)}")
    if all("steal" in run for run in limit + loader):
        print("hypervisor steal (CPU-s the host gave its other guests during a run, all CPUs): limit "
              f"{fmt([a['steal'] for a in limit], ' s', 2)}, loader {fmt([b['steal'] for b in loader], ' s', 2)}; "
              f"share of the run's CPU-s {fmt([x['steal'] / x['cpu'] for x in limit + loader], '', 3)}")
    print(f"packing efficiency (non-padding share): {loader[0]['tokens'] / loader[0]['positions']:.3f}; "
          f"images per run {loader[0]['images']} (limit {limit[0]['images']})")


if __name__ == "__main__":
    main()
