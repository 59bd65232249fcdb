"""Relay benchmark: delta versions against one full checkpoint through the same relay tree.

    trainer (SeaweedFS) ── root relay (`zephon relay`) ──100 Mbit/s link──> region A (SeaweedFS) <── subscriber A
                                                      └─100 Mbit/s link──> region B (SeaweedFS) <── subscriber B

Every box is its own process: three `weed` servers, the relay daemon, two subscribers, the two
WAN links (`zephon_stream.testing.proxy.FaultProxy` with a token bucket and a per-request
latency), and the publisher in this one. The model is >= 256M bf16 parameters, N(0, 0.02).

- full: version 1 is a keyframe (every chunk compressed whole, what a joiner downloads): the
  trainer publishes it, the relay copies it to both regions, each subscriber applies it.
- delta: scenario A of the refit bench, an Adam-like step w +- lr*u, u ~ U(0.5, 1.5),
  lr = 1e-6, then versions 2, 3, ... go the same way (`--deltas`, default 5; the report gives
  the median and the spread).

Each phase is timed from `publish()` to the slower region's subscriber having applied it, and
split along its critical path: encode + upload at the trainer (until its MANIFEST is in), relay
poll wait, transfer (the relay reads the trainer and writes both regions over the links),
commit (MANIFEST + LATEST over each link), subscriber poll wait, fetch + verify + apply.
Then the relay node's peak RSS (wait4) for `--once` over a 1 GB and a 4 GB keyframe, without
links, and with nothing to copy.

    .venv/bin/python bench/relay.py [--params 268435456] [--deltas 5] [--latency-ms 30] [--rss-gb 1 4]

`--role startup [--source DIR]` measures instead how fast `zephon relay --help` starts and what an
idle `zephon relay --once` holds (5 runs each), for this tree or another checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

from zephon_stream import ObjectNotFound
from zephon_stream.connectors import MemoryStore, open_store
from zephon_stream.refit import Publisher, Subscriber
from zephon_stream.refit.versions import find_latest, manifest_key, manifest_version, version_prefix
from zephon_stream.testing.proxy import FaultProxy, Link
from zephon_stream.testing.seaweed import SeaweedServer

BLOCK = 1 << 24
URI = "s3://weights/policy/"


# -- the model --------------------------------------------------------------------------------


def shapes(params: int, tensors: int) -> dict[str, tuple[int, int]]:
    per = params // tensors // 4096 * 4096
    return {f"layer{i:03d}.weight": (per // 4096, 4096) for i in range(tensors)}


def make_model(params: int, tensors: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes(params, tensors).items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        flat = t.view(-1)
        for lo in range(0, flat.numel(), BLOCK):
            n = min(BLOCK, flat.numel() - lo)
            flat[lo : lo + n] = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        out[name] = t
    return out


def adam_step(model: dict[str, torch.Tensor], seed: int) -> None:
    """Scenario A: w <- w +- lr*u, u ~ U(0.5, 1.5), lr = 1e-6, in place."""
    g = torch.Generator().manual_seed(seed)
    for t in model.values():
        flat = t.view(-1)
        for lo in range(0, flat.numel(), BLOCK):
            w = flat[lo : lo + BLOCK]
            u = torch.rand(w.numel(), generator=g) + 0.5
            sign = torch.randint(0, 2, (w.numel(),), generator=g, dtype=torch.int8).float() * 2 - 1
            w.copy_((w.float() + sign * u * 1e-6).to(torch.bfloat16))


def digest(model: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(model):
        h.update(memoryview(model[k].view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


# -- the subscriber process -------------------------------------------------------------------


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def subscribe(args: argparse.Namespace) -> None:
    cfg = json.loads(Path(args.config).read_text())
    state = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes(args.params, args.tensors).items()}
    store, key = open_store(cfg["uri"], **cfg["options"])
    async with store:
        sub = Subscriber(key, store=store, workers=4, threads=1)
        await find_latest(store, key)
        emit(event="ready")
        have = 0
        while have < args.versions:
            try:  # one HEAD per poll: the next version exists once its MANIFEST does
                await store.head(manifest_key(key, have + 1))
            except ObjectNotFound:
                if args.prefetch and have:  # verify ahead what the relay already streamed here (a LIST)
                    await sub.prefetch(state)
                await anyio.sleep(args.poll)
                continue
            detect = time.time()
            have = await sub.pull(state)
            emit(event="applied", version=have, detect=detect, done=time.time(), model_digest=sub.record.model_digest)
    emit(event="final", digest=digest(state))


def serve_link(args: argparse.Namespace) -> None:
    """A region's WAN link in its own process, as a real one is in nobody's: `reset` and `stats` on stdin."""
    link = Link(bandwidth=args.mbit * 1e6 / 8, latency_s=args.latency_ms / 1000, burst=1 << 20)
    with FaultProxy(args.upstream, link=link) as proxy:
        emit(event="ready", url=proxy.url)
        for line in sys.stdin:
            if line.strip() == "reset":
                proxy.reset_statistics()
                emit(event="reset")
            elif line.strip() == "stats":
                emit(event="stats", bytes_up=proxy.statistics(settle=1).bytes_up)


# -- the orchestrator -------------------------------------------------------------------------


class TimedStore:
    """The publisher's store, noting when each MANIFEST put returns (the version exists then)."""

    def __init__(self, inner: Any, prefix: str) -> None:
        self.inner, self.prefix, self.manifests = inner, prefix, {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        await self.inner.put(key, data, if_none_match=if_none_match)
        version = manifest_version(key[len(self.prefix):])
        if version is not None:
            self.manifests[version] = time.time()


def prefix_table(name: str, options: dict[str, Any]) -> str:
    o = options
    return (f'[{name}]\nuri = "{URI}"\nendpoint_url = "{o["endpoint_url"]}"\nregion = "{o["region"]}"\n'
            f'access_key_id = "{o["access_key_id"]}"\nsecret_access_key = "{o["secret_access_key"]}"\n')


def private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def relay_events(log: Path, version: int) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            e = json.loads(line)
            if e.get("event") == "version_committed" and e.get("version") == version:
                out.append(e)
    return out


async def wait_for_line(log: Path, needle: str, timeout: float = 60) -> None:
    with anyio.fail_after(timeout):
        while not log.exists() or needle not in log.read_text():
            await anyio.sleep(0.05)


class Sub:
    """A child process that speaks JSON lines: a subscriber, or a link."""

    def __init__(self, region: str, proc: Any) -> None:
        self.region, self.proc, self.url = region, proc, ""
        self.out = BufferedByteReceiveStream(proc.stdout)

    async def next(self, event: str) -> dict[str, Any]:
        while True:
            line = json.loads(await self.out.receive_until(b"\n", 1 << 20))
            if line["event"] == event:
                return line

    async def ask(self, command: str, event: str) -> dict[str, Any]:
        await self.proc.stdin.send(command.encode() + b"\n")
        return await self.next(event)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int, metric: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
    raise KeyError(metric)


async def phase(name: str, pub: Publisher, store: TimedStore, model: dict, subs: list[Sub], log: Path,
                links: dict[str, Sub], pids: dict[str, int], port: int) -> dict[str, Any]:
    for link in links.values():
        await link.ask("reset", "reset")
    ahead = await anyio.to_thread.run_sync(scrape, port, "zephon_relay_objects_ahead_total")
    def cpu_now() -> dict[str, float]:
        return {"publisher": time.process_time(), **{k: cpu_seconds(pid) for k, pid in pids.items()}}

    cpu = cpu_now()
    t0 = time.time()
    info = await pub.publish(model)
    t_pub = time.time()
    applied = {s.region: await s.next("applied") for s in subs}
    for s in subs:
        assert applied[s.region]["version"] == info.version, applied
        assert applied[s.region]["model_digest"] == info.model_digest, "subscriber digest differs"
    with anyio.fail_after(10):
        while len(events := relay_events(log, info.version)) < len(subs):
            await anyio.sleep(0.01)
    by_child = {s.region: next(e for e in events if e["child"].endswith("@" + links[s.region].url[7:]))
                for s in subs}
    now = cpu_now()
    ahead = await anyio.to_thread.run_sync(scrape, port, "zephon_relay_objects_ahead_total") - ahead
    objects = [o for o in await store.list(version_prefix(pub.key_prefix, info.version))
               if manifest_version(o.key[len(pub.key_prefix):]) is None]
    r: dict[str, Any] = {"name": name, "version": info.version, "t0": t0, "publish_end": t_pub,
                         "cpu": {k: now[k] - v for k, v in cpu.items()}, "ahead": (int(ahead), len(objects)),
                         "manifest": store.manifests[info.version], "bytes": info.delta_bytes + info.key_bytes,
                         "keyframe": info.keyframe, "regions": {}}
    for region, e in by_child.items():
        committed = e["ts"]
        ready = committed - e["commit_s"]
        seen = ready - e["copy_s"]
        a = applied[region]
        r["regions"][region] = {"seen": seen, "ready": ready, "visible": ready + e["manifest_s"],
                                "committed": committed, "detect": a["detect"], "done": a["done"],
                                "link_bytes": (await links[region].ask("stats", "stats"))["bytes_up"]}
    r["end"] = max(g["done"] for g in r["regions"].values()) - t0
    return r


def segments(p: dict[str, Any], region: str) -> list[tuple[str, float]]:
    g = p["regions"][region]
    return [("encode + upload at the trainer (until its MANIFEST)", p["manifest"] - p["t0"]),
            ("relay sees the MANIFEST (poll; ahead copies finish)", g["seen"] - p["manifest"]),
            ("relay copies what is left over the link", g["ready"] - g["seen"]),
            ("relay commit (MANIFEST put over the link)", g["visible"] - g["ready"]),
            ("subscriber poll wait (from the MANIFEST)", g["detect"] - g["visible"]),
            ("subscriber fetch + verify + apply", g["done"] - g["detect"]),
            ("end to end (publish -> applied)", g["done"] - p["t0"])]


def spread(xs: list[float], fmt: str = "{:.3f}") -> str:
    """median (min - max)"""
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))} - {fmt.format(max(xs))})"


