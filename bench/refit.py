"""Refit benchmark: delta size and throughput on a synthetic >=1B-parameter bf16 model.

Scenario A: an Adam-like step w <- w +- lr*u, u ~ U(0.5, 1.5), lr = 1e-6, on N(0, 0.02) weights.
Scenario B: 3% of positions get relative noise N(0, 1e-2).

For each step it publishes the new weights (one worker thread) to an in-memory store, pulls them
into a subscriber's copy (one worker thread), checks bit-exactness, and prints the delta size
against the full checkpoint, dense XOR+zstd and positions+overwrite values. Throughput is model
bytes per second twice over: per CPU-second of the whole process (all threads: the per-core
figure, robust to other load on a shared machine) and per wall-clock second.

Joiner: a fresh subscriber pulls the newest keyframe (`--join-runs` times, `--join-workers`
worker threads), the figure a rollout worker that starts late waits for. It prints which digest
implementation ran (the compiled kernels, with or without their AVX2 loops, or the numpy
reference: ZEPHON_DIGEST=numpy forces it) and the keyframe's size against the model. Run it
against the code before a change with PYTHONPATH=<a checkout of that commit> (build its digest
extension there first: python setup.py build_ext --inplace). The figure is per CPU-second,
robust to other load but not immune: on a shared 2-core machine, repeat it and compare medians.

    .venv/bin/python bench/refit.py [--params 1073741824] [--steps 3] [--scenario A B]
    .venv/bin/python bench/refit.py --params 268435456 --scenario --join-runs 5 --join-workers 1 2 [--join-fresh]

The joiner pulls into a replica zeroed before each run, so its pages are mapped: the figure is
the pull's own work. `--join-fresh` pulls into never-touched tensors instead, as a worker that
allocates its model with torch.empty would: the kernel's first-touch page faults (zeroing 4 KiB
pages) then add about 0.6 ns per model byte, more than the load itself costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import numpy as np
import torch

from zephon_stream.connectors import MemoryStore
from zephon_stream.refit import Publisher, Subscriber, codec, hashing

BLOCK = 1 << 26


def make_model(params: int, tensors: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = params // tensors
    out = {}
    for k in range(tensors):
        t = torch.empty(per, dtype=torch.bfloat16)
        for lo in range(0, per, BLOCK):
            n = min(BLOCK, per - lo)
            t[lo : lo + n] = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        out[f"layer{k:03d}.weight"] = t.view(per // 4096, 4096)
    return out


def step(model: dict[str, torch.Tensor], scenario: str, g: torch.Generator) -> None:
    for t in model.values():
        flat = t.view(-1)
        for lo in range(0, flat.numel(), BLOCK):
            w = flat[lo : lo + BLOCK]
            n = w.numel()
            if scenario == "A":
                u = torch.rand(n, generator=g) + 0.5
                sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int8).float() * 2 - 1
                w.copy_((w.float() + sign * u * 1e-6).to(torch.bfloat16))
            else:
                hit = torch.rand(n, generator=g) < 0.03
                noisy = (w.float() * (1 + 1e-2 * torch.randn(n, generator=g))).to(torch.bfloat16)
                w.copy_(torch.where(hit, noisy, w))


def alternatives(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], chunk_bytes: int) -> tuple[int, int]:
    """(dense XOR+zstd bytes, positions+overwrite-values bytes) over the same chunks."""
    dense = over = 0
    words = chunk_bytes // 2
    for k in new:
        a = old[k].view(-1).view(torch.int16).numpy().view("<u2")
        b = new[k].view(-1).view(torch.int16).numpy().view("<u2")
        for lo in range(0, len(a), words):
            x = a[lo : lo + words] ^ b[lo : lo + words]
            dense += len(codec.encode_dense(codec.DENSE_XOR, x))
            pos = np.flatnonzero(x != 0)
            over += len(codec.encode_sparse(codec.SPARSE_SET, len(x), pos, b[lo : lo + words][pos]))
    return dense, over


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


async def run(args: argparse.Namespace, scenario: str) -> None:
    t0 = time.perf_counter()
    model = make_model(args.params, args.tensors, seed=1)
    replica = {k: torch.zeros_like(v) for k, v in model.items()}
    store = MemoryStore()
    nbytes = sum(t.numel() * 2 for t in model.values())
    print(f"\n== scenario {scenario}: {nbytes // 2:,} bf16 params ({nbytes / 1e9:.2f} GB), "
          f"chunks of {args.chunk_bytes >> 20} MiB, generated in {time.perf_counter() - t0:.1f} s")
    pub = Publisher("bench/", store=store, chunk_bytes=args.chunk_bytes, keyframe_every=1000, workers=2, threads=1)
    sub = Subscriber("bench/", store=store, workers=2, threads=1)
    t = time.perf_counter()
    await pub.publish(model)
    t_key_pub = time.perf_counter() - t
    t = time.perf_counter()
    await sub.pull(replica)
    print(f"keyframe v1: publish {t_key_pub:.1f} s, pull {time.perf_counter() - t:.1f} s, "
          f"bit-exact={same_bytes(model, replica)}")
    g = torch.Generator().manual_seed(2)
    enc, dec, ratios = [], [], []
    for s in range(args.steps):
        before = {k: v.clone() for k, v in model.items()} if s == 0 else None
        step(model, scenario, g)
        t, c = time.perf_counter(), time.process_time()
        info = await pub.publish(model)
        te, ce = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        await sub.pull(replica)
        td, cd = time.perf_counter() - t, time.process_time() - c
        exact = same_bytes(model, replica)
        enc.append(nbytes / ce / 1e9)
        dec.append(nbytes / cd / 1e9)
        ratios.append(nbytes / info.delta_bytes)
        print(f"v{info.version}: changed {info.changes / (nbytes // 2):.3%}, delta {info.delta_bytes:,} B = "
              f"{nbytes / info.delta_bytes:.1f}x smaller than full; encode {enc[-1]:.2f} GB/s/core "
              f"({nbytes / te / 1e9:.2f} GB/s wall), decode+apply {dec[-1]:.2f} GB/s/core "
              f"({nbytes / td / 1e9:.2f} GB/s wall); bit-exact={exact}")
        if before is not None:
            dense, over = alternatives(before, model, args.chunk_bytes)
            del before
            print(f"  same step: full {nbytes:,} B; dense XOR+zstd {dense:,} B ({nbytes / dense:.1f}x); "
                  f"positions+overwrite values {over:,} B ({nbytes / over:.1f}x); this codec "
                  f"{info.delta_bytes:,} B ({nbytes / info.delta_bytes:.1f}x)")
    def spread(xs):
        return f"median {statistics.median(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"
    print(f"scenario {scenario} over {args.steps} steps: ratio vs full {spread(ratios)}x; "
          f"encode {spread(enc)} GB/s/core; decode+apply {spread(dec)} GB/s/core")


async def join(args: argparse.Namespace) -> None:
    """Keyframe pull by a new joiner: model bytes per CPU-second and per wall second."""
    model = make_model(args.params, args.tensors, seed=1)
    nbytes = sum(t.numel() * 2 for t in model.values())
    store = MemoryStore()
    pub = Publisher("bench/", store=store, chunk_bytes=args.chunk_bytes, keyframe_every=1000, workers=2, threads=2)
    await pub.publish(model)
    stored = sum(len(v) for k, v in store.objects.items() if "/key-" in k)
    print(f"\n== joiner: keyframe of {nbytes // 2:,} bf16 params ({nbytes / 1e9:.2f} GB), "
          f"chunks of {args.chunk_bytes >> 20} MiB; keyframe objects {stored / nbytes:.3f} of the model; "
          f"digest: {digest_implementation()}")
    replica = {k: torch.zeros_like(v) for k, v in model.items()}
    for workers in args.join_workers:
        per_core, wall = [], []
        for _ in range(args.join_runs):
            if args.join_fresh:  # never-touched memory: the pull pays the kernel's page faults
                replica = {k: torch.empty_like(v) for k, v in model.items()}
            else:
                for t in replica.values():
                    t.zero_()
            sub = Subscriber("bench/", store=store, workers=workers, threads=workers)
            t, c = time.perf_counter(), time.process_time()
            await sub.pull(replica)
            tw, tc = time.perf_counter() - t, time.process_time() - c
            assert same_bytes(model, replica), "joiner's pull is not bit-exact"
            per_core.append(nbytes / tc / 1e9)
            wall.append(nbytes / tw / 1e9)
        into = "into never-touched memory" if args.join_fresh else "into zeroed memory"
        print(f"joiner keyframe pull {into}, {workers} worker thread(s), {args.join_runs} runs, bit-exact: "
              f"{spread(per_core)} GB/s per CPU-second; {spread(wall)} GB/s wall")


def digest_implementation() -> str:
    if hashing.implementation() == "numpy":
        return "numpy reference"
    kernel = hashing._compiled
    return "compiled, AVX2 loops" if kernel.simd() else "compiled, portable loops"


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=1 << 30)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--scenario", nargs="*", default=["A", "B"])
    ap.add_argument("--join-runs", type=int, default=0, help="joiner keyframe pulls to time (0: none)")
    ap.add_argument("--join-workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--join-fresh", action="store_true",
                    help="pull into freshly allocated tensors (page faults counted) instead of zeroed ones")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for scenario in args.scenario:
        anyio.run(run, args, scenario)
    if args.join_runs:
        anyio.run(join, args)


if __name__ == "__main__":
    main()
