"""S3 read benchmark: raw aiobotocore against the S3Store connector, on the same objects.

Starts SeaweedFS (`weed mini`) on loopback, uploads N objects of real, compressible text (this
Python's stdlib sources), then times, in alternating order so drift hits both alike:

  sequential   whole-object GETs, one object after another
               raw: get_object + Body.read()        connector: store.read(key)
  parallel     each object as ranged GETs of --part-mib, --concurrency in flight
               raw: gather under a semaphore         connector: open_read's sliding window
               (both know the size, as a reader that listed the objects does)

and prints MB/s (median, min-max over --repeats), the client's CPU seconds per GB (this
process only, so less sensitive to other load than wall time) and the connector/raw ratio.
Both sides use the same client settings (path-style, checksums only when required, a
connection pool as large as the concurrency).

Then it uploads the real-text shards of bench/loader.py (about 50 MB of documentation, as
multi-frame JSONL.zst) and runs one loader epoch from SeaweedFS and one from the local disk,
alternating, and prints tokens/s of each and the S3/local ratio.

    .venv/bin/python bench/s3.py [--objects 16] [--size-mib 16] [--repeats 5] [--loader-repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sysconfig
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from zephon_stream.connectors.s3 import MiB, S3Store
from zephon_stream.testing.seaweed import SeaweedServer

BUCKET = "zephon-bench"


def text_bytes(n: int, seed: int) -> bytes:
    """`n` bytes of stdlib source text, starting at a file chosen by `seed`."""
    files = _stdlib_files()
    out, size, i = [], 0, seed * 131
    while size < n:
        data = files[i % len(files)].read_bytes()
        out.append(data)
        size += len(data)
        i += 1
    return b"".join(out)[:n]


@functools.cache
def _stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_path("stdlib")).rglob("*.py"))


def raw_client(server: SeaweedServer, concurrency: int):
    opts = server.store_options()
    config = AioConfig(s3={"addressing_style": "path"}, max_pool_connections=max(10, concurrency),
                       retries={"mode": "standard"}, response_checksum_validation="when_required")
    return AioSession().create_client("s3", endpoint_url=opts["endpoint_url"], region_name=opts["region"],
                                      aws_access_key_id=opts["access_key_id"],
                                      aws_secret_access_key=opts["secret_access_key"], config=config)


async def raw_sequential(client, keys: list[str], size: int, part: int, conc: int) -> int:
    total = 0
    for key in keys:
        resp = await client.get_object(Bucket=BUCKET, Key=key)
        async with resp["Body"] as body:
            total += len(await body.read())
    return total


async def raw_parallel(client, keys: list[str], size: int, part: int, conc: int) -> int:
    sem = asyncio.Semaphore(conc)

    async def get(key: str, lo: int) -> bytes:
        async with sem:
            span = f"bytes={lo}-{min(lo + part, size) - 1}"
            resp = await client.get_object(Bucket=BUCKET, Key=key, Range=span)
            async with resp["Body"] as body:
                return await body.read()

    total = 0
    for key in keys:
        parts = await asyncio.gather(*(get(key, lo) for lo in range(0, size, part)))
        total += len(b"".join(parts))
    return total


async def store_sequential(store: S3Store, keys: list[str], size: int, part: int, conc: int) -> int:
    total = 0
    for key in keys:
        total += len(await store.read(key))
    return total


async def store_parallel(store: S3Store, keys: list[str], size: int, part: int, conc: int) -> int:
    total = 0
    for key in keys:
        async with store.open_read(key, 0, size, part_size=part, read_ahead=conc) as parts:
            total += len(b"".join([p async for p in parts]))
    return total


async def timed(fn: Callable[..., Awaitable[int]], *args: object) -> tuple[float, float]:
    """(MB/s of wall time, client CPU seconds per GB): the second is robust to a busy machine."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = await fn(*args)
    return n / (time.perf_counter() - t0) / 1e6, (time.process_time() - c0) / n * 1e9


def summary(runs: list[tuple[float, float]]) -> str:
    rates = [r for r, _ in runs]
    cpu = statistics.median(c for _, c in runs)
    spread = f"({min(rates):.1f}-{max(rates):.1f})"
    return f"{statistics.median(rates):8.1f} MB/s  {spread:13}  client CPU {cpu:.2f} s/GB"


