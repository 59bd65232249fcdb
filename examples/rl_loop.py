"""Both jobs in one loop: a trainer streams text and publishes, a relay copies, rollout workers pull.

    trainer (asyncio: Loader `async for`, a training step in a thread, PublishLoop every k steps)
       │ publishes the tiny GPT's weights as versions (keyframes, XOR deltas) to region "trainer"
       ▼
    SeaweedFS "trainer" ──throttled WAN link──> `zephon relay` ──> SeaweedFS "rollout"
                                                                      ▲          ▲
                                            rollout worker 0 (process) ┘          └ rollout worker 1

Everything runs on 127.0.0.1: two SeaweedFS servers, a loopback proxy that emulates the WAN
(`zephon_stream.testing.proxy.Link`), the `zephon relay` daemon, and two rollout worker
processes. Each worker holds its own TinyGPT and a `Subscriber(module=model)` on the rollout
region: every new version is written into the model's own parameters in place, then the worker
generates a few tokens with it. Per version and worker the trainer process prints the time from
publish (the MANIFEST committed in the trainer region) to applied (the worker's pull returned),
the version lag (versions published by then that the worker did not have yet), and whether
the worker's weights are bit-exact with the trainer's: the worker's model digest, which its pull
verified chunk by chunk in O(delta), against the digest the trainer published.

    .venv/bin/python examples/rl_loop.py                      # real text (Debian docs when apt works)
    .venv/bin/python examples/rl_loop.py --quick --kill-worker 1 --kill-at 3   # SIGKILL and restart one

`--kill-worker W --kill-at V` SIGKILLs worker W once version V is published, wherever it is
(mid-pull included), and starts it again: it joins from the newest keyframe and catches up.
Exit status 0 when every applied version was bit-exact and every worker reached the last one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import torch
import torch.nn.functional as F
from anyio.streams.buffered import BufferedByteReceiveStream

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the tiny GPT of train_tiny_gpt.py; the repository's tools/
from train_tiny_gpt import TinyGPT  # noqa: E402

from zephon_stream import Config, Loader, SourceConfig  # noqa: E402
from zephon_stream.connectors import open_store  # noqa: E402
from zephon_stream.refit import Publisher, PublishLoop, Subscriber  # noqa: E402
from zephon_stream.testing.proxy import FaultProxy, Link  # noqa: E402
from zephon_stream.testing.seaweed import SeaweedServer  # noqa: E402

PREFIX = "s3://weights/policy/"
PROMPT = "The kernel"


@dataclass(frozen=True)
class Shape:
    vocab: int
    seq_len: int = 128
    d: int = 128
    layers: int = 2
    heads: int = 4


def make_model(shape: Shape, seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(shape.vocab, shape.seq_len, shape.d, shape.layers, shape.heads)


def weights_sha(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's bytes (an O(model) cross-check beside the O(delta) digest)."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# -- rollout worker (its own process) -----------------------------------------------------------

@torch.no_grad()
def generate(model: TinyGPT, ids: list[int], n: int, seq_len: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        x = torch.tensor([out[-seq_len:]])
        logits = model(x, torch.arange(x.shape[1])[None])
        out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


async def rollout(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer

    setup = Path(args.setup)
    while not setup.exists():  # started with the servers, so that its imports overlap their start-up
        await anyio.sleep(0.05)
    cfg = json.loads(setup.read_text())
    shape, options, verify = Shape(**cfg["shape"]), cfg["region"], cfg["verify_bytes"]
    tok = Tokenizer.from_file(cfg["tokenizer"])
    model = make_model(shape, seed=1000 + args.id).eval()  # its own weights until the first pull
    prompt = tok.encode(PROMPT).ids
    store, key = open_store(PREFIX, **options)
    sub = Subscriber(key, store=store, module=model, workers=2)
    have = 0
    async with store:
        print(json.dumps({"worker": args.id, "pid": os.getpid(), "ready": True}), flush=True)
        while True:
            version = await sub.pull()
            if version > have:
                applied = time.time()
                tokens = generate(model, prompt, cfg["tokens"], shape.seq_len)
                event = {"worker": args.id, "pid": os.getpid(), "version": version, "applied": applied,
                         "digest": sub.record.model_digest, "text": tok.decode(tokens)}
                if verify:
                    event["sha"] = weights_sha(model.state_dict())
                print(json.dumps(event), flush=True)
                have = version
            else:
                await sub.prefetch()  # verify the next delta's objects the relay already streamed ahead
                await anyio.sleep(args.poll)


# -- the trainer process: servers, relay, workers, training -------------------------------------

@dataclass
class Published:
    version: int
    at: float
    digest: int
    keyframe: bool
    sha: str | None


@dataclass
class Run:
    """What the trainer process saw: versions published, and each worker's applied versions."""

    published: dict[int, Published] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    steps: int = 0
    submitted: list[int] = field(default_factory=list)  # the step of each submit not yet published
    publish_stats: dict = field(default_factory=dict)

    def lag(self, version: int, at: float) -> int:
        return sum(1 for p in self.published.values() if p.version > version and p.at <= at)


