"""Loader throughput against the tokenizer alone, restore time, and checkpoint size, on real text.

    .venv/bin/python bench/loader.py [--mb 48] [--repeats 5] [--tokenizers 8k,50k]
        [--backends threads,processes] [--shuffles 0,64] [--parquet]
    unshare --net -- .venv/bin/python bench/loader.py --backend ray [--mb 8] [--data /tmp/bench]

Data: Debian's kernel and Python documentation (about 41 MB of English text, fetched beforehand
by `make bench-data` with apt-get into ~/.cache/zephon-stream) topped up with the standard
library's sources, written as multi-frame JSONL.zst shards. Two byte-level BPEs trained on it:
the project's small one (vocab 8192) and one of GPT-2's size (50257). The baseline is
`Tokenizer.encode_batch_fast` alone on the same documents, in batches of 64 (the loader's
`tokenize_batch`), in this process on the same cores. The loader runs one epoch (max_epochs = 1)
of the same documents at 12 lanes, seq_len 2048, on each backend and shuffle window; its CPU
seconds include its worker processes (the processes backend). torch is imported before any clock
starts, as a trainer has it before it makes a loader. The runs alternate (per repeat: tokenizer
alone, then each loader configuration followed by the tokenizer alone again), and each loader run
is divided by the mean of the tokenizer-only runs just before and after it, so a change in the
machine's load falls on both. (Before 2026-12-04 the divisor was the repeat's first tokenizer-only
run alone, up to four loader runs earlier; that ratio is still printed, in the last column.)

`--parquet` adds the loader from Parquet files written by pyarrow (snappy, row groups of about
1 MiB of text, an `id` column beside `text`), as FineWeb ships them, against the loader from
JSONL.zst, in tokens/s and in tokens per CPU-second.

`--backend ray` compares the ray backend with threads on the same data instead: one local Ray
(started once, its start-up timed apart), then epochs on each backend in turn; per batch, the
wall time after the first batch, and tokens per CPU-second of every process involved (this one,
Ray's daemons and the actors, counted from /proc, the reaped ones too). Ray binds only 127.0.0.1
here; run it under `unshare --net` (loopback is brought up) where nothing else may be reached.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
from tests.distributed._launch import loopback_up
from tools.corpus import collect_documents, have_debian_docs, train_tokenizer
from zephon_stream import Config, Loader, SourceConfig, state_to_bytes
from zephon_stream.formats import write_jsonl_shards
from zephon_stream.operators.tokenize import Tokenize


def prepare(root: Path, mb: int) -> tuple[list[str], Path]:
    """The bench's documents and tokenizer. Reads the Debian docs from the cache only: a benchmark
    talks to nothing but loopback, so `make bench-data` fetches them beforehand."""
    if not have_debian_docs():
        raise SystemExit("the Debian documentation is not in the cache: run `make bench-data` first "
                         "(apt-get download + dpkg-deb -x, the one step that uses the network)")
    docs = collect_documents(mb << 20, download=False)
    # one marker per build, naming its size: the shards and tokenizers of another --mb are rebuilt
    marker, pq_marker = root / "built", root / "built-parquet"
    if _read(marker) != str(mb) or not (root / "tokenizer-50k.json").exists():
        write_jsonl_shards(docs, root / "text", name="text", shards=8, compress="zst")
        train_tokenizer(docs, root / "tokenizer.json")
        train_tokenizer(docs, root / "tokenizer-50k.json", vocab_size=TOKENIZERS["50k"])
        marker.write_text(str(mb))
    if _read(pq_marker) != str(mb):
        write_parquet(docs, root / "parquet", shards=8)
        pq_marker.write_text(str(mb))
    return [t for _, t in docs], root / "tokenizer.json"


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def write_parquet(docs: list[tuple[str, str]], out: Path, shards: int, group_bytes: int = 1 << 20) -> None:
    """`docs` as `shards` Parquet files of contiguous runs, row groups of about `group_bytes` of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.parquet"):
        old.unlink()
    per = -(-len(docs) // shards)
    for s in range(shards):
        part = docs[s * per:(s + 1) * per]
        size = sum(len(t.encode()) for _, t in part)
        rows = max(1, len(part) * group_bytes // max(1, size))
        pq.write_table(pa.table({"id": [str(i) for i, _ in part], "text": [t for _, t in part]}),
                       out / f"text-{s:05d}.parquet", row_group_size=rows)


def tokenizer_only(texts: list[str], path: Path, batch: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, tokens per CPU-second of this process) for encode_batch_fast alone.

    On the loader's own tokenizer (`Tokenize.shared`, the instance every Loader of this process
    uses): `tokenizers` keeps each instance's word caches in its threads, and two instances with
    caches in one process slowed each other by about 10% here (the baseline measured first in a
    fresh process, then beside the loader's instance: 2.07M then 1.86M tok/s, where on the one
    instance it stayed at 2.03-2.08M and the loader rose from 1.58M to 1.74M). A training process
    has one tokenizer, and so does this comparison."""
    tok = Tokenize.for_config(bench_config(path, "threads")).tokenizer  # the process's one instance, before the clock
    t, c = time.perf_counter(), time.process_time()
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts[i:i + batch], add_special_tokens=False))
    return n / (time.perf_counter() - t), n, n / (time.process_time() - c)


def cpu_seconds() -> float:
    """CPU seconds of this process and of all its descendants, live or reaped: the processes
    backend's workers are children of multiprocessing's fork server, which reaps them (their time
    is in its cutime and cstime), not of this process."""
    t = os.times()
    live = sum(sum(int(f) for f in fields[11:15]) for pid, fields in descendants().items()
               if pid != os.getpid() and fields)
    return t.user + t.system + t.children_user + t.children_system + live / os.sysconf("SC_CLK_TCK")


def steal_seconds() -> float | None:
    """CPU-seconds the hypervisor gave to others while this machine's CPUs had work (all CPUs,
    `steal` in /proc/stat), or None where the kernel does not count it. A share of it against
    the run's CPU-seconds says how far the host's other guests moved a wall-clock figure."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None


