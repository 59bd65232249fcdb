"""The Python API as a new user meets it: load_state_dict while streaming, close() (also from
another thread), torch's DataLoader, the state of a recent step for trainers that fetch ahead, the
processes backend from a script without a main guard, a script that exits with an iteration open,
its statistics, a second stream beside an open one, and Ctrl-C while a loop waits for a batch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch

from zephon_stream import CheckpointError, ConfigError, Loader, ZephonError
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import BatchStream
from zephon_stream.testing.determinism import batch_records

from .conftest import batches_to

REPO = Path(__file__).resolve().parents[2]


def _records(batches) -> list:
    return [r for b in batches for r in batch_records(b)]


def _run_script(tmp_path: Path, config: Config, body: str, timeout: int) -> subprocess.CompletedProcess:
    """`body` as a script `train.py`, run in a fresh interpreter with the path of `config`'s TOML."""
    toml, script = tmp_path / "c.toml", tmp_path / "train.py"
    toml.write_text(config.to_toml())
    script.write_text(body)
    return subprocess.run([sys.executable, str(script), str(toml)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_load_state_dict_while_a_loop_is_open_is_refused_at_the_call(config) -> None:
    loader = Loader(config, backend="inline")
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(CheckpointError, match=r"load_state_dict\(\) while a stream of this loader is open"):
        loader.load_state_dict(state)
    assert next(it)["step"] == 1  # the refused call changed nothing
    it.close()
    loader.load_state_dict(state)  # once the loop is left it works, and the stream continues from there
    assert next(iter(loader))["step"] == 1


def test_load_state_dict_inside_open_is_refused(config) -> None:
    async def main() -> None:
        loader = Loader(config, backend="inline")
        async with loader.open() as stream:
            await stream.__anext__()
            with pytest.raises(CheckpointError, match="leave it first"):
                loader.load_state_dict(loader.state_dict())

    anyio.run(main)


def test_close_stops_a_paused_loop_keeps_the_state_and_is_idempotent(config) -> None:
    loader = Loader(config, backend="threads")
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    loader.close()
    loader.close()
    with pytest.raises(StopIteration):
        next(it)
    assert loader.state_dict() == state and loader.step == 3
    with pytest.raises(ZephonError, match="this Loader is closed"):
        iter(loader)
    resumed = Loader(config, backend="threads")
    resumed.load_state_dict(loader.state_dict())
    with resumed:
        assert next(iter(resumed))["step"] == 3
    with pytest.raises(ZephonError, match="closed"):
        iter(resumed)


def test_close_ends_an_open_stream_at_its_next_batch(config) -> None:
    async def main() -> list[int]:
        loader = Loader(config, backend="inline")
        steps = []
        async with loader.open() as stream:
            async for batch in stream:
                steps.append(batch["step"])
                if batch["step"] == 1:
                    loader.close()
        return steps

    assert anyio.run(main) == [0, 1]


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_close_from_another_thread_while_the_loop_calls_next(config, backend, monkeypatch) -> None:
    """A watchdog thread closes the loader while the loop is paused, and the loop's `next` comes
    while that close is stopping the lanes: the loop ends (it raised "ValueError: generator already
    executing", 8 times in 30 random tries)."""
    loader = Loader(config, backend=backend)
    it = iter(loader)
    assert next(it)["step"] == 0
    stopping, calling = threading.Event(), threading.Event()
    forget = BatchStream.forget

    def slow_forget(stream: BatchStream) -> None:  # the close, halfway: the lanes are being stopped
        stopping.set()
        calling.wait(10)
        time.sleep(0.2)  # the loop's next is under way
        forget(stream)

    monkeypatch.setattr(BatchStream, "forget", slow_forget)
    closer = threading.Thread(target=loader.close)
    closer.start()
    assert stopping.wait(60)
    calling.set()
    with pytest.raises(StopIteration):
        next(it)
    closer.join()
    assert loader.step == 1 and not closer.is_alive()


def test_a_torch_dataloader_iterates_the_loader(config) -> None:
    from torch.utils.data import DataLoader, IterableDataset

    direct = _records(batches_to(Loader(config, backend="threads"), 5))
    loader = Loader(config, backend="threads")
    assert isinstance(loader, IterableDataset)
    via_torch = []
    for batch in DataLoader(loader, batch_size=None):
        via_torch.append(batch)
        if len(via_torch) == 3:
            break
    assert _records(via_torch) == direct[:3 * config.global_batch_size]
    state = loader.state_dict()  # num_workers=0 fetches nothing ahead: this is the state after batch 2
    resumed = Loader(config, backend="threads")
    resumed.load_state_dict(state)
    assert _records(batches_to(resumed, 5)) == direct[3 * config.global_batch_size:]


def test_torch_dataloader_workers_are_refused_with_what_to_do(config, monkeypatch) -> None:
    import torch.utils.data

    class Info:
        id, num_workers = 0, 2

    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: Info())
    with pytest.raises(ConfigError, match=r"num_workers=0.*backend = \"processes\""):
        iter(Loader(config, backend="inline"))


def test_the_state_of_a_recent_step_for_a_trainer_that_fetches_ahead(config) -> None:
    loader = Loader(config, backend="inline")
    saved = {}
    for _ in loader:
        saved[loader.step] = loader.state_dict()
        if loader.step == 20:
            break
    for step in range(5, 21):  # the last HISTORY (16) steps
        assert loader.state_dict(step=step) == saved[step], step
    with pytest.raises(CheckpointError, match=r"state_dict\(step=2\): this rank is at step 20 and remembers steps "
                                              r"5\.\.20 only"):
        loader.state_dict(step=2)
    resumed = Loader(config, backend="inline")
    resumed.load_state_dict(loader.state_dict(step=17))
    assert next(iter(resumed))["step"] == 17


def test_the_state_a_stream_started_from_is_kept_too(config) -> None:
    # a trainer that fetched its first batch ahead and saves before training on it asks for step 0:
    # it was refused ("remembers steps 1..1 only")
    loader = Loader(config, backend="inline")
    start = loader.state_dict()
    it = iter(loader)
    first = next(it)
    at_0 = loader.state_dict(step=0)
    assert {k: v for k, v in at_0.items() if k != "meta"} == {k: v for k, v in start.items() if k != "meta"}
    it.close()
    again = Loader(config, backend="inline")
    again.load_state_dict(at_0)  # its meta now names the data too
    assert torch.equal(next(iter(again))["input_ids"], first["input_ids"])
    resumed = Loader(config, backend="inline")
    resumed.load_state_dict(loader.state_dict(step=1))
    it = iter(resumed)
    next(it)  # the resumed stream's first step, 1, is kept as well
    assert resumed.state_dict(step=1) == loader.state_dict(step=1)
    it.close()


SCRIPT = """
import sys
from zephon_stream import Config, Loader

loader = Loader(Config.from_toml(sys.argv[1]), backend="processes")
for batch in loader:
    break
print("streamed step", batch["step"])
"""


# Hold each worker's exit a moment after it is seen, so both workers' exits are seen before either
# raises: both raise the same ConfigError, which the user must still read once, as the last line
BOTH_EXITS_SEEN = """
import anyio
from zephon_stream.loader import backends

_run_sync = backends.threads.run_sync

async def _slow_join(fn, *args, **kw):
    out = await _run_sync(fn, *args, **kw)
    if getattr(fn, "__name__", "") == "join":
        await anyio.sleep(0.3)
    return out

backends.threads.run_sync = _slow_join
"""


ASYNC_SCRIPT = """
import sys
import anyio
from zephon_stream import Config, Loader

async def main():
    async with Loader(Config.from_toml(sys.argv[1]), backend="processes").open() as stream:
        async for batch in stream:
            break
    print("streamed step", batch["step"])

anyio.run(main)
"""


@pytest.mark.parametrize("guarded, race, script", [(False, False, SCRIPT), (True, False, SCRIPT),
                                                   (False, True, SCRIPT), (False, False, ASYNC_SCRIPT)],
                         ids=["no-main-guard", "main-guard", "no-main-guard-both-exits-seen", "no-main-guard-open"])
def test_processes_backend_from_a_script(config, tmp_path, guarded, race, script) -> None:
    # with `open()` the consumer, waiting on a lane's stream, found it closed under it when the
    # workers failed: its ClosedResourceError came after the message, as a note (see `errors.root_error`)
    body = (BOTH_EXITS_SEEN if race else "") + script
    if guarded:
        body = 'if __name__ == "__main__":\n' + "".join(f"    {line}\n" for line in script.strip().splitlines())
    proc = _run_script(tmp_path, config.replace(workers=2), body, timeout=240)
    if guarded:
        assert proc.returncode == 0 and proc.stdout == "streamed step 0\n", proc.stderr
        return
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("zephon_stream.errors.ConfigError: backend \"processes\" runs its lanes in worker "
                           f"processes, and each worker imports {tmp_path / 'train.py'} again"), proc.stderr
    assert 'Put that code under `if __name__ == "__main__":`' in last
    assert "bootstrapping phase" not in proc.stderr and proc.stderr.count("Traceback") == 1, proc.stderr


TORCH_SCRIPT = """
import os
import sys

had_torch = "torch" in sys.modules  # in a worker: whether the fork server gave it torch already
import torch  # noqa: E402  (a trainer's script imports it at its top)

from zephon_stream import Config, Loader  # noqa: E402

if __name__ == "__main__":
    for batch in Loader(Config.from_toml(sys.argv[1]), backend="processes"):
        break
    print("streamed step", batch["step"])
else:  # a worker importing this script again
    with open(f"worker-{os.getpid()}", "w") as out:
        out.write(str(had_torch))
"""


def test_processes_workers_do_not_import_torch_again(config, tmp_path) -> None:
    # each worker imports the trainer's script again: its `import torch` cost every worker about a
    # CPU-second at every stream's start, now done once in the fork server
    proc = _run_script(tmp_path, config.replace(workers=2), TORCH_SCRIPT, timeout=240)
    assert proc.returncode == 0 and proc.stdout == "streamed step 0\n", proc.stderr
    seen = [p.read_text() for p in tmp_path.glob("worker-*")]
    assert seen == ["True", "True"], seen


def test_a_second_stream_beside_an_open_one_is_refused(config) -> None:
    """Two streams of one Loader would each continue from the last batch handed out, and their lanes
    disagreed (an internal error at the older one's next batch): the second is refused."""
    loader = Loader(config, backend="inline")
    first = iter(loader)
    assert next(first)["step"] == 0
    with pytest.raises(ZephonError, match=r"this Loader has a stream open already .* close the iterator"):
        next(iter(loader))

    async def open_beside() -> None:
        with pytest.raises(ZephonError, match="has a stream open already"):
            async with loader.open():
                pass

    anyio.run(open_beside)
    assert next(first)["step"] == 1  # the open one goes on as if nothing happened
    first.close()
    assert next(iter(loader))["step"] == 2  # once closed, a new stream continues after it


KEPT_ITERATION = """
import sys
from zephon_stream import Config, Loader

if __name__ == "__main__":
    batches = iter(Loader(Config.from_toml(sys.argv[1])))  # a global, closed only at exit
    print("streamed step", next(batches)["step"])
"""


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_script_that_keeps_its_iteration_in_a_global_exits(config, tmp_path, backend) -> None:
    """`batches = iter(loader)` in a script's globals, to feed a training loop `next(batches)`: the
    process ends with the script (it hung at exit on both backends before `_close_open_iterations`)."""
    proc = _run_script(tmp_path, config.replace(backend=backend, workers=2), KEPT_ITERATION, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "streamed step 0\n", ""), proc.stderr


def test_processes_statistics_count_the_workers_store_reads(config) -> None:
    def reads(backend: str) -> tuple[int, int]:
        loader = Loader(config.replace(max_epochs=1), backend=backend)
        for _ in loader:
            pass
        st = loader.statistics()
        return st.store_requests, st.store_bytes_read

    on_disk = sum(p.stat().st_size for s in config.sources for p in Path(s.uri.removeprefix("file://")).iterdir())
    threads, processes = reads("threads"), reads("processes")
    # one epoch reads every byte at least once, and the same reads wherever the lanes run (the parent
    # alone, which only plans, read 6 requests / 52 KB of the 188 / 546 KB here)
    assert threads[1] >= on_disk and processes == threads, (threads, processes, on_disk)


def test_the_api_a_user_reads_has_docstrings() -> None:
    for obj in (Loader.from_toml, Config.from_toml, Loader.close, Loader.state_dict, Loader.load_state_dict,
                Loader.statistics, Loader.open, Loader.__iter__):
        assert obj.__doc__ and len(obj.__doc__) > 40, obj
    assert 'batch["step"] + 1' in Loader.step.__doc__
    assert "`weight` is relative" in SourceConfig.__doc__


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_ctrl_c_while_waiting_for_a_batch_consumes_nothing(config, backend, monkeypatch) -> None:
    """Ctrl-C lands while the `for` loop waits for its third batch, and the pipeline finishes that
    batch just after: the state a trainer saves then still names it as the next one, and a new
    loop (or a resume) hands it out. Before, the pipeline counted it as consumed: lost."""
    import signal
    import threading

    from zephon_stream.loader.loader import BatchStream

    steps = 6
    with Loader(config, backend=backend) as loader:
        expected = _records(batches_to(loader, steps))
    original, calls, interrupted = BatchStream.next_batch, [0], threading.Event()

    def ctrl_c(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    async def finished_after_ctrl_c(self):
        batch = await original(self)
        calls[0] += 1
        if calls[0] == 3:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # as Ctrl-C: the main thread waits
            await anyio.to_thread.run_sync(interrupted.wait)  # the batch is done once the loop has given up on it
        return batch

    monkeypatch.setattr(BatchStream, "next_batch", finished_after_ctrl_c)
    previous = signal.signal(signal.SIGINT, ctrl_c)
    try:
        loader = Loader(config, backend=backend)
        got = []
        with pytest.raises(KeyboardInterrupt):
            for batch in loader:
                got.append(batch)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert loader.step == 2
    state = loader.state_dict()
    got += batches_to(loader, steps)  # to global step `steps`
    assert _records(got) == expected
    resumed = Loader(config, backend=backend)
    resumed.load_state_dict(state)
    assert _records(got[:2] + batches_to(resumed, steps)) == expected


CTRL_C_AT_THE_START = """
import signal
import sys
import threading
import time

import anyio.from_thread

from zephon_stream import Loader

interrupted = threading.Event()


def ctrl_c(signum, frame):
    interrupted.set()
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, ctrl_c)
start_loop = anyio.from_thread.run_eventloop


def waiting_for_the_loop() -> bool:
    frame = sys._current_frames()[threading.main_thread().ident]
    while frame is not None and not (frame.f_code.co_name == "result" and "futures" in frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None


def loop_starting(*args, **kwargs):  # Ctrl-C lands while the main thread waits for the loop to be up
    while not waiting_for_the_loop():
        time.sleep(0.001)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    interrupted.wait(1.0)  # before, the main thread took it at once; now it is held until the loop is up
    return start_loop(*args, **kwargs)


anyio.from_thread.run_eventloop = loop_starting
loader = Loader.from_toml(sys.argv[1])
try:
    next(iter(loader))
except KeyboardInterrupt:
    print("interrupted at step", loader.step)
anyio.from_thread.run_eventloop = start_loop
print("then step", next(iter(loader))["step"])
"""


def test_ctrl_c_as_the_loop_starts_ends_the_iteration(config, tmp_path) -> None:
    """Ctrl-C while a `for` loop's event-loop thread was starting (the first instants of a stream):
    anyio's portal joined that thread with its loop never stopped, and the process hung for good.
    Seen as a `zephon stream` that a terminal's Ctrl-C did not end (a CI run's timeout)."""
    proc = _run_script(tmp_path, config, CTRL_C_AT_THE_START, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "interrupted at step 0\nthen step 0\n", proc.stderr


CTRL_C_AT_THE_STOP = """
import signal
import sys

from anyio.from_thread import BlockingPortal

from zephon_stream import Loader

send = BlockingPortal.call


def call(self, func, *args):  # Ctrl-C just before the portal's stop is sent to its loop
    if getattr(func, "__name__", "") == "stop" and not fired:
        fired.append(1)
        signal.raise_signal(signal.SIGINT)
    return send(self, func, *args)


fired = []
BlockingPortal.call = call
loader = Loader.from_toml(sys.argv[1])
batches = iter(loader)
next(batches)
try:
    batches.close()
except KeyboardInterrupt:
    print("interrupted at the close")
print("then step", next(iter(loader))["step"])
"""


def test_ctrl_c_as_the_loop_stops_ends_the_iteration(config, tmp_path) -> None:
    """As at the start: a Ctrl-C before the portal's stop was sent to the loop (the close after a
    `break`, or after an error) left the thread's join waiting for ever."""
    proc = _run_script(tmp_path, config, CTRL_C_AT_THE_STOP, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "interrupted at the close\nthen step 1\n", proc.stderr


ASYNC_FOR_CUT = """
import asyncio
import gc
import signal
import sys

from zephon_stream import Loader

gc.disable()  # as before the collector's next pass
loader = Loader.from_toml(sys.argv[1])


async def train():
    async for batch in loader:
        if batch["step"] == 1:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: asyncio.run cancels this task at its next wait


try:
    asyncio.run(train())
except KeyboardInterrupt:
    print("interrupted at step", loader.step)
print("then step", next(iter(loader))["step"])
"""


def test_a_stream_after_an_async_for_cut_by_ctrl_c(config, tmp_path) -> None:
    """The cut `async for` kept its stream open, the lanes running, until the garbage collector's
    next pass (its exception's traceback held it in a cycle): a new stream or a load_state_dict
    meanwhile was refused as "a stream open already"."""
    proc = _run_script(tmp_path, config, ASYNC_FOR_CUT, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "interrupted at step 2\nthen step 2\n", proc.stderr


CTRL_C_IN_A_STUCK_STOP = """
import os
import signal
import sys
import threading
import time

import anyio

from zephon_stream import Loader
from zephon_stream.testing.stores import WrappedStore

stuck = threading.Event()


class Stuck(WrappedStore):  # once set, each read hangs in a thread that no cancel stops (a hung mount)
    async def read(self, key, start=0, end=None):
        if stuck.is_set():
            await anyio.to_thread.run_sync(time.sleep, 3600)
        return await self.inner.read(key, start, end)


def ctrl_c_every_half_second():
    for _ in range(80):
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)


loader = Loader.from_toml(sys.argv[1], wrap_store=Stuck)
start = None
try:
    for batch in loader:
        if batch["step"] == 1:
            stuck.set()
            time.sleep(1.0)  # the lanes' next reads hang
            start = time.monotonic()
            threading.Thread(target=ctrl_c_every_half_second, daemon=True).start()
            time.sleep(30)  # the training step, which the first Ctrl-C cuts
finally:
    print("left the loop", "within 20 s" if time.monotonic() - start < 20 else "late")  # about 1.5 s; hung before
"""


def test_ctrl_c_ends_a_loop_whose_stop_is_stuck(config, tmp_path) -> None:
    """A Ctrl-C held through the whole stop of the lanes (ae8e5b1) made a stop stuck on a read
    (a hung mount) deaf to every Ctrl-C; it is held only while the portal's stop is sent."""
    proc = _run_script(tmp_path, config.replace(max_epochs=0), CTRL_C_IN_A_STUCK_STOP, timeout=60)
    assert proc.stdout == "left the loop within 20 s\n" and "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]


def test_stall_warning_s_0_never_warns(config, caplog) -> None:
    """`stall_warning_s = 0` turns the stall watch off: a lane that keeps a batch waiting logs nothing."""
    from zephon_stream.testing.stores import WrappedStore

    reads = iter(range(10**9))

    class SlowOnce(WrappedStore):
        async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
            if next(reads) == 45:
                await anyio.sleep(0.6)
            return await super().read(key, start, end)

    caplog.set_level("WARNING", logger="zephon_stream.loader")
    want = _records(batches_to(Loader(config), 20))
    got = _records(batches_to(Loader(config.replace(stall_warning_s=0), wrap_store=SlowOnce), 20))
    assert got == want
    assert not [r.getMessage() for r in caplog.records if r.name == "zephon_stream.loader"]


@pytest.mark.parametrize("backend", ["threads", "inline"])
def test_a_batch_that_waits_long_on_one_lane_says_so_and_when_it_ends(config, backend, caplog) -> None:
    """A store that stops answering (a stuck connection; a stopped worker alike) was a silent
    hang: the trainer waited with nothing in its log. Now the wait, its lane, and its end are logged; the batches
    are those of a run without it."""
    from zephon_stream.testing.stores import WrappedStore

    want = _records(batches_to(Loader(config, backend=backend), 20))
    config = config.replace(stall_warning_s=0.4)  # an execution setting: the same batches
    reads = iter(range(10**9))

    def warned() -> bool:
        return any("has waited" in r.getMessage() for r in caplog.records)

    class HangsOnce(WrappedStore):
        async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
            if next(reads) >= 45:  # past the start the store stops answering until the wait is logged
                with anyio.fail_after(30):
                    while not warned():
                        await anyio.sleep(0.02)
            return await super().read(key, start, end)

    caplog.set_level("WARNING", logger="zephon_stream.loader")
    got = _records(batches_to(Loader(config, backend=backend, wrap_store=HangsOnce), 20))
    assert got == want
    said = [r.getMessage() for r in caplog.records if r.name == "zephon_stream.loader"]
    waited = [m for m in said if "has waited" in m]
    assert waited and all(re.fullmatch(rf"batch \d+ has waited \d+ s for the samples of lane \d+ \(backend "
                                       rf"'{backend}'\): a read, its retries or a lane worker is slow or stuck; "
                                       r"still waiting", m) for m in waited), said
    lane = re.search(r"lane (\d+)", waited[0]).group(1)
    assert re.fullmatch(rf"lane {lane} answered after \d+ s; batch \d+ goes on", said[-1]), said