def demo_config(args: argparse.Namespace) -> Config:
    from tools.corpus import build_demo

    if args.quick:  # the standard library's docstrings and code: seconds, no network
        demo = build_demo(args.data / "quick", min_bytes=300_000, debian_docs=False)
    else:
        demo = build_demo(args.data / "full")
    return Config(seed=1234, lanes=4, seq_len=args.seq_len, global_batch_size=args.batch, tokenizer=demo.tokenizer,
                  shuffle_window=64, sources=[
                      SourceConfig(name="prose", uri=f"file://{demo.sources['prose']}/", weight=0.7),
                      SourceConfig(name="code", uri=f"file://{demo.sources['code']}/", weight=0.3)])


def train_step(model: TinyGPT, optim: torch.optim.Optimizer, batch: dict) -> float:
    logits = model(batch["input_ids"], batch["position_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.item()


class Worker:
    """A rollout worker process and the task that reads its events."""

    def __init__(self, wid: int, cmd: list[str], run: Run, report) -> None:
        self.wid, self.cmd, self.run, self.report = wid, cmd, run, report
        self.proc: anyio.abc.Process | None = None
        self.version = 0
        self.ready = anyio.Event()

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        self.proc = await anyio.open_process([*self.cmd, "--id", str(self.wid)], stderr=None)
        tg.start_soon(self._read, self.proc)

    async def _read(self, proc: anyio.abc.Process) -> None:
        stream = BufferedByteReceiveStream(proc.stdout)
        try:
            while True:
                line = await stream.receive_until(b"\n", 1 << 20)
                event = json.loads(line)
                if event.get("ready"):
                    self.ready.set()
                    continue
                self.version = max(self.version, event["version"])
                self.run.events.append(event)
                self.report(event)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
            await proc.wait()  # the process ended (or was killed): whoever waits for it checks `alive`
            self.ready.set()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill_and_restart(self, tg: anyio.abc.TaskGroup) -> None:
        old = self.proc
        assert old is not None
        old.send_signal(signal.SIGKILL)
        await old.wait()
        self.run.restarts.append({"worker": self.wid, "pid": old.pid, "at": time.time(), "had": self.version})
        print(f"   worker {self.wid}: SIGKILL (pid {old.pid}, at version {self.version}); restarting", flush=True)
        self.version, self.ready = 0, anyio.Event()
        await self.start(tg)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()


def reporter(run: Run):
    def report(e: dict) -> None:
        p = run.published.get(e["version"])
        if p is None:
            print(f"   worker {e['worker']}: v{e['version']} (published before this run saw it)", flush=True)
            return
        exact = e["digest"] == p.digest and (p.sha is None or e.get("sha") == p.sha)
        e["latency_s"], e["lag"], e["bit_exact"] = e["applied"] - p.at, run.lag(e["version"], e["applied"]), exact
        print(f"   v{e['version']:<3} worker {e['worker']}: applied {e['latency_s'] * 1000:6.0f} ms after publish, "
              f"lag {e['lag']}, bit-exact {'yes' if exact else 'NO'}  digest {e['digest']:016x}  "
              f"generates {e['text']!r}", flush=True)
    return report


async def train(args: argparse.Namespace, regions: dict[str, dict], run: Run, workers: list[Worker],
                tg: anyio.abc.TaskGroup) -> None:
    config = await anyio.to_thread.run_sync(demo_config, args)
    from tokenizers import Tokenizer

    shape = Shape(Tokenizer.from_file(config.tokenizer).get_vocab_size(), args.seq_len, args.d_model, args.layers,
                  args.heads)
    model = make_model(shape, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = sum(p.numel() for p in model.parameters())
    setup = {"region": regions["rollout"], "shape": asdict(shape), "tokenizer": config.tokenizer,
             "tokens": args.tokens, "verify_bytes": args.verify_bytes}
    tmp = args.work / ".setup.json"
    tmp.write_text(json.dumps(setup))
    tmp.chmod(0o600)  # it holds the rollout region's credentials
    tmp.rename(args.work / "setup.json")  # whole or absent: the workers wait for it

    def published(info, at: float) -> None:
        sha = weights_sha(publishing.snapshot) if args.verify_bytes else None
        run.published[info.version] = Published(info.version, at, info.model_digest, info.keyframe, sha)
        # a keyframe version also holds the delta from the version before it, for subscribers that have that one
        kind = (f"keyframe of {info.key_bytes:,} bytes" + (f" + delta of {info.delta_bytes:,}" if info.delta_bytes
                                                            else "") if info.keyframe
                else f"delta of {info.delta_bytes:,} bytes")
        taken = run.submitted.pop(0)  # one version per submit, in order: the next submit waits for this one
        print(f"v{info.version:<3} (the weights after step {taken}) committed during step {run.steps}: {kind}, "
              f"model {info.model_bytes:,} bytes, "
              f"digest {info.model_digest:016x}", flush=True)

    pstore, pkey = open_store(PREFIX, **regions["trainer"])
    pub = Publisher(pkey, store=pstore, keyframe_every=args.keyframe_every, keep_versions=args.keep_versions,
                    chunk_bytes=args.chunk_kib << 10, workers=2)
    print(f"[{time.perf_counter() - args.t0:.1f} s] trainer: TinyGPT {params / 1e6:.2f}M parameters, vocab "
          f"{shape.vocab}, {args.batch} x {args.seq_len} tokens a step; publishing every {args.every} steps",
          flush=True)
    with anyio.fail_after(args.timeout):  # each has its model and its store before the first version
        for w in workers:
            await w.ready.wait()
            if not w.alive:
                code = await w.proc.wait()
                raise RuntimeError(f"rollout worker {w.wid} exited with status {code} before it was ready: "
                                   "its error is printed above")
    print(f"rollout workers ready after {time.perf_counter() - args.t0:.1f} s", flush=True)
    async with pstore, PublishLoop(pub, on_published=published) as publishing:
        async with Loader(config).open() as stream:
            async for batch in stream:
                await anyio.to_thread.run_sync(train_step, model, optim, batch)
                run.steps += 1
                if run.steps % args.every == 0:
                    run.submitted.append(run.steps)
                    await publishing.submit(model.state_dict())
                    done = publishing.statistics().published
                    if args.kill_worker is not None and done + 1 == args.kill_at:
                        await kill_mid_run(workers[args.kill_worker], publishing, tg, args.timeout)
                    if done + 1 >= args.versions:
                        break
        last = await publishing.drain()
        s = publishing.statistics()
        run.publish_stats = {"published": s.published, "snapshot_s": s.snapshot_s, "publish_s": s.publish_s,
                             "waited_s": s.waited_s}
    with anyio.fail_after(args.timeout):  # every worker reaches the last version
        while any(w.version < last.version for w in workers):
            await anyio.sleep(0.05)
    for w in workers:
        await w.stop()


async def kill_mid_run(worker: Worker, publishing: PublishLoop, tg: anyio.abc.TaskGroup, timeout: float) -> None:
    """SIGKILL a worker that holds a version, as soon as the next one is committed (it may be pulling it)."""
    with anyio.fail_after(timeout):
        while worker.version == 0:
            await anyio.sleep(0.01)
    await publishing.drain()
    await worker.kill_and_restart(tg)


def summarize(run: Run, workers: int, last: int) -> bool:
    print("\nper worker: versions applied, publish -> applied latency (median, max), worst lag, all bit-exact")
    ok = True
    for w in range(workers):
        es = [e for e in run.events if e["worker"] == w and "latency_s" in e]
        lat = [e["latency_s"] * 1000 for e in es]
        exact = all(e["bit_exact"] for e in es)
        reached = max((e["version"] for e in es), default=0)
        ok &= exact and reached == last and bool(es)
        print(f"  worker {w}: {len(es)} versions, latency median {statistics.median(lat):.0f} ms, "
              f"max {max(lat):.0f} ms, worst lag {max(e['lag'] for e in es)}, "
              f"bit-exact {'yes' if exact else 'NO'}, last v{reached}"
              if es else f"  worker {w}: applied nothing")
    st = run.publish_stats
    if st:
        print(f"trainer: {run.steps} steps; snapshot {st['snapshot_s']:.2f} s, waiting for the previous publish "
              f"{st['waited_s']:.2f} s (the loop's only stall), publishing in the background {st['publish_s']:.2f} s")
    return ok


def relay_config(path: Path, parent: dict, child: dict, poll: float) -> Path:
    def table(name: str, o: dict) -> str:
        return (f'[{name}]\nuri = "{PREFIX}"\nendpoint_url = "{o["endpoint_url"]}"\nregion = "us-east-1"\n'
                f'access_key_id = "{o["access_key_id"]}"\nsecret_access_key = "{o["secret_access_key"]}"\n')

    path.write_text(f"poll_interval = {poll}\n" + table("from", parent) + table("[to]", child))
    path.chmod(0o600)  # it holds two regions' credentials
    return path


async def run_all(args: argparse.Namespace, run: Run, stack: ExitStack) -> tuple[subprocess.Popen, FaultProxy]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--setup", str(args.work / "setup.json")]
    workers = [Worker(i, cmd, run, reporter(run)) for i in range(args.workers)]
    async with anyio.create_task_group() as tg:
        for w in workers:  # first: their imports overlap the servers' start-up
            await w.start(tg)
        proc, link, regions = await anyio.to_thread.run_sync(start_regions, args, stack)
        try:
            await train(args, regions, run, workers, tg)
        finally:
            proc.terminate()
            await anyio.to_thread.run_sync(proc.wait, 30)
            for w in workers:
                await w.stop()
    return proc, link


def start_regions(args: argparse.Namespace, stack: ExitStack) -> tuple[subprocess.Popen, FaultProxy, dict]:
    """Two SeaweedFS regions, the WAN link between them, and the relay daemon across it."""
    servers = {r: SeaweedServer() for r in ("trainer", "rollout")}
    for s in servers.values():
        stack.callback(s.stop)
    with ThreadPoolExecutor(len(servers)) as pool:  # the two start-ups overlap
        list(pool.map(SeaweedServer.start, servers.values()))
    for s in servers.values():
        s.create_bucket("weights")
    regions = {r: s.store_options() for r, s in servers.items()}
    wan = Link(bandwidth=args.wan_mbit * 1e6 / 8, latency_s=args.wan_ms / 1e3)
    link = stack.enter_context(FaultProxy(servers["trainer"].endpoint_url, link=wan))
    config = relay_config(args.work / "relay.toml", {**regions["trainer"], "endpoint_url": link.url},
                          regions["rollout"], args.poll)
    log = stack.enter_context(open(args.work / "relay.log", "wb"))
    proc = subprocess.Popen([sys.executable, "-m", "zephon_stream.cli", "relay", "--config", str(config)],
                            stdout=log, stderr=log)
    print(f"regions trainer and rollout (SeaweedFS on 127.0.0.1); relay pid {proc.pid} across a "
          f"{args.wan_mbit:g} Mbit/s, {args.wan_ms:g} ms link; {args.workers} rollout workers\n", flush=True)
    return proc, link, regions


def main_loop(args: argparse.Namespace) -> int:
    run = Run()
    args.t0 = time.perf_counter()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="zephon-rl-loop-") as tmp:
        args.work = Path(tmp)
        _, link = anyio.run(run_all, args, run, stack)
        ok = summarize(run, args.workers, max(run.published, default=0))
        st = link.statistics()
        print(f"relay: {st.body_bytes('GET'):,} bytes across the WAN link in {st.requests} requests; "
              f"{len(run.restarts)} worker restart(s)")
    if args.json:
        args.json.write_text(json.dumps({"published": {v: asdict(p) for v, p in run.published.items()},
                                         "events": run.events, "restarts": run.restarts, "ok": ok}))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role")
    w = sub.add_parser("worker", help="a rollout worker (started by the trainer process)")
    w.add_argument("--id", type=int, required=True)
    w.add_argument("--setup", required=True, help="JSON file the trainer writes: region, model shape, tokenizer")
    w.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--versions", type=int, default=8, help="stop after publishing this many versions")
    ap.add_argument("--every", type=int, default=5, help="publish every k training steps")
    ap.add_argument("--keyframe-every", type=int, default=4)
    ap.add_argument("--keep-versions", type=int, default=8)
    ap.add_argument("--chunk-kib", type=int, default=1024, help="refit chunk size, KiB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-worker", type=int, help="SIGKILL this worker once --kill-at is published, and restart it")
    ap.add_argument("--kill-at", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the small standard-library corpus (seconds, no network)")
    ap.add_argument("--data", type=Path, default=Path("data/rl_loop"))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tokens", type=int, default=8, help="tokens each worker generates per version")
    ap.add_argument("--wan-mbit", type=float, default=100.0)
    ap.add_argument("--wan-ms", type=float, default=20.0)
    ap.add_argument("--poll", type=float, default=0.05, help="relay and worker poll interval, seconds")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds the workers get to reach the last version")
    ap.add_argument("--verify-bytes", action="store_true", help="also compare SHA-256 of all weights (O(model))")
    ap.add_argument("--json", type=Path, help="write what happened here (for tests)")
    args = ap.parse_args()
    if args.role == "worker":
        anyio.run(rollout, args)
        return 0
    return main_loop(args)


if __name__ == "__main__":
    sys.exit(main())