class ThreadCpu:
    """CPU seconds of this process's threads during a `with` block, summed by kind: the Python
    thread's name without its numbers (`zephon-worker`, `asyncio-portal`, `ThreadPoolExecutor`,
    `MainThread`), or for a thread Python did not start (the tokenizer's Rayon pool) its kernel
    name. A sampler thread of its own reads /proc/self/task every `every` seconds, so a thread that
    exits inside the block keeps its last reading (up to `every` seconds old: the process's CPU
    minus the sum says what they took after it); its own CPU is left out. `.seconds` after the block."""

    def __init__(self, every: float = 0.25) -> None:
        self.every, self.seconds = every, {}
        self._names: dict[int, str] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        tids = os.listdir("/proc/self/task")  # before the names: a thread started between the two is named
        for t in threading.enumerate():
            if t.native_id is not None:
                self._names[t.native_id] = re.sub(r"[-_]?[0-9a-f]{6,}|[-_]?\d+", "", t.name)
        tick = os.sysconf("SC_CLK_TCK")
        for tid in tids:
            try:
                stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            except OSError:  # it exited meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            self._last[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
            self._names.setdefault(int(tid), f"{stat[stat.index('(') + 1:stat.rindex(')')]} (native)")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> ThreadCpu:
        self._sample()
        self._base = dict(self._last)
        self._thread = threading.Thread(target=self._run, name="bench-thread-cpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        out: collections.Counter[str] = collections.Counter()
        for tid, cpu in self._last.items():
            if tid != self._thread.native_id:
                out[self._names[tid]] += cpu - self._base.get(tid, 0.0)
        self.seconds = {k: round(v, 2) for k, v in out.most_common() if v > 0}


def tokenizer_share(seconds: dict[str, float]) -> float:
    """The share of a `ThreadCpu` reading that threads Python did not start took: the tokenizer's pool."""
    total = sum(seconds.values())
    return sum(v for k, v in seconds.items() if k.endswith("(native)")) / total if total else float("nan")


def steal_note(steal: float | None, cpu: float) -> str:
    """`steal` seconds against `cpu` seconds of work, as a line's tail (empty where unknown)."""
    return "" if steal is None else f"; hypervisor steal {steal:.1f} s ({steal / max(cpu, 1e-9):.1%} of the CPU-s)"


def loader_epoch(config: Config) -> tuple[float, int, float, float]:
    """(tokens/s, tokens, seconds to the first batch, tokens per CPU-second) for one loader epoch,
    worker processes included."""
    t, c = time.perf_counter(), cpu_seconds()
    loader = Loader(config)
    tokens, first = 0, None
    for batch in loader:
        tokens += int(batch["num_tokens"].sum())
        first = first or time.perf_counter() - t
    return tokens / (time.perf_counter() - t), tokens, first, tokens / (cpu_seconds() - c)


def restore_time(config: Config, step: int) -> tuple[float, int]:
    loader = Loader(config)
    for _ in loader:
        if loader.step == step:
            break
    state = loader.state_dict()
    times = []
    for _ in range(3):
        fresh = Loader(config)
        t = time.perf_counter()
        fresh.load_state_dict(state)
        next(iter(fresh))
        times.append(time.perf_counter() - t)
    return statistics.median(times), len(state_to_bytes(state))


def descendants() -> dict[int, list[str]]:
    """This process and its descendants: pid -> the fields of /proc/<pid>/stat after the name."""
    stats = {}
    for entry in Path("/proc").iterdir():
        try:
            stats[int(entry.name)] = (entry / "stat").read_text().rpartition(")")[2].split()
        except (OSError, ValueError):
            continue
    mine, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        mine[pid] = stats.get(pid, [])
        todo += [child for child, fields in stats.items() if int(fields[1]) == pid and child not in mine]
    return mine


class TreeCpu:
    """CPU seconds of this process and, apart, of its descendants (Ray's daemons and workers).

    A worker that Ray kills takes its counters with it, so `sample()` is called during an epoch
    and the last value seen of each process counts (the few batches after the last sample are
    missed: under 2% of an epoch at one sample every 5 batches)."""

    def __init__(self) -> None:
        self.start = self._ticks()
        self.seen = dict(self.start)

    @staticmethod
    def _ticks() -> dict[int, int]:
        return {pid: int(fields[11]) + int(fields[12]) for pid, fields in descendants().items() if fields}

    def sample(self) -> None:
        self.seen.update(self._ticks())

    def seconds(self) -> tuple[float, float]:
        self.sample()
        used = {pid: ticks - self.start.get(pid, 0) for pid, ticks in self.seen.items()}
        here = used.pop(os.getpid())
        return here / os.sysconf("SC_CLK_TCK"), sum(used.values()) / os.sysconf("SC_CLK_TCK")


def actor_rss_mb() -> list[float]:
    """Resident memory of each live lane actor (a descendant named ray::_LaneActor...), in MB."""
    out = []
    for pid in descendants():
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::_LaneActor"):
                out.append(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6)
        except OSError:
            continue
    return out


def epoch_per_batch(config: Config) -> tuple[float, float, int, int, float, float]:
    """(seconds to the first batch, seconds per batch after it, batches, tokens, CPU seconds of this
    process, CPU seconds of Ray's processes) for one epoch on `config.backend`."""
    t, cpu = time.perf_counter(), TreeCpu()
    tokens, batches, first = 0, 0, 0.0
    for batch in Loader(config):
        tokens += int(batch["num_tokens"].sum())
        batches += 1
        if batches == 1:
            first = time.perf_counter() - t
        if batches % 5 == 1:  # (a /proc scan costs a few milliseconds: not every batch)
            cpu.sample()
        if batches % 25 == 1:
            RSS.extend(actor_rss_mb())
    wall = time.perf_counter() - t
    return first, (wall - first) / max(1, batches - 1), batches, tokens, *cpu.seconds()


RSS: list[float] = []  # lane actors' resident MB, sampled during the ray epochs


def compare_ray(config: Config, repeats: int) -> None:
    """threads against ray, epoch after epoch on one local Ray: the overhead per batch, in wall
    time and in tokens per CPU-second."""
    import anyio.from_thread

    from zephon_stream.loader.ray_backend import ray_session

    if sorted(name for _, name in socket.if_nameindex()) == ["lo"]:
        loopback_up()  # a fresh network namespace (unshare --net): loopback starts down
    runs: dict[str, list[tuple[float, float, int, int, float, float]]] = {"threads": [], "ray": []}
    with anyio.from_thread.start_blocking_portal() as portal:
        t = time.perf_counter()
        with portal.wrap_async_context_manager(ray_session(config, config.ray_actors)):
            print(f"local Ray started in {time.perf_counter() - t:.1f} s (once; not in the figures below)")
            for r in range(repeats):
                for backend in runs:
                    run = epoch_per_batch(config.replace(backend=backend))
                    runs[backend].append(run)
                    print(f"  run {r} {backend:7s}: first batch after {run[0]:.2f} s, then {run[1] * 1000:.1f} ms "
                          f"a batch ({run[2]} batches, {run[3]:,} tokens); CPU s: here {run[4]:.1f}, Ray's "
                          f"processes {run[5]:.1f}")
    if {run[3] for rs in runs.values() for run in rs} != {runs["threads"][0][3]}:
        raise SystemExit("the backends gave different token counts: not the same epoch")
    per = {b: [run[1] * 1000 for run in rs] for b, rs in runs.items()}
    # threads: this process does all the work, Ray's idle daemons are not its cost; ray: every process
    cpu = {"threads": [run[3] / run[4] for run in runs["threads"]],
           "ray": [run[3] / (run[4] + run[5]) for run in runs["ray"]]}
    idle = statistics.median(run[5] / (run[0] + run[1] * (run[2] - 1)) for run in runs["threads"])
    first = {b: [run[0] for run in rs] for b, rs in runs.items()}
    print(f"ms a batch (after the first): threads {fmt1(per['threads'])}; ray {fmt1(per['ray'])}; overhead "
          f"{statistics.median(per['ray']) - statistics.median(per['threads']):+.1f} ms a batch (medians)")
    print(f"first batch (s): threads {fmt1(first['threads'])}; ray {fmt1(first['ray'])} (a lane fills its shuffle "
          "window first; ray adds the actors' start-up)")
    whole = {b: [(run[0] + run[1] * (run[2] - 1)) / run[2] * 1000 for run in rs] for b, rs in runs.items()}
    print(f"ms a batch over the whole epoch: threads {fmt1(whole['threads'])}; ray {fmt1(whole['ray'])}")
    ratio = statistics.median(cpu["ray"]) / statistics.median(cpu["threads"])
    print(f"tok/CPU-s: threads (this process) {fmt(cpu['threads'])}; ray (this process, actors, Ray's daemons) "
          f"{fmt(cpu['ray'])}; ratio ray/threads {ratio:.3f}; Ray's daemons alone, idle during the threads "
          f"epochs: {idle:.2f} CPU-s a second")
    if RSS:
        print(f"lane actor resident memory: {fmt1(RSS)} MB ({config.ray_actors} actors of "
              f"{config.lanes // config.ray_actors} lanes)")


def fmt1(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):,.0f}  (min {min(xs):,.0f}, max {max(xs):,.0f})"


