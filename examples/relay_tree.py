"""A relay tree over three S3 "regions": a trainer publishes, two `zephon relay` daemons copy.

    trainer region (SeaweedFS) ──WAN link──> relay A ──> region A (SeaweedFS) <── subscriber A
                               └─WAN link──> relay B ──> region B (SeaweedFS) <── subscriber B

Each region is its own SeaweedFS server on 127.0.0.1 with its own credentials; each relay reads
the trainer's prefix through a loopback proxy that emulates a WAN link (a token bucket at
100 Mbit/s plus 20 ms of latency per request: `zephon_stream.testing.proxy.Link`). The trainer
publishes six versions of a small model (keyframes every 3, deltas between); the subscriber of
each region pulls from its regional prefix only and prints its model digest beside the trainer's.

    .venv/bin/python examples/relay_tree.py
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import anyio
import torch

from zephon_stream.connectors import open_store
from zephon_stream.refit import Publisher, Subscriber
from zephon_stream.testing.proxy import FaultProxy, Link
from zephon_stream.testing.seaweed import SeaweedServer

VERSIONS = 6
WAN = Link(bandwidth=100e6 / 8, latency_s=0.02)


def sha(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(state[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def relay_config(path: Path, parent: dict, child: dict) -> Path:
    def table(name: str, o: dict) -> str:
        return (f'[{name}]\nuri = "s3://weights/policy/"\nendpoint_url = "{o["endpoint_url"]}"\n'
                f'region = "us-east-1"\naccess_key_id = "{o["access_key_id"]}"\n'
                f'secret_access_key = "{o["secret_access_key"]}"\n')

    path.write_text("poll_interval = 0.05\n" + table("from", parent) + table("[to]", child))
    path.chmod(0o600)  # it holds two regions' credentials
    return path


async def run(regions: dict[str, dict], work: Path) -> None:
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)}
    replicas = {r: {k: torch.zeros_like(v) for k, v in model.items()} for r in ("A", "B")}
    pstore, pkey = open_store("s3://weights/policy/", **regions["trainer"])
    subs = {r: Subscriber(key, store=store) for r, (store, key) in
            ((r, open_store("s3://weights/policy/", **regions[r])) for r in ("A", "B"))}
    print(f"{'version':>7} {'kind':>8} {'bytes':>9}  {'trainer':>16}  {'region A':>16}  {'region B':>16}")
    async with pstore, Publisher(pkey, store=pstore, chunk_bytes=64 << 10, keyframe_every=3, keep_versions=3) as pub:
        for v in range(1, VERSIONS + 1):
            for t in model.values():  # an Adam-like step on 5% of the weights
                hit = torch.rand(t.shape, generator=g) < 0.05
                t.copy_(torch.where(hit, (t.float() + 1e-3 * torch.randn(t.shape, generator=g)).to(t.dtype), t))
            info = await pub.publish(model)
            with anyio.fail_after(60):
                for r, sub in subs.items():
                    while await sub.pull(replicas[r]) < v:  # the relays are still copying: poll the region
                        await anyio.sleep(0.02)
            digests = [sha(model), *(sha(replicas[r]) for r in subs)]
            kind = "keyframe" if info.keyframe else "delta"
            size = info.delta_bytes + info.key_bytes
            same = "bit-exact" if len(set(digests)) == 1 else "DIFFER"
            print(f"{v:>7} {kind:>8} {size:>9,}  {'  '.join(digests)}  {same}")
    for sub in subs.values():
        await sub.store.aclose()


def main() -> int:
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="zephon-relay-tree-") as tmp:
        work = Path(tmp)
        servers = {r: stack.enter_context(SeaweedServer()) for r in ("trainer", "A", "B")}
        for s in servers.values():
            s.create_bucket("weights")
        regions = {r: s.store_options() for r, s in servers.items()}
        relays = []
        for r in ("A", "B"):  # each region's relay reads the trainer across its own WAN link
            link = stack.enter_context(FaultProxy(servers["trainer"].endpoint_url, link=WAN))
            parent = {**regions["trainer"], "endpoint_url": link.url}
            config = relay_config(work / f"relay-{r}.toml", parent, regions[r])
            log = stack.enter_context(open(work / f"relay-{r}.log", "wb"))
            cmd = [sys.executable, "-m", "zephon_stream.cli", "relay", "--config", str(config)]
            relays.append((r, subprocess.Popen(cmd, stdout=log, stderr=log), link))
        print("trainer, region A, region B: three SeaweedFS servers; relays A and B running\n")
        try:
            anyio.run(run, regions, work)
        finally:
            for _, proc, _ in relays:
                proc.terminate()
                proc.wait(timeout=30)
        for r, proc, link in relays:
            st = link.statistics()
            print(f"relay {r}: exit {proc.returncode}, {st.body_bytes('GET'):,} bytes across its WAN link "
                  f"in {st.requests} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
