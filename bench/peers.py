"""zephon-stream beside its peers, on the same documents, tokenizer, seq_len and machine, in one run.

    make bench-peers                       # builds .venv-peers, then runs this at the real size
    .venv-peers/bin/python bench/peers.py [--mb 48] [--repeats 3] [--warmup 40] [--steps 150] [--restore-step 200]

The loaders, one after the other, each run in a child process of its own (so that each one's peak
RSS is its own, `ru_maxrss` of that child and of its worker processes):

- `zephon-stream`: this repository at its defaults (12 lanes, shuffle window 64, concat packing,
  threads backend), the config of bench/loader.py without the epoch limit.
- `zephon 0.2.0`: the public Zephon (`pip install zephon==0.2.0`, no torch dependency of its own),
  in the best configuration found for it here (see `zephon_pipeline` and `ZEPHON_CONFIGS`).
- `torch DataLoader`: a plain `IterableDataset` + `DataLoader(num_workers=2)` doing the same
  tokenize-and-pack (each worker reads its share of the shards, tokenizes 64 documents a call,
  concatenates with EOS and cuts at seq_len), with no guarantees (order depends on the workers).
- `torchdata StatefulDataLoader`: the same dataset under torchdata's loader, which checkpoints
  through the dataset's own `state_dict` (the position of the first token not yet handed out:
  shard, document, offset) and resumes by re-reading that shard up to it.

Per loader and run: the time to the first batch (from building the loader, imports excluded),
tokens/s over `--steps` batches after the first one and `--warmup` more, tokens per CPU-second over
the same batches (the child and all its descendants, from /proc and RUSAGE_CHILDREN), the time from a new loader
restored at step `--restore-step` to its first batch, and the checkpoint's size in bytes per lane
(a Zephon lane is a canonical replica; a DataLoader's lane is a worker). Tokens are the non-padding
tokens of `input_ids`. Medians over `--repeats` runs with their min and max.

It also packs one epoch of the same documents with Zephon 0.2.0's `best_fit` (`pack_flat`) and
reports the share of documents it drops and its padding share, with and without splitting the
documents longer than seq_len at the tokenizer (Zephon's `split_long_samples`), for comparison with
this repository's `packing = "best_fit"`.

The data is bench/loader.py's (`make bench-data` fetches the Debian documentation beforehand);
everything here reads local files and talks to no network.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
TOKENIZE_BATCH = 64  # documents per tokenizer call, as zephon-stream's tokenize_batch default
LOADERS = ("zephon-stream", "zephon", "torch", "torchdata")
TITLES = {"zephon-stream": "zephon-stream (this repo)", "zephon": "Zephon 0.2.0",
          "torch": "torch DataLoader (2 workers)", "torchdata": "torchdata StatefulDataLoader (2 workers)"}

# Zephon 0.2.0's settings: `--tune-zephon` runs these candidates. On the bench data (2 cores shared with
# other jobs; 2 alternated runs, 100 batches) the threads runner with one tokenize worker gave the most
# tokens per CPU-second (379k, against 353k at tokenize@p2, 328k at the defaults' p4, 348k in mtp_mode,
# 286k on the process runner) with the fastest restore and tokens/s within the noise of the others: the
# process runner pickles every record between processes (50 s to its first batch), mtp_mode adds a
# process hop a batch, and more tokenize workers contend for two cores (a tokenizer call already runs
# in Rust, outside the GIL).
ZEPHON_CANDIDATES: dict[str, tuple[dict[str, Any], int]] = {
    "threads runner, tokenize@p1": ({"runner": "threads"}, 1),
    "threads runner, tokenize@p2": ({"runner": "threads"}, 2),
    "defaults (threads runner, tokenize@p4)": ({}, 4),
    "process runner, tokenize@p2": ({"runner": "process"}, 2),
    "mtp_mode, threads runner, tokenize@p1": ({"runner": "threads", "mtp_mode": True}, 1),
}
ZEPHON_CHUNK = 256  # samples a work chunk: the default 16384 exceeds the bench data (6877 documents)
ZEPHON_OPTIONS, ZEPHON_TOKENIZE_WORKERS = ZEPHON_CANDIDATES["threads runner, tokenize@p1"]


# ---- the child side: one loader, measured ---------------------------------------------------------


class Args:
    """What a child needs, passed as JSON on its command line."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.text, self.tokenizer = Path(d["text"]), Path(d["tokenizer"])
        self.seq_len, self.batch, self.steps = d["seq_len"], d["batch"], d["steps"]
        self.warmup = d.get("warmup", 0)
        self.restore_step = d["restore_step"]
        self.zephon_options = d.get("zephon_options", ZEPHON_OPTIONS)
        self.zephon_workers = d.get("zephon_workers", ZEPHON_TOKENIZE_WORKERS)