def matrix(texts: list[str], data: Path, tokenizers: list[str], backends: list[str], shuffles: list[int],
           repeats: int) -> None:
    """The issue's matrix, runs alternating: per tokenizer, encode_batch_fast alone before and after
    every loader run (on each backend and shuffle window in turn), and each loader run divided by
    the mean of the two tokenizer-only runs around it, so that a drift of the machine's speed over
    the minutes of a repeat falls on both (the older figure, the one run at the repeat's start
    only, is printed beside it)."""
    base: dict[str, list[tuple[float, float]]] = {t: [] for t in tokenizers}
    runs: dict[tuple[str, str, int], list[tuple[float, float, float, float, float, float]]] = {}
    shares: dict[tuple[str, str, int], list[float]] = {}  # threads backend: tokenizer share, loader / limit
    steal, cpu_total = steal_seconds(), cpu_seconds()
    for r in range(repeats):
        for name in tokenizers:
            path = tokenizer_file(data, name)

            def limit(name: str = name, path: Path = path) -> tuple[float, int, float, ThreadCpu]:
                with ThreadCpu() as threads:
                    rate, n, cpu = tokenizer_only(texts, path, 64)
                base[name].append((rate, cpu))
                return rate, n, cpu, threads

            first_rate, n, first_cpu, before_threads = before = limit()
            line = [f"  run {r} {name}: tokenizer-only {first_rate:,.0f} tok/s {first_cpu:,.0f} tok/CPU-s"]
            for backend in backends:
                for window in shuffles:
                    config = bench_config(path, backend, window)
                    with ThreadCpu() as loader_threads:
                        lrate, ln, first, lcpu = loader_epoch(config)
                    if ln != n:
                        raise SystemExit(f"the loader gave {ln} tokens, the tokenizer {n}: not the same documents")
                    after = limit()
                    rate, cpu = (before[0] + after[0]) / 2, (before[2] + after[2]) / 2
                    runs.setdefault((name, backend, window), []).append(
                        (lrate, lcpu, lrate / rate, lcpu / cpu, lrate / first_rate, lcpu / first_cpu))
                    share = ""
                    if backend == "threads":  # the processes backend tokenizes in its workers: not seen here
                        ratio = tokenizer_share(loader_threads.seconds) / tokenizer_share(before[3].seconds)
                        shares.setdefault((name, backend, window), []).append(ratio)
                        share = f", tokenizer share {ratio:.3f}"
                    line.append(f"{backend}/shuffle {window}: {lrate:,.0f} tok/s ({lrate / rate:.3f}), "
                                f"{lcpu:,.0f} tok/CPU-s ({lcpu / cpu:.3f}){share}, first batch {first:.2f} s; "
                                f"tokenizer-only {after[0]:,.0f} tok/s")
                    before = after
            print("; ".join(line), flush=True)
    stolen = None if steal is None or (after := steal_seconds()) is None else after - steal
    print(f"\n{len(texts)} documents, {n:,} tokens an epoch with the last tokenizer; median (min - max) of {repeats}"
          f"{steal_note(stolen, cpu_seconds() - cpu_total)}")
    print("| tokenizer | backend | shuffle_window | loader tok/s | / tokenizer-only, wall (per run) "
          "| loader tok/CPU-s | / tokenizer-only, per CPU-second (per run) | tokenizer share, loader / limit "
          "| wall, against the repeat's first limit run only |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (name, backend, window), rs in runs.items():
        sh = shares.get((name, backend, window))
        print(f"| {name} | {backend} | {window} | {fmt([x[0] for x in rs])} | {fmt3([x[2] for x in rs])} "
              f"| {fmt([x[1] for x in rs])} | {fmt3([x[3] for x in rs])} | {fmt3(sh) if sh else 'n/a'} "
              f"| {fmt3([x[4] for x in rs])} |")
    print("/ tokenizer-only: each loader run over the mean of the tokenizer-only runs just before and just after it.")
    print("tokenizer share: the tokenizer pool's share of the process's CPU in the loader's run (threads Python did "
          "not start), over its share in the tokenizer-only run before it. Each share is taken within one run, so the "
          "machine's speed, which drifts between runs, cancels out; it is the per-CPU-second ratio if the pool spends "
          "the same CPU per token in both runs (the two columns before it include any difference there).")
    for name, bs in base.items():
        print(f"tokenizer-only, {name}: {fmt([b[0] for b in bs])} tok/s, {fmt([b[1] for b in bs])} tok/CPU-s")


TOKENIZERS = {"8k": 8192, "50k": 50257}  # the project's small-vocab BPE; one of GPT-2's size


def tokenizer_file(data: Path, name: str) -> Path:
    """The bench's byte-level BPE of `name`'s vocabulary size (trained on its documents by `prepare`)."""
    if name not in TOKENIZERS:
        raise SystemExit(f"--tokenizers: {name!r} is not one of {', '.join(TOKENIZERS)}")
    return data / ("tokenizer.json" if name == "8k" else f"tokenizer-{name}.json")


def bench_config(tokenizer: Path, backend: str, shuffle_window: int = 64) -> Config:
    return Config(seed=1, lanes=12, seq_len=2048, global_batch_size=24, tokenizer=str(tokenizer), max_epochs=1,
                  backend=backend, shuffle_window=shuffle_window,
                  sources=[SourceConfig(name="text", uri=f"file://{tokenizer.parent}/text/")])


def fmt3(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f} - {max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="threads", help="ray: compare the ray backend with threads instead")
    ap.add_argument("--tokenizers", default="8k,50k", help="byte-level BPEs by vocabulary size: 8k, 50k")
    ap.add_argument("--backends", default="threads,processes")
    ap.add_argument("--shuffles", default="0,64", help="shuffle_window values")
    ap.add_argument("--parquet", action="store_true", help="also the loader from Parquet against JSONL.zst")
    ap.add_argument("--data", type=Path, default=Path("data/bench"))
    args = ap.parse_args()
    import torch  # noqa: F401  (a trainer has imported it before it makes a loader: not the loader's time)

    texts, tok = prepare(args.data.resolve(), args.mb)
    size = sum(len(t.encode()) for t in texts)
    print(f"data: {len(texts)} documents, {size / 1e6:.1f} MB of real text; tokenizer {tok}")
    config = bench_config(tok, args.backend)
    if args.backend == "ray":
        compare_ray(config, args.repeats)
        return
    matrix(texts, tok.parent, args.tokenizers.split(","), args.backends.split(","),
           [int(w) for w in args.shuffles.split(",")], args.repeats)
    if args.parquet:
        compare_parquet(config, args.repeats)
    for step in (10, 200):
        t, nbytes = restore_time(config.replace(max_epochs=0), step)
        print(f"restore at step {step}: first batch after {t * 1000:.0f} ms (median of 3); checkpoint "
              f"{nbytes} bytes = {nbytes / config.lanes:.0f} bytes per lane")


def compare_parquet(config: Config, repeats: int) -> None:
    """The loader from Parquet files against the loader from JSONL.zst, the same documents."""
    parquet = config.replace(sources=[SourceConfig(name="text", uri=config.sources[0].uri.replace("/text/",
                                                                                                 "/parquet/"))])
    mine, mine_cpu, pq_rate, pq_cpu = [], [], [], []
    for _ in range(repeats):
        lrate, ln, _, lcpu = loader_epoch(config)
        prate, pn, _, pcpu = loader_epoch(parquet)
        if pn != ln:
            raise SystemExit(f"the Parquet epoch gave {pn} tokens, the JSONL.zst epoch {ln}: not the same documents")
        mine.append(lrate)
        mine_cpu.append(lcpu)
        pq_rate.append(prate)
        pq_cpu.append(pcpu)
    print(f"loader from Parquet: {fmt(pq_rate)} tok/s; {fmt(pq_cpu)} tok/CPU-s (JSONL.zst: {fmt(mine)} tok/s, "
          f"{fmt(mine_cpu)} tok/CPU-s)")
    print(f"ratio Parquet / JSONL.zst: wall {statistics.median(pq_rate) / statistics.median(mine):.3f}, "
          f"per CPU-second {statistics.median(pq_cpu) / statistics.median(mine_cpu):.3f}")


if __name__ == "__main__":
    main()
