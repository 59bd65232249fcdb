"""Soak: resident memory of a long stream on real text, its slope, and the throughput, with the
loader's allocator settings on and off.

    .venv/bin/python bench/soak.py [--minutes 30] [--settings defaults,issue] [--variants on,off] [--repeats 1]

Each run streams in a fresh process (the allocator's state is per process) for `--minutes`
after its first batch,
at one of the settings:

- `defaults`: the config's defaults (12 lanes, `seq_len` 2048, `shuffle_window` 64) and one source;
- `issue`: the same with two sources (weights 0.7 and 0.3), the run the issue reported.

and one variant: `on` is the loader as shipped; `off` runs it with `ZEPHON_MALLOC=off`, glibc's
malloc as the process found it; any other variant is `name:KEY=VALUE,KEY=VALUE`, environment
variables of the run (`arena2:ZEPHON_MALLOC=off,MALLOC_ARENA_MAX=2`). Runs alternate variants so
that a change in the machine's load falls on both.

This process samples the run's resident memory (the streaming process and its children) from
/proc every `--interval` seconds and prints, per run: the slope in MB/min (least squares over the
second half: the first holds the allocator's warm-up) and per 100M tokens, the peak (VmHWM), and
the throughput after the first batch, in tokens/s and in tokens per CPU-second of the run's
processes (the figure to trust on a shared machine). Then the median and range of each
(settings, variant). `--parallel` runs the variants side by side instead of one after the other.

Data: the bench's documents (`make bench-data`; see bench/loader.py), built into `--data` (data/soak) on
first use.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)

PAGE = os.sysconf("SC_PAGE_SIZE")
PRINTING = threading.Lock()
TICK = os.sysconf("SC_CLK_TCK")


def prepare(root: Path, mb: int) -> Path:
    """The bench's JSONL.zst shards and tokenizer under `root` (as bench/loader.py builds them)."""
    from tools.corpus import collect_documents, have_debian_docs, train_tokenizer
    from zephon_stream.formats import write_jsonl_shards

    marker = root / f"built-{mb}"
    if not marker.exists():
        if not have_debian_docs():
            raise SystemExit("the Debian documentation is not in the cache: run `make bench-data` first")
        docs = collect_documents(mb << 20, download=False)
        write_jsonl_shards(docs, root / "text", name="text", shards=8, compress="zst")
        train_tokenizer(docs, root / "tokenizer.json")
        marker.touch()
    return root / "tokenizer.json"


def config(settings: str, tokenizer: Path, backend: str):  # -> Config (imported in the run's process only)
    from zephon_stream import Config, SourceConfig

    uri = f"file://{tokenizer.parent}/text/"
    sources = ([SourceConfig(name="text", uri=uri)] if settings == "defaults" else
               [SourceConfig(name="a", uri=uri, weight=0.7), SourceConfig(name="b", uri=uri, weight=0.3)])
    return Config(seed=1, lanes=12, seq_len=2048, global_batch_size=24, tokenizer=str(tokenizer), sources=sources,
                  backend=backend)


# ---- the streaming process ----------------------------------------------------------------------

def stream(args: argparse.Namespace) -> None:
    """Stream for `args.minutes`; print a JSON line (elapsed s, tokens, allocator figures) every interval."""
    from zephon_stream import Loader
    from zephon_stream.engine import memory
    from zephon_stream.engine.memory import allocator_stats

    if args.tracemalloc:
        import tracemalloc
        tracemalloc.start()
    loader = Loader(config(args.settings, args.tokenizer, args.backend))
    start = end = due = 0.0
    tokens = 0
    first = None  # a tracemalloc snapshot, two minutes in
    for batch in loader:
        tokens += int(batch["num_tokens"].sum())
        now = time.monotonic()
        if not start:  # the clock starts at the first batch: start-up is not part of the soak
            start, due, end = now, now, now + args.minutes * 60
        if now >= due:
            if args.tracemalloc and first is None and now - start >= 120:  # past the warm-up
                first = tracemalloc.take_snapshot()
            alloc = allocator_stats()
            line = {"t": now - start, "tokens": tokens, "alloc": alloc and {
                f: getattr(alloc, f) for f in alloc.__struct_fields__}}
            line["trim_s"] = memory.trim_seconds
            line["resident"] = resident_by_kind()
            line["py_blocks"] = sys.getallocatedblocks()  # pymalloc's live blocks: a Python leak grows them
            line["gc_objects"] = len(gc.get_objects())
            if args.tracemalloc:
                line["python"] = tracemalloc.get_traced_memory()[0]
            print(json.dumps(line), flush=True)
            due = now + args.interval
        if now >= end:
            break
    if args.free_sizes:
        print(json.dumps({"free_sizes": free_sizes(memory.malloc_info() or b"")}), flush=True)
    if args.tracemalloc and first is not None:  # what grew in the traced (Python and numpy) allocations
        for stat in tracemalloc.take_snapshot().compare_to(first, "lineno")[:12]:
            print(f"traced growth since the first sample: {stat}", file=sys.stderr, flush=True)
    loader.close()