def report(full: dict[str, Any], deltas: list[dict[str, Any]], model_bytes: int) -> None:
    regions = sorted(full["regions"])
    n = len(deltas)
    print(f"\n{'seconds':<52}" + "".join(f"{'full ' + r:>14}" for r in regions)
          + "".join(f"{f'delta {r}, median (min - max) of {n}':>36}" for r in regions))
    for i, (label, _) in enumerate(segments(full, regions[0])):
        row = "".join(f"{segments(full, r)[i][1]:>14.3f}" for r in regions)
        row += "".join(f"{spread([segments(d, r)[i][1] for d in deltas]):>36}" for r in regions)
        print(f"{label:<52}{row}")
    for p in (full, deltas[len(deltas) // 2]):
        print(f"CPU seconds during {p['name']}: " + ", ".join(f"{k} {v:.2f}" for k, v in p["cpu"].items()))
    print(f"{'bytes up each region link (bodies + headers)':<52}"
          + "".join(f"{full['regions'][r]['link_bytes']:>14,}" for r in regions)
          + "".join(f"{spread([d['regions'][r]['link_bytes'] for d in deltas], '{:,.0f}'):>36}" for r in regions))
    print("objects the relay copied ahead (while the trainer was still publishing): full "
          f"{full['ahead'][0]} of {full['ahead'][1]}, deltas " + ", ".join(f"{d['ahead'][0]}/{d['ahead'][1]}"
                                                                       for d in deltas))
    ends = [d["end"] for d in deltas]
    ratios = [full["end"] / e for e in ends]
    print(f"\nmodel {model_bytes:,} B; full checkpoint (keyframe) {full['bytes']:,} B "
          f"({model_bytes / full['bytes']:.2f}x compressed); delta {spread([d['bytes'] for d in deltas], '{:,.0f}')} B "
          f"({model_bytes / statistics.median(d['bytes'] for d in deltas):.1f}x smaller than the model)")
    print(f"publish -> both regions applied: full checkpoint {full['end']:.2f} s; delta {spread(ends)} s over {n} "
          f"versions ({', '.join(f'{e:.3f}' for e in ends)})")
    print(f"delta is {statistics.median(ratios):.1f}x faster than the full checkpoint (median; "
          f"{min(ratios):.1f} - {max(ratios):.1f}x) (goal >= 40x)")
    print(f"publish() call wall time (adds LATEST + GC after the MANIFEST): full "
          f"{full['publish_end'] - full['t0']:.3f} s, delta {spread([d['publish_end'] - d['t0'] for d in deltas])} s")


async def alone(args: argparse.Namespace, model: dict[str, torch.Tensor]) -> None:
    """The same encode and apply with nothing else running, on a memory store: the CPU floor."""
    store = MemoryStore()
    replica = {k: torch.zeros_like(v) for k, v in model.items()}
    async with Publisher("m/", store=store, chunk_bytes=args.chunk_bytes, keyframe_every=1000, workers=4,
                         threads=2) as pub:
        await pub.publish(model)
        sub = Subscriber("m/", store=store, workers=4, threads=1)
        await sub.pull(replica)
        adam_step(model, seed=3)
        t = time.perf_counter()
        await pub.publish(model)
        encode = time.perf_counter() - t
        t = time.perf_counter()
        await sub.pull(replica)
        apply = time.perf_counter() - t
    print(f"the same delta step alone (memory store, nothing else running): encode {encode:.3f} s with 2 threads, "
          f"fetch + verify + apply {apply:.3f} s with 1 thread")


async def tree(args: argparse.Namespace, work: Path, stack: ExitStack) -> None:
    servers = {r: stack.enter_context(SeaweedServer()) for r in ("trainer", "A", "B")}
    for s in servers.values():
        s.create_bucket("weights")
    links: dict[str, Sub] = {}
    for r in ("A", "B"):
        lp = await anyio.open_process([sys.executable, __file__, "--role", "link", "--upstream",
                                       servers[r].endpoint_url, "--mbit", str(args.mbit), "--latency-ms",
                                       str(args.latency_ms)], stderr=None)
        links[r] = Sub(r, lp)
        links[r].url = (await links[r].next("ready"))["url"]
    opts = {r: s.store_options() for r, s in servers.items()}
    config = private(work / "relay.toml", prefix_table("from", opts["trainer"]) + "".join(
        prefix_table("[to]", {**opts[r], "endpoint_url": links[r].url}) for r in ("A", "B")))
    log = work / "relay.log"
    relay = stack.enter_context(open(log, "wb"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "zephon_stream.cli", "relay", "--config", str(config), "--metrics-port", str(port),
           "--workers",
           str(args.relay_workers), "--poll-interval", str(args.poll),
           *(["--stream-ahead"] if args.stream_ahead else [])]
    proc = subprocess.Popen(cmd, stdout=relay, stderr=relay)
    subs = []
    try:
        for r in ("A", "B"):
            cfg = private(work / f"sub-{r}.json", json.dumps({"uri": URI, "options": opts[r]}))
            sp = await anyio.open_process([sys.executable, __file__, "--role", "subscriber", "--config", str(cfg),
                                           "--params", str(args.params), "--tensors", str(args.tensors),
                                           "--versions", str(1 + args.deltas), "--poll", str(args.sub_poll),
                                           *([] if args.prefetch else ["--no-prefetch"])], stderr=None)
            subs.append(Sub(r, sp))
        t = time.perf_counter()
        model = make_model(args.params, args.tensors, seed=1)
        nbytes = sum(v.numel() * 2 for v in model.values())
        print(f"model: {nbytes // 2:,} bf16 params ({nbytes / 1e9:.2f} GB) in {len(model)} tensors, made in "
              f"{time.perf_counter() - t:.1f} s; links {args.mbit:g} Mbit/s + {args.latency_ms:g} ms per request")
        for s in subs:
            await s.next("ready")
        pids = {"relay": proc.pid, **{f"subscriber {s.region}": s.proc.pid for s in subs},
                **{f"link {r}": k.proc.pid for r, k in links.items()},
                **{f"weed {r}": w._proc.pid for r, w in servers.items() if w._proc is not None}}
        await wait_for_line(log, '"event": "started"')
        pstore, pkey = open_store(URI, **opts["trainer"])
        timed = TimedStore(pstore, pkey)
        async with pstore, Publisher(pkey, store=timed, chunk_bytes=args.chunk_bytes, keyframe_every=1000,
                                     workers=4, threads=2) as pub:
            full = await phase("full", pub, timed, model, subs, log, links, pids, port)
            deltas = []
            for k in range(args.deltas):
                adam_step(model, seed=2 + k)
                deltas.append(await phase("delta", pub, timed, model, subs, log, links, pids, port))
        want = digest(model)
        for s in subs:
            got = (await s.next("final"))["digest"]
            print(f"subscriber {s.region}: blake2b {got} {'== trainer (bit-exact)' if got == want else '!= trainer'}")
            await s.proc.wait()
        report(full, deltas, nbytes)
        await alone(args, model)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for s in [*subs, *links.values()]:
            if s.proc.returncode is None:
                s.proc.kill()
                await s.proc.wait()
    print(f"relay daemon: exit {proc.returncode} after SIGTERM")


async def high_water(proc: subprocess.Popen[bytes]) -> int:
    """The process's peak RSS in KiB: VmHWM, polled until it exits. (wait4's ru_maxrss would not
    do: Linux carries the spawning process's high-water mark, a model-sized one here, across exec.)"""
    peak = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak = max(peak, int(status.split("VmHWM:")[1].split()[0]))
        except (OSError, IndexError):
            pass  # exiting
        await anyio.sleep(0.02)
    return peak


async def rss(args: argparse.Namespace, work: Path) -> None:
    print(f"\nrelay node peak RSS (zephon relay --once, chunks of {args.rss_chunk_bytes >> 20} MiB, no links):")
    rows = [("nothing to copy", 0)] + [(f"{gb:g} GB model", int(gb * (1 << 30)) // 2) for gb in args.rss_gb]
    for label, params in rows:
        with ExitStack() as stack:
            parent = stack.enter_context(SeaweedServer())
            parent.create_bucket("weights")
            moved = 0
            if params:
                block = make_model(BLOCK * 16, 1, seed=3)["layer000.weight"].view(-1)  # 256M params, reused
                model = {name: block[: s[0] * s[1]].view(s) for name, s in shapes(params, 8).items()}
                store, key = open_store(URI, **parent.store_options())
                async with store, Publisher(key, store=store, chunk_bytes=args.rss_chunk_bytes, workers=4,
                                            threads=2) as pub:
                    info = await pub.publish(model)
                moved = info.key_bytes
                del model, block
            for workers in args.rss_workers:
                with SeaweedServer() as child:  # a fresh one each time: a server holds 4 GB at most
                    child.create_bucket("weights")
                    config = private(work / "rss.toml", prefix_table("from", parent.store_options())
                                     + prefix_table("[to]", child.store_options()))
                    t = time.perf_counter()
                    proc = subprocess.Popen([sys.executable, "-m", "zephon_stream.cli", "relay", "--config",
                                             str(config), "--once", "--workers", str(workers)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    peak = await high_water(proc)
                    secs = time.perf_counter() - t
                print(f"  {label:<16} {workers:>3} workers: copied {moved:>14,} B in {secs:6.1f} s, peak RSS "
                      f"{peak / 1024:7.1f} MiB (exit {proc.returncode})")


def startup(source: Path, runs: int = 5) -> None:
    """`zephon relay --help` wall time and the RSS (the child's ru_maxrss: the small `python -c`
    that spawns it holds far less) of an idle `zephon relay --once` over an empty file:// parent,
    for the source tree `source` (another checkout measures "before")."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    cli = [sys.executable, "-m", "zephon_stream.cli", "relay"]
    spawn = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    with tempfile.TemporaryDirectory(prefix="zephon-bench-startup-") as tmp:
        (Path(tmp) / "parent").mkdir()
        once = [*cli, "--from", f"file://{tmp}/parent/", "--to", f"file://{tmp}/child/", "--once"]
        subprocess.run([*cli, "--help"], cwd=source, env=env, check=True, capture_output=True)  # warm the caches
        walls = []
        for _ in range(runs):
            t = time.perf_counter()
            subprocess.run([*cli, "--help"], cwd=source, env=env, check=True, capture_output=True)
            walls.append(time.perf_counter() - t)
        rss = [int(subprocess.run([sys.executable, "-c", spawn, *once], cwd=source, env=env, check=True,
                                  capture_output=True, text=True).stdout) / 1024 for _ in range(runs)]
    for what, xs, unit in (("zephon relay --help", walls, "s"), ("idle zephon relay --once RSS", rss, "MiB")):
        print(f"{what}: median {statistics.median(xs):.3f} {unit} ({min(xs):.3f} - {max(xs):.3f}) over {runs} runs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "subscriber", "link", "startup"], default="bench")
    ap.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1],
                    help="--role startup: the source tree to measure (default: this one)")
    ap.add_argument("--deltas", type=int, default=5, help="delta versions to time (median and spread)")
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--params", type=int, default=1 << 28)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--chunk-bytes", type=int, default=64 << 20,
                    help="the publisher's chunk size: each chunk is one object per hop, and on 2 shared cores "
                         "the S3 requests' CPU matters (16 MiB: 4x the objects)")
    ap.add_argument("--rss-chunk-bytes", type=int, default=16 << 20, help="the chunk size of the RSS runs")
    ap.add_argument("--mbit", type=float, default=100.0, help="bandwidth of each region's link")
    ap.add_argument("--latency-ms", type=float, default=30.0, help="delay the link adds to every request")
    ap.add_argument("--relay-workers", type=int, default=32)
    ap.add_argument("--poll", type=float, default=0.01, help="the relay's poll interval")
    ap.add_argument("--sub-poll", type=float, default=0.025,
                    help="each subscriber's poll interval (a HEAD each: many subscribers share a region's store)")
    ap.add_argument("--no-stream-ahead", dest="stream_ahead", action="store_false",
                    help="the relay waits for each MANIFEST before it copies anything")
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                    help="subscribers do not verify objects ahead of the MANIFEST (Subscriber.prefetch)")
    ap.add_argument("--rss-gb", type=float, nargs="*", default=[1, 4], help="model sizes of the RSS runs")
    ap.add_argument("--rss-workers", type=int, nargs="+", default=[8, 32], help="relay workers of the RSS runs")
    ap.add_argument("--skip-tree", action="store_true", help="only the RSS runs")
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--versions", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.role == "subscriber":
        anyio.run(subscribe, args)
        return 0
    if args.role == "link":
        serve_link(args)
        return 0
    if args.role == "startup":
        startup(args.source)
        return 0
    if not args.skip_tree:
        with tempfile.TemporaryDirectory(prefix="zephon-bench-relay-") as tmp, ExitStack() as stack:
            anyio.run(tree, args, Path(tmp), stack)
    if args.rss_gb:
        with tempfile.TemporaryDirectory(prefix="zephon-bench-rss-") as tmp:
            anyio.run(rss, args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