def shard_files(text: Path) -> list[Path]:
    return sorted(text.glob("*.jsonl.zst"))


def read_texts(path: Path) -> list[str]:
    """The `text` field of every record of a JSONL.zst shard (json, as a plain loader would)."""
    import zstandard

    with path.open("rb") as f, zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as r:
        data = r.read()
    return [json.loads(line)["text"] for line in data.splitlines() if line.strip()]


class PackedText(IterableDataset):
    """An IterableDataset: this worker's shards, tokenized and cut into samples of seq_len tokens.

    The state is the position of the first token not yet handed out: (shard index among this
    worker's shards, document, token offset in that document including its EOS). Restoring re-reads
    that shard and re-tokenizes from that document on; the state holds no tokens."""

    def __init__(self, files: list[Path], tokenizer: Path, seq_len: int) -> None:
        self.files, self.tokenizer, self.seq_len = files, tokenizer, seq_len
        self.position = (0, 0, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = tuple(state["position"])

    def __iter__(self) -> Iterator[Any]:
        import torch
        from tokenizers import Tokenizer
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        mine = self.files[info.id::info.num_workers] if info else self.files
        tok = Tokenizer.from_file(str(self.tokenizer))
        eos = tok.token_to_id(EOS)
        buf: list[int] = []
        held: deque[list[int]] = deque()  # [shard, doc, offset of its first token in buf, its tokens in buf]
        for shard, doc, offset, ids in self._documents(mine, tok, eos):
            buf += ids
            held.append([shard, doc, offset, len(ids)])
            start = 0
            while len(buf) - start >= self.seq_len:
                sample = buf[start:start + self.seq_len]
                start += self.seq_len
                self.position = self._advance(held, self.seq_len)
                yield torch.tensor(sample, dtype=torch.int64)
            del buf[:start]

    def _documents(self, mine: list[Path], tok: Any, eos: int) -> Iterator[tuple[int, int, int, list[int]]]:
        """(shard, document, offset, its token ids from offset on, EOS included) from `position` on."""
        start_shard, start_doc, start_offset = self.position
        for shard in range(start_shard, len(mine)):
            texts = read_texts(mine[shard])
            first = start_doc if shard == start_shard else 0
            for i in range(first, len(texts), TOKENIZE_BATCH):
                encs = tok.encode_batch_fast(texts[i:i + TOKENIZE_BATCH], add_special_tokens=False)
                for j, e in enumerate(encs):
                    offset = start_offset if (shard, i + j) == (start_shard, start_doc) else 0
                    yield shard, i + j, offset, (e.ids + [eos])[offset:]

    @staticmethod
    def _advance(held: deque[list[int]], n: int) -> tuple[int, int, int]:
        """Take `n` tokens off the front of `held`: the position of the next token."""
        last = held[0]
        while held and n >= held[0][3]:
            n -= held[0][3]
            last = held.popleft()
        if not held:  # a sample ended with a document: the next one starts at the next document
            return last[0], last[1] + 1, 0
        held[0][2] += n
        held[0][3] -= n
        return held[0][0], held[0][1], held[0][2]


def packed_text(a: Args) -> PackedText:
    return PackedText(shard_files(a.text), a.tokenizer, a.seq_len)
class HFTokenizer:
    """The Hugging Face call that Zephon's tokenize op makes (`tok(texts, add_special_tokens=False,
    ...)["input_ids"]`), answered by `tokenizers.Tokenizer.encode_batch_fast`: the same tokenizer
    and call as the other loaders, without transformers' BatchEncoding on top. Loads lazily, so
    that it pickles as a path (Zephon's rule: no tokenizer before workers fork)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.path = str(path)
        self.name_or_path = self.path
        self.pad_token, self.eos_token, self.bos_token_id = None, EOS, None
        self.eos_token_id = Tokenizer.from_file(self.path).token_to_id(EOS)
        self._tok: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, texts: Any, add_special_tokens: bool = False, **_: Any) -> dict[str, list[list[int]]]:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.path)
        texts = [texts] if isinstance(texts, str) else list(texts)
        return {"input_ids": [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]}


def zephon_pipeline(a: Args, packing: str | None = "wrap", split_long: bool = False, batch: bool = True) -> Any:
    """Zephon 0.2.0 reading the same JSONL.zst shards: EOS after each document as zephon-stream does
    (`special_tokens="eos"`), no attention mask, flat packing (`wrap`: concatenate and cut at
    seq_len, the same packing as the others), batches of `a.batch`. `packing` None: the tokenized
    documents, unpacked; `batch` False: the samples, one by one (no last partial batch dropped)."""
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import MixtureSpec, StaticMixtureWorkSource

    ws = StaticMixtureWorkSource(datasets=[Dataset.from_path("text", str(a.text))], mixture=MixtureSpec({"text": 1.0}),
                                 seed=1, chunk_size=ZEPHON_CHUNK)
    tok = HFTokenizer(a.tokenizer)
    p = Pipeline(ws).decode_text().tokenize(
        tokenizer=tok, field="text", add_attention_mask=False, special_tokens="eos", parallelism=a.zephon_workers,
        split_long_samples=split_long, max_length=a.seq_len if split_long else None)
    if packing == "wrap":
        p = p.pack_flat(a.seq_len, algorithm="wrap", emit_positions=False)
    elif packing is not None:
        p = p.pack_flat(a.seq_len, algorithm=packing, num_bins=64, pad_token_id=tok.eos_token_id)
    return (p.batch(a.batch) if batch else p).options(**a.zephon_options)


class Peer:
    """One loader: `open(state)` starts it (restored from `state`, bytes, if given) and returns its
    batches; `state()` is the checkpoint after the batches taken so far, as bytes."""

    lanes = 1
    workers = 0  # worker processes (a fork that execs a tool, such as ldconfig, is not one: its RSS is the parent's)
    no_checkpoint = ""  # why this loader cannot checkpoint, if it cannot

    def open(self, state: bytes | None = None) -> Iterator[Any]:
        raise NotImplementedError

    def tokens(self, batch: Any) -> int:
        raise NotImplementedError

    def state(self) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ZephonStreamPeer(Peer):
    def __init__(self, a: Args) -> None:
        from zephon_stream import Config, SourceConfig

        self.config = Config(seed=1, lanes=12, seq_len=a.seq_len, global_batch_size=a.batch,
                             tokenizer=str(a.tokenizer), sources=[SourceConfig(name="text", uri=f"file://{a.text}/")])
        self.lanes = self.config.lanes
        self.loader: Any = None

    def open(self, state: bytes | None = None) -> Iterator[Any]:
        from zephon_stream import Loader
        from zephon_stream.loader.state import state_from_bytes

        self.loader = Loader(self.config)
        if state is not None:
            self.loader.load_state_dict(state_from_bytes(state))
        return iter(self.loader)

    def tokens(self, batch: Any) -> int:
        return int(batch["num_tokens"].sum())

    def state(self) -> bytes:
        from zephon_stream import state_to_bytes

        return state_to_bytes(self.loader.state_dict())

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


class ZephonPeer(Peer):
    def __init__(self, a: Args) -> None:
        self.a = a
        self.pipeline: Any = None
        self.it: Any = None
        self.workers = int(a.zephon_options.get("runner") == "process" or bool(a.zephon_options.get("mtp_mode")))

    def open(self, state: bytes | None = None) -> Iterator[Any]:
        import msgpack

        self.pipeline = zephon_pipeline(self.a)
        if state is not None:
            self.pipeline.restore(msgpack.unpackb(state, strict_map_key=False))
        self.it = iter(self.pipeline)
        return self.it

    def tokens(self, batch: Any) -> int:
        ids = batch.to_training()["input_ids"]
        return int(ids.numel())  # wrap emits full bins only: no padding

    def state(self) -> bytes:
        import msgpack

        return msgpack.packb(self.pipeline.checkpoint())

    def close(self) -> None:
        if self.it is not None:
            self.it.close()


class TorchPeer(Peer):
    lanes = workers = 2  # a lane is a worker
    no_checkpoint = "n/a (no state)"

    def __init__(self, a: Args) -> None:
        self.a = a
        self.loader: Any = None

    def _loader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(packed_text(self.a), batch_size=self.a.batch, num_workers=2)

    def open(self, state: bytes | None = None) -> Iterator[Any]:
        self.loader = self._loader()
        self.it = iter(self.loader)
        return self.it

    def tokens(self, batch: Any) -> int:
        return int(batch.numel())

    def close(self) -> None:
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class TorchDataPeer(TorchPeer):
    no_checkpoint = ""

    def _loader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(packed_text(self.a), batch_size=self.a.batch, num_workers=2)

    def open(self, state: bytes | None = None) -> Iterator[Any]:
        self.loader = self._loader()
        if state is not None:
            self.loader.load_state_dict(pickle.loads(state))
        self.it = iter(self.loader)
        return self.it

    def state(self) -> bytes:
        return pickle.dumps(self.loader.state_dict())


PEERS = {"zephon-stream": ZephonStreamPeer, "zephon": ZephonPeer, "torch": TorchPeer, "torchdata": TorchDataPeer}


def tree_cpu() -> float:
    """CPU seconds of this process, its live descendants (from /proc) and its reaped children."""
    ticks = 0
    for pid in descendants():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ticks / os.sysconf("SC_CLK_TCK") + done.ru_utime + done.ru_stime


def descendants() -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
    mine, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        mine.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return mine


def measure(peer: Peer, steps: int, restore_step: int, warmup: int = 0) -> dict[str, Any]:
    """One run of a loader: seconds to the first batch; tokens, seconds and CPU seconds of the
    `steps` batches after it and `warmup` more (untimed: a loader that reads ahead or fills a shuffle
    window before it hands out a batch does that work once, in the first batches; a training run's
    throughput is what follows); then on to `restore_step` batches, the checkpoint there, and the
    seconds from a new loader restored from it to its first batch. Peak RSS is read before the
    restore (the loader's own run), after its workers were joined."""
    t = time.perf_counter()
    it = peer.open()
    next(it)
    out: dict[str, Any] = {"first": time.perf_counter() - t}
    for _ in range(warmup):
        next(it)
    t, cpu, tokens = time.perf_counter(), tree_cpu(), 0
    for _ in range(steps):
        tokens += peer.tokens(next(it))
    out.update(tokens=tokens, wall=time.perf_counter() - t, cpu=tree_cpu() - cpu)
    for _ in range(restore_step - 1 - warmup - steps):
        next(it)
    state = None if peer.no_checkpoint else peer.state()
    peer.close()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out.update(lanes=peer.lanes, rss_mb=me.ru_maxrss / 1024, worker_rss_mb=kids.ru_maxrss / 1024 if peer.workers else 0)
    if state is not None:
        t = time.perf_counter()
        next(peer.open(state))
        out.update(restore=time.perf_counter() - t, state_bytes=len(state))
        peer.close()
    return out


def child(name: str, a: Args) -> None:
    """Run in a child process: one loader, measured, printed as one JSON line."""
    print("RESULT " + json.dumps(measure(PEERS[name](a), a.steps, a.restore_step, a.warmup)), flush=True)


def best_fit(a: Args) -> dict[str, Any]:
    """Zephon 0.2.0's best_fit over one epoch: what its work source reads (documents and tokens
    tokenized), then what best_fit keeps of it (documents, tokens, padding), as given and with the
    documents longer than seq_len split by the tokenizer. No batching, so no last batch is dropped."""
    out: dict[str, Any] = {"docs_on_disk": sum(len(read_texts(f)) for f in shard_files(a.text))}
    for split in (False, True):
        read = [len(r.payload["input_ids"]) for r in zephon_pipeline(a, None, split_long=split, batch=False)]
        packed = best_fit_epoch(zephon_pipeline(a, "best_fit", split_long=split, batch=False), a.seq_len)
        out["split" if split else "as_is"] = {"read": len(read), "read_tokens": sum(read),
                                              "long": sum(n > a.seq_len for n in read), **packed}
    return out


def best_fit_epoch(samples: Any, seq_len: int) -> dict[str, int]:
    """Samples, document segments (a position 0 each) and non-padding tokens of packed samples."""
    n = segments = real = 0
    for record in samples:
        pad = record.meta.padding_length or 0
        n += 1
        real += seq_len - pad
        segments += int((record.payload["positions"][:seq_len - pad] == 0).sum())
    return {"samples": n, "segments": segments, "real_tokens": real}


# ---- the parent side: children, repeats, the table -------------------------------------------------


def run_child(name: str, a: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, json.dumps(a)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail}"}


def spread(xs: list[float], unit: str = "", scale: float = 1.0, digits: int = 0) -> str:
    xs = [x * scale for x in xs]
    if not xs:
        return "n/a"
    f = f"{{:,.{digits}f}}"
    med = f.format(statistics.median(xs)) + unit
    low, high = f.format(min(xs)), f.format(max(xs))
    return med if low == high else f"{med} ({low}-{high})"


def row(title: str, runs: list[dict[str, Any]], no_checkpoint: str) -> str:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return f"| {title} | failed: {runs[0]['error'] if runs else 'not run'} | | | | | |"
    rate = spread([r["tokens"] / r["wall"] for r in ok])
    per_cpu = spread([r["tokens"] / r["cpu"] for r in ok])
    first = spread([r["first"] for r in ok], " s", digits=2)
    rss = spread([r["rss_mb"] for r in ok], " MB")
    workers = [r["worker_rss_mb"] for r in ok if r["worker_rss_mb"] > 0]
    if workers:
        rss += f" + workers {spread(workers, ' MB')} each"
    done = [r for r in ok if "restore" in r]
    if no_checkpoint or not done:
        back = size = no_checkpoint or "n/a (not measured)"
    else:
        back = spread([r["restore"] for r in done], " s", digits=2)
        lanes = done[0]["lanes"]
        size = spread([r["state_bytes"] / lanes for r in done]) + f" ({lanes} lane{'s' * (lanes > 1)})"
    failed = len(runs) - len(ok)
    note = f" ({failed} of {len(runs)} runs failed: {next(r['error'] for r in runs if 'error' in r)})" if failed else ""
    return f"| {title}{note} | {rate} | {per_cpu} | {first} | {back} | {size} | {rss} |"


def table(rows: list[str], restore_step: int) -> None:
    print(f"\n| loader | tokens/s | tokens/CPU-s | first batch | restore -> first batch at step {restore_step} "
          "| checkpoint bytes/lane | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


def print_best_fit(r: dict[str, Any], seq_len: int) -> None:
    if "error" in r:
        print(f"Zephon 0.2.0 best_fit: failed: {r['error']}")
        return
    e = r["as_is"]
    print(f"\nZephon 0.2.0 best_fit (pack_flat, num_bins 64, seq_len {seq_len}), one epoch: its work source reads "
          f"{e['read']:,} of the {r['docs_on_disk']:,} documents ({1 - e['read'] / r['docs_on_disk']:.1%} never "
          f"read: it emits whole work chunks of {ZEPHON_CHUNK} only), {e['read_tokens']:,} tokens, "
          f"{e['long']:,} documents longer than seq_len")
    dropped = e["read_tokens"] - e["real_tokens"]
    print(f"  as given (drop_oversized, the default): documents dropped {e['read'] - e['segments']:,} "
          f"({(e['read'] - e['segments']) / e['read']:.1%} of those read), tokens dropped {dropped:,} "
          f"({dropped / e['read_tokens']:.1%}), padding {padding(e, seq_len):.1%} of {e['samples']:,} samples")
    s = r["split"]
    dropped = s["read_tokens"] - s["real_tokens"]
    print(f"  long documents split at seq_len by the tokenizer (split_long_samples): {s['read']:,} pieces, "
          f"{s['read'] - s['segments']:,} dropped, tokens dropped {dropped:,} ({dropped / s['read_tokens']:.1%}), "
          f"padding {padding(s, seq_len):.1%} of {s['samples']:,} samples")


def padding(e: dict[str, int], seq_len: int) -> float:
    return 1 - e["real_tokens"] / (e["samples"] * seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=48, help="MB of text (bench/loader.py's data)")
    ap.add_argument("--data", type=Path, default=Path("data/bench"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150, help="batches timed after the first one and --warmup more")
    ap.add_argument("--warmup", type=int, default=40,
                    help="batches after the first one taken untimed (0: timed from the second batch, as before)")
    ap.add_argument("--restore-step", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=24, help="samples a batch (zephon-stream: global_batch_size)")
    ap.add_argument("--loaders", default=",".join(LOADERS), help=f"a comma-separated subset of {','.join(LOADERS)}")
    ap.add_argument("--no-best-fit", action="store_true", help="skip Zephon's best_fit drop and padding shares")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a child may run")
    ap.add_argument("--tune-zephon", action="store_true", help="compare the Zephon 0.2.0 settings of ZEPHON_CANDIDATES")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, a = args.child
        if name == "zephon-best-fit":
            print("RESULT " + json.dumps(best_fit(Args(json.loads(a)))), flush=True)
        else:
            child(name, Args(json.loads(a)))
        return
    compare(args)


def compare(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from bench.loader import prepare

    texts, tok = prepare(args.data.resolve(), args.mb)
    head = subprocess.run(["git", "log", "-1", "--format=%h %cI"], capture_output=True, text=True, cwd=REPO).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "zephon_stream"],
                           capture_output=True, text=True, cwd=REPO).stdout.splitlines()
    print(f"zephon-stream at {head.strip()}" + (f", with uncommitted changes in {len(dirty)} files of zephon_stream/"
                                                 if dirty else ""))
    print(f"data: {len(texts):,} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB of text, "
          f"{len(shard_files(tok.parent / 'text'))} JSONL.zst shards; tokenizer {tok}; seq_len {args.seq_len}, "
          f"{args.batch} samples a batch; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    a = {"text": str(tok.parent / "text"), "tokenizer": str(tok), "seq_len": args.seq_len, "batch": args.batch,
         "steps": args.steps, "restore_step": args.restore_step, "warmup": args.warmup}
    if args.restore_step <= 1 + args.warmup + args.steps:
        raise SystemExit(f"--restore-step {args.restore_step} must be past the first batch, the {args.warmup} untimed "
                         f"(--warmup) and the {args.steps} timed batches (--steps)")
    if args.tune_zephon:
        tune_zephon(a, args)
        return
    names = [n for n in args.loaders.split(",") if n]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):  # alternate the loaders, so that the machine's drift spreads over all
        for n in names:
            runs[n].append(run_child(n, a, args.timeout))
            print(f"  run {r} {n}: {brief(runs[n][-1])}", flush=True)
    table([row(TITLES[n], runs[n], PEERS[n].no_checkpoint) for n in names], args.restore_step)
    print(f"\nmedian (min-max) of {args.repeats} runs, each loader in a child process of its own; tokens/s and "
          f"tokens/CPU-s over {args.steps} batches after the first and {args.warmup} more (CPU: the loader's "
          "process and its workers); "
          f"peak RSS: ru_maxrss of that process, and of its largest worker")
    print(f"Zephon 0.2.0 settings: {ZEPHON_OPTIONS}, tokenize parallelism {ZEPHON_TOKENIZE_WORKERS}, no attention "
          f"mask, pack_flat wrap, work chunks of {ZEPHON_CHUNK} samples")
    if not args.no_best_fit:
        print_best_fit(run_child("zephon-best-fit", a, args.timeout), args.seq_len)


def brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return r["error"]
    back = f", restore {r['restore']:.2f} s, {r['state_bytes']:,} bytes" if "restore" in r else ""
    return (f"first batch {r['first']:.2f} s, {r['tokens'] / r['wall']:,.0f} tok/s, {r['tokens'] / r['cpu']:,.0f} "
            f"tok/CPU-s{back}, RSS {r['rss_mb']:.0f} MB (workers {r['worker_rss_mb']:.0f} MB)")


def tune_zephon(a: dict[str, Any], args: argparse.Namespace) -> None:
    """The candidate settings of Zephon 0.2.0, alternated, in the table's form."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ZEPHON_CANDIDATES}
    for r in range(args.repeats):
        for k, (options, workers) in ZEPHON_CANDIDATES.items():
            config = {**a, "zephon_options": options, "zephon_workers": workers}
            runs[k].append(run_child("zephon", config, args.timeout))
            print(f"  run {r} {k}: {brief(runs[k][-1])}", flush=True)
    table([row(f"Zephon 0.2.0, {k}", rs, "") for k, rs in runs.items()], args.restore_step)


if __name__ == "__main__":
    main()
