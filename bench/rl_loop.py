"""RL-loop benchmark: what publishing from the trainer's event loop costs the trainer.

1. Steps/s with publishing off and on (every `--every` steps, PublishLoop to an in-memory
   store), on the tiny GPT and on a >= 256M-parameter GPT, each streaming the demo text with
   the loader inside asyncio and taking a real forward/backward/AdamW step in a thread. The
   cost of publishing is 1 - on/off, as a share of a step. Rounds alternate off/on so that the
   machine's drifting load hits both alike; the median and spread over rounds are printed.
2. Event-loop lag while a `--lag-params` (default 1B) bf16 version is snapshotted, encoded and
   uploaded (a keyframe, then a delta): per 2 ms heartbeat the wall gap and the loop thread's
   own CPU time, beside an idle loop's heartbeat over the same time (the machine's noise).

    .venv/bin/python bench/rl_loop.py [--only steps|lag] [--rounds 3] [--lag-params 1073741824]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
from rl_loop import Shape, demo_config, make_model, train_step  # noqa: E402

from zephon_stream import Loader  # noqa: E402
from zephon_stream.connectors import MemoryStore  # noqa: E402
from zephon_stream.refit import Publisher, PublishLoop  # noqa: E402

MODELS = {  # name: (d_model, layers, heads, seq_len, batch, steps timed per run)
    "tiny": (128, 2, 4, 128, 8, 20),
    "256M": (1024, 20, 16, 64, 1, 10),
}


async def steps_per_second(args: argparse.Namespace, name: str, publish: bool) -> tuple[float, float, float]:
    """(steps/s, CPU-seconds of the whole process per step, seconds the trainer waited in submit),
    over the model's timed steps after a warm-up. CPU-seconds per step hardly move with other
    load on the machine, so `1 - off/on` of them is the robust share of a step that publishing costs."""
    d, layers, heads, seq_len, batch, steps = MODELS[name]
    args.seq_len, args.batch = seq_len, batch
    config = demo_config(args)
    from tokenizers import Tokenizer

    shape = Shape(Tokenizer.from_file(config.tokenizer).get_vocab_size(), seq_len, d, layers, heads)
    model = make_model(shape, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pub = Publisher("bench/", store=MemoryStore(), keyframe_every=args.keyframe_every, workers=args.workers,
                    threads=args.threads)
    warm, n, t0, c0 = 2, 0, 0.0, 0.0
    async with PublishLoop(pub) as publishing, Loader(config).open() as stream:
        async for b in stream:
            await anyio.to_thread.run_sync(train_step, model, optim, b)
            n += 1
            if n == warm:
                t0, c0 = time.perf_counter(), time.process_time()
            if publish and n % args.every == 0:
                await publishing.submit(model.state_dict())
            if n == warm + steps:
                break
        await publishing.drain()  # the last publish's CPU counts too
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        waited = publishing.statistics().waited_s
    return steps / elapsed, cpu / steps, waited


def params_of(name: str, vocab: int = 6183) -> int:
    d, layers, heads, seq_len, *_ = MODELS[name]
    return sum(p.numel() for p in make_model(Shape(vocab, seq_len, d, layers, heads), 0).parameters())


def bench_steps(args: argparse.Namespace) -> None:
    for name in args.models:
        off, on, cpu_off, cpu_on, waits = [], [], [], [], []
        for _ in range(args.rounds):
            rate, cpu, _ = anyio.run(steps_per_second, args, name, False)
            off.append(rate)
            cpu_off.append(cpu)
            rate, cpu, waited = anyio.run(steps_per_second, args, name, True)
            on.append(rate)
            cpu_on.append(cpu)
            waits.append(waited)
        cost = [1 - a / b for a, b in zip(on, off)]
        cpu_cost = [1 - a / b for a, b in zip(cpu_off, cpu_on)]
        print(f"{name} GPT ({params_of(name) / 1e6:.0f}M fp32 parameters), publishing every {args.every} steps, "
              f"{args.rounds} rounds of {MODELS[name][5]} steps:\n  steps/s off {spread(off, '.3f')}; "
              f"on {spread(on, '.3f')}; publishing costs {spread([c * 100 for c in cost], '.1f')} % of a step; "
              f"the trainer waited {spread(waits, '.2f')} s in submit\n  CPU-s per step off "
              f"{spread(cpu_off, '.3f')}; on {spread(cpu_on, '.3f')}: publishing is "
              f"{spread([c * 100 for c in cpu_cost], '.1f')} % of the CPU of a step", flush=True)


class Heartbeat:
    """A 2 ms heartbeat: per beat the wall gap, the loop thread's own CPU time, when it ended,
    and the garbage collections that ran in the process meanwhile (they stop every thread)."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.cpu: list[float] = []
        self.ends: list[float] = []
        self.gc: list[tuple[float, float]] = []  # (start, seconds) of each collection
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc.append((self._gc_start, time.perf_counter() - self._gc_start))

    async def run(self, stop: anyio.Event) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            last, cpu = time.perf_counter(), time.thread_time()
            self.t0 = last
            while not stop.is_set():
                await anyio.sleep(0.002)
                now, now_cpu = time.perf_counter(), time.thread_time()
                self.gaps.append(now - last)
                self.cpu.append(now_cpu - cpu)
                self.ends.append(now)
                last, cpu = now, now_cpu
        finally:
            gc.callbacks.remove(self._on_gc)

    def worst(self, n: int) -> str:
        """The n longest gaps: when (s into the run) and how much of each a GC pass took."""
        out = []
        for k in sorted(range(len(self.gaps)), key=self.gaps.__getitem__)[-n:][::-1]:
            lo, hi = self.ends[k] - self.gaps[k], self.ends[k]
            in_gc = sum(max(0.0, min(hi, s + d) - max(lo, s)) for s, d in self.gc)
            out.append(f"{self.gaps[k] * 1000:.0f} ms at {lo - self.t0:.1f} s (GC {in_gc * 1000:.0f} ms)")
        return ", ".join(out)


