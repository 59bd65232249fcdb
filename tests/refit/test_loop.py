"""PublishLoop: publishing inside the trainer's event loop, next to the loader, without stalling it."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import torch

from tests.core.conftest import build_dataset
from tests.core.test_async import gc_pauses
from tests.refit._helpers import assert_same
from zephon_stream import ConfigError
from zephon_stream.connectors import MemoryStore
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.refit import Publisher, PublishLoop, Subscriber

PARAMS = 24 << 20  # bf16: 48 MiB, 12 chunks a version; bench/rl_loop.py measures 1B


def make_model(params: int, tensors: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = params // tensors
    return {f"layer{i}.weight": (torch.randn(per // 1024, 1024, generator=g) * 0.02).to(torch.bfloat16)
            for i in range(tensors)}


def train_step(model: dict[str, torch.Tensor], step: int) -> None:
    """A CPU step: every tensor nudged at 1% of its elements (the delta a publish then encodes)."""
    g = torch.Generator().manual_seed(step)
    for t in model.values():
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)
        flat[idx] = (flat[idx].float() + 1e-3).to(flat.dtype)


class Heartbeat:
    """A 2 ms heartbeat on the loop: per beat the wall gap and the loop thread's own CPU time.

    The wall gap counts everything that kept the loop from running: its own work, a thread
    holding the GIL, and the OS not scheduling it (other load on a shared machine). The CPU
    time counts only work done on the loop thread itself, whatever the machine's load."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.cpu: list[float] = []

    async def run(self, stop: anyio.Event) -> None:
        last, cpu = time.perf_counter(), time.thread_time()
        while not stop.is_set():
            await anyio.sleep(0.002)
            now, now_cpu = time.perf_counter(), time.thread_time()
            self.gaps.append(now - last)
            self.cpu.append(now_cpu - cpu)
            last, cpu = now, now_cpu


def idle_heartbeat(seconds: float) -> float:
    """The worst gap of a heartbeat on an idle loop: what this machine's load alone costs."""
    beat = Heartbeat()

    async def main() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(beat.run, stop)
            await anyio.sleep(seconds)
            stop.set()

    anyio.run(main)
    return max(beat.gaps)