FREE_BUCKETS = (1 << 10, 4 << 10, 64 << 10, 1 << 20)


def free_sizes(xml: bytes) -> dict[str, float]:
    """MB free in all arenas' bins by chunk size (from malloc_info): fragments under a page cannot be
    trimmed; large free chunks are what a lower mmap threshold would have kept out of the arenas."""
    out = dict.fromkeys(["<1K", "1K-4K", "4K-64K", "64K-1M", ">=1M"], 0.0)
    for lo, total in re.findall(rb'<(?:size|unsorted) from="(\d+)" to="\d+" total="(\d+)"', xml):
        out[list(out)[bisect.bisect_right(FREE_BUCKETS, int(lo))]] += int(total) / 1e6
    return out


HEAP_ALIGN = 64 << 20  # glibc's thread arenas are heaps of HEAP_MAX_SIZE (64 MiB), aligned to it


def resident_by_kind() -> dict[str, int]:
    """This process's resident bytes by kind of mapping (/proc/self/smaps): the main arena ([heap]),
    the thread arenas (anonymous, 64 MiB-aligned), other anonymous memory (large chunks mapped on their
    own, pymalloc's arenas, thread stacks) and files (code, the tokenizer's mapped data)."""
    out = {"main_arena": 0, "thread_arenas": 0, "anon": 0, "file": 0}
    kind = "file"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            start = int(head[0].partition("-")[0], 16)
            path = head[5] if len(head) > 5 else ""
            kind = ("main_arena" if path == "[heap]" else "file" if path.startswith("/") else
                    "thread_arenas" if not path and start % HEAP_ALIGN == 0 else "anon")
        elif head[0] == "Rss:":
            out[kind] += int(head[1]) << 10
    return out


# ---- this process: run, sample, report ----------------------------------------------------------

def tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, parent in parents.items() if parent == p]
    return out


def sample(pid: int) -> tuple[float, float, float, int]:
    """(resident MB, peak resident MB, CPU seconds, minor page faults) of `pid` and its descendants
    now (the peak: the sum of each process's own peak)."""
    rss = cpu = hwm = faults = 0
    for p in tree(pid):
        try:
            rss += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE
            status = Path(f"/proc/{p}/status").read_text()
            hwm += int(status.partition("VmHWM:")[2].split()[0]) * 1024
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            cpu += int(fields[11]) + int(fields[12])
            faults += int(fields[7])  # minflt: a trimmed page touched again costs one
        except (OSError, IndexError):
            continue
    return rss / 1e6, hwm / 1e6, cpu / TICK, faults


def slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts, per minute."""
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def run(args: argparse.Namespace, settings: str, variant: str) -> dict[str, float]:
    name, _, assigns = variant.partition(":")
    env = dict(os.environ)
    if name == "off":
        env["ZEPHON_MALLOC"] = "off"
    env.update(kv.split("=", 1) for kv in assigns.split(",") if kv)
    cmd = [sys.executable, __file__, "--stream", "--settings", settings, "--minutes", str(args.minutes),
           "--interval", str(args.interval), "--backend", args.backend, "--tokenizer", str(args.tokenizer)]
    cmd += ["--tracemalloc"] * args.tracemalloc + ["--free-sizes"] * args.free_sizes
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    rows = []
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith('{"free_sizes"'):
            with PRINTING:
                print(f"    {settings} {name} free in the bins, MB: {json.loads(line)['free_sizes']}", flush=True)
            continue
        rss, hwm, cpu, faults = sample(child.pid)
        rows.append({**json.loads(line), "rss": rss, "hwm": hwm, "cpu": cpu, "faults": faults})
        if args.verbose:
            with PRINTING:  # runs side by side print from threads of their own
                print(f"    {settings} {name}: {rows[-1]}", flush=True)
    if child.wait():
        raise SystemExit(f"the {settings}/{variant} run failed (exit status {child.returncode})")
    return summarize(rows)


def summarize(rows: list[dict]) -> dict[str, float]:
    first, last = rows[0], rows[-1]
    half = [r for r in rows if r["t"] >= last["t"] / 2]
    out = {"slope": slope([r["t"] for r in half], [r["rss"] for r in half]), "peak": max(r["hwm"] for r in rows),
           # the same per 100M tokens streamed: a figure that a busy machine slows down less than MB/min
           "per_100m_tok": slope([r["tokens"] / 1e8 for r in half], [r["rss"] for r in half]) / 60,
           "start": first["rss"], "end": last["rss"],
           "tok_s": (last["tokens"] - first["tokens"]) / (last["t"] - first["t"]),
           "tok_cpu_s": (last["tokens"] - first["tokens"]) / max(1e-9, last["cpu"] - first["cpu"]),
           # what trimming costs: the trims' own time, and the page faults of touching trimmed pages again
           "trim_cpu_pct": 100 * (last["trim_s"] - first["trim_s"]) / max(1e-9, last["cpu"] - first["cpu"]),
           "faults_per_m_tok": (last["faults"] - first["faults"]) / max(1, last["tokens"] - first["tokens"]) * 1e6}
    if last.get("alloc"):
        out |= {"arenas": last["alloc"]["arenas"], "heap_mb": last["alloc"]["heap"] / 1e6,
                "free_mb": last["alloc"]["free"] / 1e6, "mmapped_mb": last["alloc"]["mmapped"] / 1e6,
                "heap_slope": slope([r["t"] for r in half], [r["alloc"]["heap"] / 1e6 for r in half])}
    for kind in last.get("resident", {}):
        out[f"{kind}_mb"] = last["resident"][kind] / 1e6
        out[f"{kind}_slope"] = slope([r["t"] for r in half], [r["resident"][kind] / 1e6 for r in half])
    if "py_blocks" in last:
        out["py_blocks_slope"] = slope([r["t"] for r in half], [r["py_blocks"] / 1e3 for r in half])  # k/min
        out["gc_objects_slope"] = slope([r["t"] for r in half], [r["gc_objects"] / 1e3 for r in half])
    if last.get("alloc"):
        out["in_use_slope"] = slope([r["t"] for r in half], [r["alloc"]["in_use"] / 1e6 for r in half])
        out["free_slope"] = slope([r["t"] for r in half], [r["alloc"]["free"] / 1e6 for r in half])
        out["mmapped_slope"] = slope([r["t"] for r in half], [r["alloc"]["mmapped"] / 1e6 for r in half])
    if "python" in last:
        out["python_slope"] = slope([r["t"] for r in half], [r["python"] / 1e6 for r in half])
        out["python_mb"] = last["python"] / 1e6
    return out


def spread(xs: list[float], unit: str = "", digits: int = 1) -> str:
    m = statistics.median(xs)
    return f"{m:,.{digits}f}{unit}" + (f" ({min(xs):,.{digits}f}..{max(xs):,.{digits}f})" if len(xs) > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--settings", default="defaults,issue", help="comma-separated: defaults, issue")
    ap.add_argument("--variants", default="on,off", help="comma-separated: on, off, name:KEY=VALUE,... (see above)")
    ap.add_argument("--variant", action="append", default=[], help="one more variant (may hold commas)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--parallel", action="store_true",
                    help="run the variants side by side (on a shared machine), not one after the other")
    ap.add_argument("--backend", default="threads")
    ap.add_argument("--data", type=Path, default=Path("data/soak"), help="built here on first use; a directory of its "
                    "own, so a bench that rebuilds data/bench at another size never changes the shards under a soak")
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--tracemalloc", action="store_true", help="also trace Python's allocations (slower)")
    ap.add_argument("--free-sizes", action="store_true", help="at the end, the arenas' free bytes by chunk size")
    ap.add_argument("--verbose", action="store_true", help="print every sample")
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream:
        stream(args)
        return
    args.tokenizer = prepare(args.data.resolve(), args.mb)
    variants = [v for v in args.variants.split(",") if v] if not args.variant else args.variant
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.repeats):
        for settings in args.settings.split(","):
            order = variants if r % 2 == 0 else variants[::-1]
            if args.parallel:  # all variants at once: the machine's load falls on each alike
                with ThreadPoolExecutor(len(order)) as pool:
                    outs = list(pool.map(run, [args] * len(order), [settings] * len(order), order))
            else:
                outs = [run(args, settings, v) for v in order]
            for variant, out in zip(order, outs):
                results.setdefault((settings, variant.partition(":")[0]), []).append(out)
                print(f"run {r} {settings:8s} {variant}: " + ", ".join(f"{k} {v:,.2f}" for k, v in out.items()),
                      flush=True)
    print(f"\n{args.minutes:g} min per run, {args.backend}, {args.repeats} run(s) each: median (min..max)")
    for (settings, variant), outs in results.items():
        col = {k: [o[k] for o in outs] for k in outs[0]}
        print(f"{settings:8s} {variant:8s} slope {spread(col['slope'], ' MB/min')} = "
              f"{spread(col['per_100m_tok'], ' MB/100M tokens')}  peak {spread(col['peak'], ' MB')}  "
              f"{spread(col['tok_s'], ' tok/s', 0)}  {spread(col['tok_cpu_s'], ' tok/CPU-s', 0)}"
              + f"  trims {spread(col['trim_cpu_pct'], '% of CPU', 2)}"
              + f"  {spread(col['faults_per_m_tok'], ' faults/M tok', 0)}"
              + (f"  arenas {spread(col['arenas'], '', 0)}" if "arenas" in col else ""))


if __name__ == "__main__":
    main()