def nudge(model: dict[str, torch.Tensor], step: int) -> None:
    """The trainer's step, stood in for: 1% of every tensor changed (in a thread, like a real step)."""
    g = torch.Generator().manual_seed(step)
    for t in model.values():
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)
        flat[idx] = (flat[idx].float() + 1e-3).to(flat.dtype)


async def lag_run(args: argparse.Namespace, model: dict[str, torch.Tensor], publish: bool) -> Heartbeat:
    beat, stop = Heartbeat(), anyio.Event()
    pub = Publisher("lag/", store=MemoryStore(), keyframe_every=100, workers=args.workers, threads=args.threads)
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat.run, stop)
        async with PublishLoop(pub) as publishing:
            for step in range(2):  # a keyframe, then a delta
                await anyio.to_thread.run_sync(nudge, model, step)
                if publish:
                    await publishing.submit(model)
                    await publishing.drain()
                else:
                    await anyio.sleep(args.idle_s)
        stop.set()
    return beat


def bench_lag(args: argparse.Namespace) -> None:
    per = args.lag_params // 8
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": (torch.randn(per // 4096, 4096, generator=g) * 0.02).to(torch.bfloat16)
             for i in range(8)}
    gc.collect()
    gc.freeze()  # what start-up left on the heap is never walked again, as trainers do after start-up
    t = time.perf_counter()
    busy = anyio.run(lag_run, args, model, True)
    args.idle_s = (time.perf_counter() - t) / 2
    idle = anyio.run(lag_run, args, model, False)
    for label, beat in (("publishing", busy), ("idle loop (control)", idle)):
        gaps = sorted(beat.gaps)
        print(f"{label}: {len(gaps)} beats, wall gap p50 {pct(gaps, .5):.1f} ms, p99 {pct(gaps, .99):.1f} ms, "
              f"max {gaps[-1] * 1000:.1f} ms; loop thread's own CPU per beat max {max(beat.cpu) * 1000:.1f} ms; "
              f"{sum(g > 0.05 for g in gaps)} gaps over 50 ms; worst: {beat.worst(3)}")
    nbytes = sum(t.numel() * 2 for t in model.values())
    print(f"  ({nbytes / 1e9:.2f} GB bf16 model; keyframe + delta published in {args.idle_s * 2:.1f} s with "
          f"{args.threads} CPU threads)", flush=True)


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def spread(xs: list[float], fmt: str) -> str:
    return f"median {statistics.median(xs):{fmt}} (min {min(xs):{fmt}}, max {max(xs):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["steps", "lag"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--keyframe-every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2, help="the publisher's concurrent chunks")
    ap.add_argument("--threads", type=int, default=1, help="the publisher's CPU threads (the trainer keeps the rest)")
    ap.add_argument("--lag-params", type=int, default=1 << 30)
    ap.add_argument("--torch-threads", type=int, default=1, help="the training step's intra-op threads")
    ap.add_argument("--quick", action="store_true", default=True)
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "rl_loop")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    print(f"CPU: {args.torch_threads} torch thread(s) for the step, {args.threads} publisher thread(s), the "
          f"loader's threads; {torch.get_num_threads()} of {os.cpu_count()} cores in torch", flush=True)
    if args.only != "lag":
        bench_steps(args)
    if args.only != "steps":
        bench_lag(args)


if __name__ == "__main__":
    main()
