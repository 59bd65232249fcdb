"""kill -9: the `zephon relay` daemon killed at random points across ten versions and restarted
each time. A watcher checks, all along, that no child ever shows a partial version and that a
subscriber of the child is bit-exact with the publisher whenever it reaches a version."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from tests.relay._helpers import (
    assert_no_partial_version,
    assert_same,
    committed,
    model,
    snapshot,
    step,
    until,
    zeros_like,
)
from zephon_stream import ConnectorError, RefitError
from zephon_stream.refit import Publisher, Subscriber
from zephon_stream.testing.proxy import Link

pytestmark = [pytest.mark.s3, pytest.mark.slow]

SHAPES = {"w": ((96, 128), torch.bfloat16), "n": ((128,), torch.float32)}


def write_config(path: Path, parent, child, prefix: str) -> Path:
    def table(name: str, region) -> str:
        o = region.options
        return (f'[{name}]\nuri = "{region.uri(prefix)}"\nendpoint_url = "{o["endpoint_url"]}"\n'
                f'region = "{o["region"]}"\naddressing_style = "path"\n'
                f'access_key_id = "{o["access_key_id"]}"\nsecret_access_key = "{o["secret_access_key"]}"\n')

    settings = "poll_interval = 0.02\nworkers = 4\nstream_ahead = true\n"  # kills land in copies ahead too
    path.write_text(settings + table("from", parent) + table("[to]", child))
    path.chmod(0o600)
    return path


def relay_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zephon_stream.cli", "relay", "--config", str(config), *extra]


def test_relay_killed_at_random_points(regions, tmp_path) -> None:
    trainer = regions("trainer", proxy=False)
    child = regions("child", link=Link(bandwidth=1 << 20, latency_s=0.002))  # slow enough to cut mid-version
    direct = child.options | {"endpoint_url": trainer.options["endpoint_url"]}  # the watcher's way in: uncounted
    config = write_config(tmp_path / "relay.toml", trainer, child, "p/")
    rng = random.Random(20240611)
    models: dict[int, dict[str, torch.Tensor]] = {}
    log = open(tmp_path / "relay.log", "ab")
    kills = []

    async def watch(stop: anyio.Event, seen: set[int]) -> None:
        from zephon_stream.connectors import open_store

        store, prefix = open_store(child.uri("p/"), **direct)
        replica = zeros_like(model(0, SHAPES))
        sub = Subscriber(prefix, store=store)
        async with store:
            while not stop.is_set():
                seen.update(await assert_no_partial_version(store, prefix))
                try:
                    v = await sub.pull(replica)
                except (RefitError, ConnectorError):  # a version collected mid-pull: pull again
                    continue
                if v:
                    assert_same(models[v], replica)
                await anyio.sleep(0.005)

    async def committed_at(store, prefix: str, v: int) -> bool:
        return v in await committed(store, prefix)

    async def main() -> None:
        from zephon_stream.connectors import open_store

        pstore, pkey = trainer.open("p/")
        cstore, ckey = open_store(child.uri("p/"), **direct)
        w = model(1, SHAPES)
        stop, seen = anyio.Event(), set()
        with anyio.fail_after(240):
            async with pstore, cstore, Publisher(pkey, store=pstore, chunk_bytes=1024, keyframe_every=4,
                                                 keep_versions=3) as pub, anyio.create_task_group() as tg:
                tg.start_soon(watch, stop, seen)
                proc = subprocess.Popen(relay_command(config), stdout=log, stderr=log)
                try:
                    for v in range(1, 11):
                        w = step(w, v, frac=0.3)
                        models[v] = snapshot(w)
                        assert (await pub.publish(w)).version == v
                        start = child.proxy.statistics(settle=0).requests
                        target = start + rng.randint(1, 50)
                        await until(lambda t=target, p=proc, v=v: _cut(child.proxy, t, p, cstore, ckey, v), timeout=60)
                        proc.kill()
                        proc.wait()
                        mid = v not in await committed(cstore, ckey)
                        kills.append((v, child.proxy.statistics(settle=0).requests - start, mid, proc.returncode))
                        proc = subprocess.Popen(relay_command(config), stdout=log, stderr=log)
                        await until(lambda v=v: committed_at(cstore, ckey, v), timeout=60)
                finally:
                    proc.terminate()
                    await anyio.to_thread.run_sync(proc.wait)
                done = await anyio.to_thread.run_sync(
                    lambda: subprocess.run(relay_command(config, "--once"), stdout=log, stderr=log, timeout=60))
                assert done.returncode == 0  # the GC of the publisher's last version, mirrored
                await until(lambda: committed_at(cstore, ckey, 10))
                stop.set()
                assert await committed(cstore, ckey) == await committed(pstore, pkey) == [8, 9, 10]
                replica = zeros_like(w)
                assert await Subscriber(ckey, store=cstore).pull(replica) == 10
                assert_same(models[10], replica)
        print("kills (version, child requests before the kill, mid-version, exit status):", kills)
        assert len(seen) >= 5, seen
        assert all(rc == -9 for *_, rc in kills), kills
        assert sum(mid for _, _, mid, _ in kills) >= 3, kills  # most cuts land inside a version

    try:
        anyio.run(main)
    finally:
        log.close()


async def _cut(proxy, target: int, proc: subprocess.Popen, store, prefix: str, v: int) -> bool:
    """Time to kill: the relay made `target` requests to the child, or it already has version v."""
    if proc.poll() is not None:
        raise AssertionError(f"relay exited by itself with {proc.returncode}")
    return proxy.statistics(settle=0).requests >= target or v in await committed(store, prefix)


def test_sigterm_stops_the_daemon_cleanly(regions, tmp_path) -> None:
    trainer, child = regions("trainer", proxy=False), regions("child")
    config = write_config(tmp_path / "relay.toml", trainer, child, "p/")

    async def main() -> None:
        pstore, pkey = trainer.open("p/")
        cstore, ckey = child.open("p/")
        async with pstore, cstore, Publisher(pkey, store=pstore, chunk_bytes=1024) as pub:
            await pub.publish(model(2, SHAPES))
            proc = subprocess.Popen(relay_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                await until(lambda: _in(cstore, ckey, 1), timeout=60)
                proc.send_signal(15)
                _, err = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=30))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0, err.decode()
        text = err.decode()
        assert '"event": "stopping", "signal": "SIGTERM"' in text and '"event": "stopped"' in text
        assert child.options["secret_access_key"] not in text

    anyio.run(main)


async def _in(store, prefix: str, v: int) -> bool:
    return v in await committed(store, prefix)