def train_and_publish(tmp_path: Path, beat: Heartbeat) -> tuple[MemoryStore, int, dict[str, torch.Tensor]]:
    """The loader's `async for`, a training step in a thread and a PublishLoop, on one loop."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    build_dataset(tmp_path)
    cfg = Config(seed=1, lanes=4, seq_len=128, global_batch_size=8, tokenizer=str(tmp_path / "tokenizer.json"),
                 shuffle_window=8, split_bytes=4096, tokenize_batch=16,
                 sources=[SourceConfig(name="a", uri=f"file://{tmp_path}/a/", weight=0.6),
                          SourceConfig(name="b", uri=f"file://{tmp_path}/b/", weight=0.4)])
    model = make_model(PARAMS)
    store = MemoryStore()

    async def main() -> tuple[int, dict[str, torch.Tensor]]:
        stop = anyio.Event()
        pub = Publisher("p/", store=store, keyframe_every=2, workers=2)
        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                async with Loader(cfg, backend="threads").open() as stream, PublishLoop(pub) as publishing:
                    steps = 0
                    async for batch in stream:
                        assert batch["input_ids"].shape == (8, 128)
                        await anyio.to_thread.run_sync(train_step, model, steps)
                        steps += 1
                        if steps == 1:  # from the first step on: the loader's start-up is test_async's business
                            tg.start_soon(beat.run, stop)
                        if steps % 2 == 0:
                            await publishing.submit(model)
                            if publishing.statistics().published >= 3:
                                break
                    last = await publishing.drain()
                stop.set()
        return last.version, {k: v.clone() for k, v in publishing.snapshot.items()}

    with gc_pauses():
        version, snapshot = anyio.run(main)
    return store, version, snapshot


def test_publishing_does_no_work_on_the_trainer_loop(tmp_path) -> None:
    """Copy, XOR, zstd and hashing all run in threads: the loop thread's own CPU time per 2 ms
    beat stays far under 50 ms. This holds however loaded the machine is."""
    beat = Heartbeat()
    store, version, snapshot = train_and_publish(tmp_path, beat)
    assert version >= 4  # a keyframe, deltas, and a keyframe again
    assert len(beat.cpu) > 50
    worst = max(beat.cpu)
    assert worst < 0.050, f"the loop thread itself ran {worst * 1000:.1f} ms without yielding while publishing"
    replica = {k: torch.zeros_like(v) for k, v in snapshot.items()}
    assert anyio.run(Subscriber("p/", store=store).pull, replica) == version
    assert_same(snapshot, replica)  # the last version is the snapshot submitted, not the model as it went on


def test_publishing_never_blocks_the_trainer_loop_over_50ms(tmp_path) -> None:
    """The wall-clock bound, as tests/core/test_async.py measures it for the loader: it also
    catches a worker thread holding the GIL. Other load on a shared machine stalls a loop too,
    in bursts, so a run counts only after an idle loop kept its heartbeat within 25 ms just
    before it, and the bound must hold in one of three such runs (a stall that publishing
    causes shows in all of them; bench/rl_loop.py reports the lag of every run beside its control)."""
    tried = []
    for attempt in range(3):
        control = idle_heartbeat(0.5)
        if control >= 0.025:
            tried.append(f"run {attempt}: skipped, an idle loop missed its beat by {control * 1000:.0f} ms")
            continue
        beat = Heartbeat()
        train_and_publish(tmp_path / str(attempt), beat)
        worst = max(beat.gaps)
        if worst < 0.050:
            return
        tried.append(f"run {attempt}: loop blocked {worst * 1000:.1f} ms at heartbeat {beat.gaps.index(worst)} of "
                     f"{len(beat.gaps)} (idle control {control * 1000:.1f} ms)")
    if all("skipped" in t for t in tried):
        pytest.skip("the machine's load alone stalls an idle loop over 25 ms: " + "; ".join(tried))
    pytest.fail("publishing blocked the trainer's loop: " + "; ".join(tried))


def test_submit_snapshots_so_the_trainer_may_step_at_once() -> None:
    """Each version published is the state at its submit, though training changes it during the publish."""
    model = make_model(1 << 16, tensors=2)
    store = MemoryStore()

    async def digest_of(state: dict[str, torch.Tensor]) -> int:
        return (await Publisher("q/", store=MemoryStore()).publish(state)).model_digest

    async def main() -> None:
        seen, digests = [], []
        async with PublishLoop(Publisher("p/", store=store, chunk_bytes=4096),
                               on_published=lambda info, at: digests.append(info.model_digest)) as publishing:
            for step in range(4):
                await publishing.submit(model)
                seen.append({k: v.clone() for k, v in model.items()})
                train_step(model, step)  # at once, while the publish runs
        assert digests == [await digest_of(s) for s in seen]
        assert len(set(digests)) == 4
        replica = {k: torch.zeros_like(v) for k, v in model.items()}
        assert await Subscriber("p/", store=store).pull(replica) == 4
        assert_same(seen[-1], replica)

    anyio.run(main)


def test_a_failed_publish_ends_the_loop_with_its_error() -> None:
    class Broken(MemoryStore):
        async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
            raise OSError(f"disk full writing {key}")

    async def main() -> None:
        async with PublishLoop(Publisher("p/", store=Broken())) as publishing:
            await publishing.submit(make_model(1 << 12, tensors=1))
            await anyio.sleep_forever()  # the trainer goes on until the publish fails

    with pytest.raises(OSError, match="disk full"):
        anyio.run(main)


def test_a_publisher_not_entered_is_opened_and_closed_by_the_loop(tmp_path: Path) -> None:
    """`PublishLoop(Publisher(uri))`, as the docstring writes it, failed in the background
    publish with 'Publisher is not open'; one the caller entered stays the caller's."""
    states = [make_model(1 << 14), make_model(1 << 14)]
    train_step(states[1], 1)
    prefix = f"file://{tmp_path}/p/"

    async def main() -> None:
        publisher = Publisher(prefix)
        async with PublishLoop(publisher) as publishing:
            await publishing.submit(states[0])
        assert not publisher.is_open  # the store it opened is closed
        async with publisher, PublishLoop(publisher) as publishing:
            await publishing.submit(states[1])
            assert (await publishing.drain()).version == 2
            assert publisher.is_open
        replica = {k: torch.zeros_like(v) for k, v in states[1].items()}
        async with Subscriber(prefix) as sub:
            assert await sub.pull(replica) == 2
        assert_same(states[1], replica)

    anyio.run(main)


def test_a_state_no_version_can_hold_is_refused_by_submit_itself(tmp_path: Path) -> None:
    """A tensor the codec cannot hold was found by the background publish, which then failed the
    trainer's task group at its next await; submit now refuses it, and the loop goes on."""
    good = make_model(1 << 14)

    async def main() -> None:
        async with PublishLoop(Publisher(f"file://{tmp_path}/p/")) as publishing:
            with pytest.raises(ConfigError, match="dtype 'complex64' is not supported by the refit codec"):
                await publishing.submit({**good, "rope": torch.zeros(4, dtype=torch.complex64)})
            await publishing.submit(good)
            assert (await publishing.drain()).version == 1

    anyio.run(main)