async def run(server: SeaweedServer, args: argparse.Namespace) -> None:
    size, part = args.size_mib * MiB, args.part_mib * MiB
    keys = [f"obj-{i:03d}" for i in range(args.objects)]
    store = S3Store(BUCKET, **server.store_options(), max_in_flight=max(64, args.concurrency),
                    multipart_threshold=64 * MiB)
    async with store, raw_client(server, args.concurrency) as client:
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            await store.put(key, text_bytes(size, seed=i))
        took = time.perf_counter() - t0
        print(f"uploaded {args.objects} x {args.size_mib} MiB of stdlib text in {took:.1f}s")
        assert await store.read(keys[0]) == text_bytes(size, seed=0)
        pairs = {"sequential": (raw_sequential, store_sequential), "parallel": (raw_parallel, store_parallel)}
        for mode, (raw_fn, store_fn) in pairs.items():
            raw, ours = [], []
            common = (keys, size, part, args.concurrency)
            await timed(raw_fn, client, *common)  # warm connections on both sides
            await timed(store_fn, store, *common)
            for r in range(args.repeats):
                order = [(raw, raw_fn, client), (ours, store_fn, store)]
                for out, fn, target in order if r % 2 == 0 else order[::-1]:
                    out.append(await timed(fn, target, *common))
            label = f"{mode} ({args.part_mib} MiB parts x {args.concurrency})" if mode == "parallel" else mode
            print(f"{label}")
            print(f"  raw aiobotocore  {summary(raw)}")
            print(f"  S3Store          {summary(ours)}")
            ratio = statistics.median(r for r, _ in ours) / statistics.median(r for r, _ in raw)
            print(f"  connector / raw  {ratio:.2f} (MB/s medians)")
        print(f"connector statistics: {store.statistics()}")


def loader_compare(server: SeaweedServer, args: argparse.Namespace) -> None:
    """Loader tokens/s for one epoch of the same real-text shards, from S3 and from the local disk."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from loader import loader_epoch, prepare

    from zephon_stream import Config, SourceConfig

    _, tok = prepare(args.data.resolve(), args.mb)
    shards = sorted((tok.parent / "text").glob("*.jsonl.zst"))
    client = server.client()
    for path in shards:
        client.put_object(Bucket=BUCKET, Key=f"text/{path.name}", Body=path.read_bytes())
    opts = server.store_options()
    os.environ["AWS_ACCESS_KEY_ID"] = opts["access_key_id"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = opts["secret_access_key"]
    local = Config(seed=1, lanes=12, seq_len=2048, global_batch_size=24, tokenizer=str(tok), max_epochs=1,
                   sources=[SourceConfig(name="text", uri=f"file://{tok.parent}/text/")])
    remote = local.replace(sources=[SourceConfig(name="text", uri=f"s3://{BUCKET}/text/",
                                                 endpoint_url=opts["endpoint_url"], region=opts["region"],
                                                 addressing_style="path")])
    runs: dict[str, list[float]] = {"local": [], "s3": []}
    for r in range(args.loader_repeats):
        order = [("local", local), ("s3", remote)]
        for name, cfg in order if r % 2 == 0 else order[::-1]:
            rate, tokens, first, _ = loader_epoch(cfg)
            runs[name].append(rate)
            print(f"  loader from {name:5}: {rate:,.0f} tok/s ({tokens:,} tokens, first batch after {first:.2f}s)")
    med = {k: statistics.median(v) for k, v in runs.items()}
    for name, rates in runs.items():
        print(f"loader from {name:5}  median {med[name]:,.0f} tok/s  (min {min(rates):,.0f}, max {max(rates):,.0f})")
    print(f"loader S3 / local: {med['s3'] / med['local']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=16)
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part-mib", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--mb", type=int, default=48, help="real text for the loader comparison")
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--loader-repeats", type=int, default=3)
    parser.add_argument("--skip-raw", action="store_true", help="only the loader comparison")
    args = parser.parse_args()
    with SeaweedServer() as server:
        server.create_bucket(BUCKET)
        if not args.skip_raw:
            anyio.run(run, server, args)
        loader_compare(server, args)


if __name__ == "__main__":
    main()
