"""Loader throughput against the tokenizer alone, restore time, and checkpoint size, on real text.

    .venv/bin/python bench/loader.py [--mb 48] [--repeats 3] [--backend threads]
    unshare --net -- .venv/bin/python bench/loader.py --backend ray [--mb 8] [--data /tmp/bench]

Data: Debian's kernel and Python documentation (about 41 MB of English text, fetched beforehand
by `make bench-data` with apt-get into ~/.cache/zephon-stream) topped up with the standard
library's sources, written as multi-frame JSONL.zst shards; a byte-level BPE (vocab 8192) trained on it. The baseline is
`Tokenizer.encode_batch_fast` alone on the same documents, in batches of the same size, in this
process on the same cores. The loader runs one epoch (max_epochs = 1) of the same documents.

The Parquet row reads the same documents from Parquet files written by pyarrow (snappy, row
groups of about 1 MiB of text, an `id` column beside `text`), as FineWeb ships them: the loader
from Parquet against the loader from JSONL.zst, in tokens/s and in tokens per CPU-second.

`--backend ray` compares the ray backend with threads on the same data instead: one local Ray
(started once, its start-up timed apart), then epochs on each backend in turn; per batch, the
wall time after the first batch, and tokens per CPU-second of every process involved (this one,
Ray's daemons and the actors, counted from /proc, the reaped ones too). Ray binds only 127.0.0.1
here; run it under `unshare --net` (loopback is brought up) where nothing else may be reached.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
from tests.distributed._launch import loopback_up
from tools.corpus import collect_documents, have_debian_docs, train_tokenizer
from zephon_stream import Config, Loader, SourceConfig, state_to_bytes
from zephon_stream.formats import write_jsonl_shards


def prepare(root: Path, mb: int) -> tuple[list[str], Path]:
    """The bench's documents and tokenizer. Reads the Debian docs from the cache only: a benchmark
    talks to nothing but loopback, so `make bench-data` fetches them beforehand."""
    if not have_debian_docs():
        raise SystemExit("the Debian documentation is not in the cache: run `make bench-data` first "
                         "(apt-get download + dpkg-deb -x, the one step that uses the network)")
    docs = collect_documents(mb << 20, download=False)
    marker = root / f"built-{mb}"
    if not marker.exists():
        write_jsonl_shards(docs, root / "text", name="text", shards=8, compress="zst")
        train_tokenizer(docs, root / "tokenizer.json")
        marker.touch()
    if not (root / f"parquet-{mb}").exists():
        write_parquet(docs, root / "parquet", shards=8)
        (root / f"parquet-{mb}").touch()
    return [t for _, t in docs], root / "tokenizer.json"


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
    """(tokens/s, tokens, tokens per CPU-second of this process) for encode_batch_fast alone."""
    tok = Tokenizer.from_file(str(path))
    t, c = time.perf_counter(), time.process_time()
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts[i:i + batch], add_special_tokens=False))
    return n / (time.perf_counter() - t), n, n / (time.process_time() - c)


def loader_epoch(config: Config) -> tuple[float, int, float, float]:
    """(tokens/s, tokens, seconds to the first batch, tokens per CPU-second) for one loader epoch."""
    t, c = time.perf_counter(), time.process_time()
    loader = Loader(config)
    tokens, first = 0, None
    for batch in loader:
        tokens += int(batch["num_tokens"].sum())
        first = first or time.perf_counter() - t
    return tokens / (time.perf_counter() - t), tokens, first, tokens / (time.process_time() - c)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="threads", help="ray: compare the ray backend with threads instead")
    ap.add_argument("--data", type=Path, default=Path("data/bench"))
    args = ap.parse_args()
    texts, tok = prepare(args.data.resolve(), args.mb)
    size = sum(len(t.encode()) for t in texts)
    print(f"data: {len(texts)} documents, {size / 1e6:.1f} MB of real text; tokenizer {tok}")
    config = Config(seed=1, lanes=12, seq_len=2048, global_batch_size=24, tokenizer=str(tok), max_epochs=1,
                    backend=args.backend, sources=[SourceConfig(name="text", uri=f"file://{tok.parent}/text/")])
    if args.backend == "ray":
        compare_ray(config, args.repeats)
        return
    parquet = config.replace(sources=[SourceConfig(name="text", uri=f"file://{tok.parent}/parquet/")])
    base, mine, base_cpu, mine_cpu, pq_rate, pq_cpu = [], [], [], [], [], []
    for r in range(args.repeats):
        rate, n, cpu = tokenizer_only(texts, tok, config.tokenize_batch)
        base.append(rate)
        base_cpu.append(cpu)
        lrate, ln, first, lcpu = loader_epoch(config)
        mine.append(lrate)
        mine_cpu.append(lcpu)
        prate, pn, pfirst, pcpu = loader_epoch(parquet)
        pq_rate.append(prate)
        pq_cpu.append(pcpu)
        print(f"  run {r}: tokenizer-only {rate:,.0f} tok/s ({n:,} tokens, {cpu:,.0f} tok/CPU-s)   loader "
              f"{lrate:,.0f} tok/s ({ln:,} tokens, first batch after {first:.2f}s, {lcpu:,.0f} tok/CPU-s)   "
              f"parquet {prate:,.0f} tok/s ({pn:,} tokens, first batch after {pfirst:.2f}s, {pcpu:,.0f} tok/CPU-s)")
        if pn != ln:
            raise SystemExit(f"the Parquet epoch gave {pn} tokens, the JSONL.zst epoch {ln}: not the same documents")
    print(f"tokenizer encode_batch_fast alone: {fmt(base)} tok/s")
    print(f"loader ({args.backend}, 12 lanes, seq_len 2048): {fmt(mine)} tok/s")
    print(f"loader from Parquet: {fmt(pq_rate)} tok/s; {fmt(pq_cpu)} tok/CPU-s (JSONL.zst: {fmt(mine_cpu)})")
    print(f"ratio loader / tokenizer-only (wall): {statistics.median(mine) / statistics.median(base):.3f} "
          f"(per-run: {', '.join(f'{m / b:.3f}' for m, b in zip(mine, base))})")
    print(f"ratio loader / tokenizer-only (tokens per CPU-second of this process): "
          f"{statistics.median(mine_cpu) / statistics.median(base_cpu):.3f} "
          f"(per-run: {', '.join(f'{m / b:.3f}' for m, b in zip(mine_cpu, base_cpu))})")
    print(f"ratio Parquet / JSONL.zst: wall {statistics.median(pq_rate) / statistics.median(mine):.3f}, "
          f"per CPU-second {statistics.median(pq_cpu) / statistics.median(mine_cpu):.3f} (per-run wall: "
          f"{', '.join(f'{p / m:.3f}' for p, m in zip(pq_rate, mine))})")
    for step in (10, 200):
        t, nbytes = restore_time(config.replace(max_epochs=0), step)
        print(f"restore at step {step}: first batch after {t * 1000:.0f} ms (median of 3); checkpoint "
              f"{nbytes} bytes = {nbytes / config.lanes:.0f} bytes per lane")


if __name__ == "__main__":
    main()
