"""Backends decide where lanes run, and nothing else: the order never depends on them.

- `inline`: every lane on the caller's event loop, CPU steps too.
- `threads`: lanes on the event loop, CPU steps (decode, tokenize) in worker threads under a
  `CapacityLimiter(cpu_threads)`; the default, and the one that keeps the trainer's loop free.
- `processes`: this rank's lanes split into `workers` processes, each running its lanes
  with the threads policy. They are forked from a server process that has imported this package
  once (multiprocessing's forkserver; spawn where there is none), so a worker imports nothing
  but the user's script again (a 24-step run of two workers on small data: 1.2 s instead of 2.3 s
  spawned). It takes this process's environment as it is when the worker starts, as a spawned
  one would. Samples come back as msgpack over pipes (never pickle), with
  per-lane credits so a slow lane never blocks a fast one's pipe; both are written and read on
  the event loops, not in threads (`engine.pipes`). Each worker publishes its
  stores' counters in shared memory, so the loader's statistics count the workers' reads.
- `ray`: the same, with Ray actors for processes (`ray_backend`), on this host or a cluster.

A worker process or actor that dies is started again where its lanes stood, up to
`max_restarts` times (`restarts`): the stream goes on with the same bytes.

A worker imports the user's script again before it runs anything (forkserver and spawn alike); a script that
starts a processes-backend loader outside `if __name__ == "__main__":` would start it again in
every worker. `check_spawn_allowed` notices (the worker exits with `NO_MAIN_GUARD`) and the
parent raises one ConfigError that says what to add.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import msgspec
import numpy as np

from zephon_stream import errors as _exceptions
from zephon_stream.connectors.base import Store, StoreStatistics
from zephon_stream.engine import pipes, threads
from zephon_stream.engine.cpu import CpuPolicy, rayon_threads, usable_cores
from zephon_stream.engine.memory import managed_memory
from zephon_stream.errors import ConfigError, ZephonError
from zephon_stream.loader.config import Config
from zephon_stream.loader.lane import (
    Lanes,
    TextLane,
    decode_processes,
    lane_worker_config,
    png_text_limits,
    use_png_text_limits,
)
from zephon_stream.loader.plan import DataPlan, open_stores
from zephon_stream.loader.ray_backend import Wire, run_ray
from zephon_stream.loader.restarts import Supervision, supervised
from zephon_stream.loader.state import LaneState
from zephon_stream.operators.read import RecordCounts
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import LaneFailure, Sample

log = logging.getLogger("zephon_stream.loader")

__all__ = ["NO_MAIN_GUARD", "check_spawn_allowed", "cpu_policy", "run_lanes"]

Streams = dict[int, anyio.abc.ObjectReceiveStream[list[Sample]]]
#: (streams, credit(lane), records skipped and filtered, the workers' store counters, worker restarts)
LaneRun = tuple[Streams, Callable[[int], None], Callable[[], RecordCounts], Callable[[], StoreStatistics],
                Callable[[], int]]

#: The exit status of a worker that found itself importing a script without a main guard.
NO_MAIN_GUARD = 86


def cpu_policy(config: Config) -> CpuPolicy:
    return CpuPolicy(config.cpu_threads, inline=config.backend == "inline")


def decode_policy(config: Config) -> CpuPolicy | None:
    """The image sources' decode threads (`vision.decode_threads`), or None without images."""
    if config.vision is None:
        return None
    # a call reaches a decode process from a decode thread: at least one thread a process
    return CpuPolicy(max(config.vision.decode_threads, decode_processes(config)), inline=config.backend == "inline")


@functools.lru_cache(maxsize=16)
def _warn_once(message: str) -> None:
    log.warning(message)


def warn_decode_processes(config: Config) -> None:
    """Say where `vision.decode_processes` cannot do what it says (in this process: a lane worker's
    log may go nowhere)."""
    n = config.vision.decode_processes if config.vision is not None else 0
    if not n:
        return
    if not decode_processes(config):
        where = "on the event loop's thread" if config.backend == "inline" else "in its lane processes, on threads"
        _warn_once(f"vision.decode_processes = {n} applies to backend \"threads\" only: backend "
                   f"{config.backend!r} decodes images {where}")
    elif n > usable_cores():
        _warn_once(f"vision.decode_processes = {n} is more than the {usable_cores()} cores this process may run on: "
                   "the workers only take turns on them (each rank of a node starts its own)")


@asynccontextmanager
async def run_lanes(config: Config, tokenizer: Tokenize, plan: DataPlan, stores: list[Store],
                    states: dict[int, LaneState], wrap_store: Callable[[Store], Store] | None = None,
                    ) -> AsyncIterator[LaneRun]:
    """Run `states`' lanes on `config.backend`; yield a `LaneRun`.

    `stores` serve the lanes run here; worker processes and actors open their own (wrapped by
    `wrap_store`), and the fourth callable sums their counters (all zero when none runs).
    """
    warn_decode_processes(config)
    if config.backend == "processes":
        async with _run_processes(config, plan, states, wrap_store) as out:
            yield out
        return
    if config.backend == "ray":
        async with run_ray(config, plan, states, wrap_store, _WIRE) as out:
            yield out
        return
    async with _run_local(config, plan, stores, tokenizer, states) as (streams, shared):
        yield streams, lambda lane: None, shared.record_counts, StoreStatistics, lambda: 0


# What the fork server imports once, for every worker: first a module that makes it ignore Ctrl-C
# (the server ignores it once its imports are done; one that took it while importing died, and the
# trainer's next worker start failed), then the workers' code.
_PRELOAD = ["zephon_stream._no_ctrl_c", "zephon_stream.loader.backends"]
# ... and these too, when this process has imported them by the time the server starts. A trainer's
# script imports torch at its top, and every worker imports the script again: torch took each worker
# about 1 CPU-s at every stream's start (2.5 of the 18 CPU-s of a text bench run on 2 workers, and
# 1.3-2.1 s to the first batch against 0.6 s). Imported once in the server, it is there in every
# worker forked from it, its pages shared. torch starts no thread when imported (numpy, already
# preloaded, starts one), so the server forks as safely as before.
_PRELOAD_IF_IMPORTED = ("torch",)


def _context() -> Any:
    """The multiprocessing context of worker processes: forkserver with this package (and torch,
    if imported here) preloaded (not the user's script: a worker imports that itself, as under
    spawn, so a missing main guard is noticed in the worker), or spawn where forkserver does not
    exist."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    preload = _PRELOAD + [name for name in _PRELOAD_IF_IMPORTED if name in sys.modules]
    ctx.set_forkserver_preload(preload)  # read when the server starts: once per process
    return ctx


def start_fork_server() -> None:
    """Start the workers' fork server now, with Ctrl-C ignored from its first instruction, when
    called from the main thread (where a signal's handler may be set; elsewhere the server starts
    with the first worker, and is deaf to Ctrl-C once `_no_ctrl_c` is imported).

    Ctrl-C in a terminal signals the whole process group: a fork server still starting took it,
    died, and the trainer's first worker start failed with an EOFError. An ignored signal stays
    ignored through fork and exec (a blocked one does not: subprocess unblocks it), so the parent
    ignores it for the few milliseconds of the spawn."""
    check_spawn_allowed()  # a worker running a script with no main guard starts nothing
    if ("forkserver" not in multiprocessing.get_all_start_methods()
            or threading.current_thread() is not threading.main_thread()):
        return
    from multiprocessing import forkserver

    _context()  # its preload list
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # a handler set outside Python: leave it be
        forkserver.ensure_running()
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def check_spawn_allowed() -> None:
    """Called before starting worker processes. In a spawned process that is still importing the
    user's script (the script starts a loader outside `if __name__ == "__main__":`), exit with
    `NO_MAIN_GUARD` instead of starting workers of workers; the parent explains."""
    # `_inheriting` is what multiprocessing itself checks before refusing to start a process there
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # os._exit, not SystemExit: a forkserver child turns any exception into exit status 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(NO_MAIN_GUARD)


def _no_main_guard_error() -> ConfigError:
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
    return ConfigError(
        f'backend "processes" runs its lanes in worker processes, and each worker imports {script} again: '
        "the code that starts the loader ran again in them. Put that code under "
        '`if __name__ == "__main__":` (or in a function called from there), or use backend "threads"')


@asynccontextmanager
async def _run_local(config: Config, plan: DataPlan, stores: list[Store], tokenizer: Tokenize,
                     states: dict[int, LaneState]) -> AsyncIterator[tuple[Streams, Lanes]]:
    shared = Lanes(config, plan, stores, tokenizer, cpu_policy(config), decode_policy(config))
    streams: Streams = {}
    async with anyio.create_task_group() as tg:
        shared.spawn = tg.start_soon
        for lane, state in states.items():
            send, recv = anyio.create_memory_object_stream[list[Sample]](config.sample_buffer)
            tg.start_soon(TextLane(shared, lane, state).run, send)
            streams[lane] = recv
        try:
            yield streams, shared
        finally:
            tg.cancel_scope.cancel()
            for recv in streams.values():
                recv.close()


# ---- processes ----------------------------------------------------------------------------------

class _Image(msgspec.Struct, array_like=True):
    # uint8 [height, width, -1]: an ImageDoc.image (a patch frame: patches, 3, patch_size^2). Encoded from the
    # array's own buffer, decoded as a view into the received message: the pixels are not copied on either side.
    pixels: memoryview
    height: int
    width: int
    grid: tuple[int, int, int]


class _Msg(msgspec.Struct, array_like=True):
    kind: str  # "batch" | "end" | "error"
    lane: int = -1
    samples: list[tuple[int, bytes, bytes, bytes, list[int], int, LaneState, list[_Image], bytes, list[int]]] = []
    error: tuple[str, str] = ("", "")
    counts: RecordCounts = RecordCounts()  # "batch", "end": the worker's records skipped and filtered so far
    failed: tuple[str, str, int] = ("", "", -1)  # "batch": then the lane's LaneFailure (class, text, index)


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Msg)


def _pack(lane: int, batch: list[Sample], counts: RecordCounts | None = None) -> bytes:
    """A batch of a lane's samples as one message, with the worker's bad-record counts (one message
    a batch: each costs a thread hand-off on both sides). A lane's failure (a batch's last item)
    goes as its error's class and text."""
    failed = ("", "", -1)
    if batch and isinstance(last := batch[-1], LaneFailure):
        err = _exceptions.root_error(last.error)
        failed, batch = (type(err).__name__, str(err), last.index), batch[:-1]
    return _enc.encode(_Msg("batch", lane, [
        (s.index, s.input_ids.tobytes(), s.labels.tobytes(), s.position_ids.tobytes(), s.segments, s.num_tokens,
         s.state, [_Image(np.ascontiguousarray(im).data.cast("B"), im.shape[0], im.shape[1], g)
                   for im, g in zip(s.images, s.grids)],
         s.token_types.tobytes() if s.token_types is not None else b"", s.sources)
        for s in batch], counts=counts or RecordCounts(), failed=failed))


def _unpack(msg: _Msg) -> list[Sample]:
    out = [Sample(np.frombuffer(ids, np.uint32), np.frombuffer(lab, np.int32), np.frombuffer(pos, np.int32),
                  segs, n, msg.lane, index, state,
                  [np.frombuffer(im.pixels, np.uint8).reshape(im.height, im.width, -1) for im in images],
                  [tuple(im.grid) for im in images], np.frombuffer(types, np.uint8) if types else None, sources)
           for index, ids, lab, pos, segs, n, state, images, types, sources in msg.samples]
    if msg.failed[0]:
        out.append(LaneFailure(_worker_error(*msg.failed[:2]), msg.lane, msg.failed[2]))  # type: ignore[arg-type]
    return out


@asynccontextmanager
async def _run_processes(cfg: Config, plan: DataPlan, states: dict[int, LaneState],
                         wrap_store: Callable[[Store], Store] | None,
                         ) -> AsyncIterator[LaneRun]:
    lanes = sorted(states)
    groups = [lanes[w::cfg.workers] for w in range(min(cfg.workers, len(lanes)))]
    check_spawn_allowed()
    pool = _Workers(cfg, plan, wrap_store, Supervision(cfg, states, groups))
    await pool.allocate_counters()
    async with supervised(pool, lanes, len(groups), cfg.sample_buffer) as out:
        yield out


def worker_environ(workers: int) -> dict[str, str]:
    """This process's environment for one of `workers` worker processes, with the tokenizer's
    thread pool sized to the worker's share of the cores unless `RAYON_NUM_THREADS` sizes it
    (as Rayon reads it: `engine.cpu.rayon_threads`).

    `tokenizers` runs `encode_batch` on a Rayon pool of one thread per core in every process, so
    `workers` workers would run `workers` x cores threads, and each thread that allocates gets a
    glibc arena of its own: memory grows with the thread count (see engine/memory.py). The ranks
    on this machine (`LOCAL_WORLD_SIZE`, which torchrun sets) each start their own workers, so
    the cores are shared among all of them."""
    environ = dict(os.environ)
    if rayon_threads(environ) is None:
        cores = usable_cores()
        try:
            ranks = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            ranks = 1
        environ["RAYON_NUM_THREADS"] = str(max(1, cores // (workers * ranks)))
    return environ


class _Workers:
    """The worker processes of one run: each runs a group of lanes and is started again where its
    lanes stood if it dies (see `restarts`), up to `max_restarts` times."""

    def __init__(self, cfg: Config, plan: DataPlan, wrap_store: Callable[[Store], Store] | None,
                 sup: Supervision) -> None:
        self.cfg, self.plan, self.wrap_store, self.sup = cfg, plan, wrap_store, sup
        self.ctx = _context()
        self.png_text = png_text_limits(cfg)
        self.sends: dict[int, Any] = {}
        self.group_of = {lane: w for w, group in enumerate(sup.groups) for lane in group}
        self.ctrl: list[Any] = [None] * len(sup.groups)  # each live worker's credit pipe
        self.counters: list[Any] = []
        self.counted_before = [[0] * len(_COUNTERS) for _ in sup.groups]  # the counts of dead workers

    async def allocate_counters(self) -> None:
        # each worker's store counters, in shared memory (which creates a file: not on the event loop)
        self.counters = await threads.run_sync(
            lambda: [self.ctx.RawArray("q", len(_COUNTERS)) for _ in self.sup.groups])

    def credit(self, lane: int) -> None:
        """The sequencer took a batch of `lane`: its worker may send one more."""
        self.sup.credited(lane)
        ctrl = self.ctrl[self.group_of[lane]]
        try:
            if pipes.ON_LOOP:  # 4 bytes, written whole (under PIPE_BUF), read by the worker's `pipes.Credits`
                os.write(ctrl.fileno(), lane.to_bytes(4, "little"))
            else:
                ctrl.send_bytes(lane.to_bytes(4, "little"))
        except OSError:
            pass  # the worker died: its successor starts with the credits counted here

    def store_statistics(self) -> StoreStatistics:
        """The workers' store counters, summed (each a shared array that only its worker writes)."""
        return StoreStatistics(**{name: sum(c[i] for c in self.counters) + sum(b[i] for b in self.counted_before)
                                  for i, name in enumerate(_COUNTERS)})

    async def supervise(self, w: int) -> None:
        """Run worker `w` until its lanes end; start it again from their last states when it dies."""
        while self.sup.live(w):
            async with self._started(w) as (proc, data_r):
                ended = await self._receive(w, proc, data_r)
            if ended:
                return
            self.sup.lost(w, f"process exit code {proc.exitcode}")
            for i in range(len(_COUNTERS)):  # the dead worker's reads still count; its successor counts anew
                self.counted_before[w][i] += self.counters[w][i]
                self.counters[w][i] = 0

    @asynccontextmanager
    async def _started(self, w: int) -> AsyncIterator[tuple[Any, Any]]:
        data_r, data_w = self.ctx.Pipe(duplex=False)
        _widen(data_r)
        ctrl_r, ctrl_w = self.ctx.Pipe(duplex=False)
        # credits are read and the credit pipe swapped in one step: a credit given meanwhile is not lost
        credits = [self.sup.credits(lane) for lane in self.sup.live(w)]
        self.ctrl[w] = ctrl_w
        environ = worker_environ(len(self.sup.groups))
        payload = msgspec.msgpack.encode((self.cfg, self.plan, self.sup.states(w), credits, environ, self.png_text))
        proc = self.ctx.Process(target=_worker_main, args=(payload, data_w, ctrl_r, self.wrap_store, self.counters[w]),
                                name=f"zephon-lanes-{w}", daemon=True)
        try:
            await threads.run_sync(proc.start)  # spawning takes long enough to stall the loop
            data_w.close()
            ctrl_r.close()
            yield proc, data_r
        finally:
            await _stop_worker(proc, data_r, ctrl_w)

    async def _receive(self, w: int, proc: Any, conn: Any) -> bool:
        """Hand the worker's batches to the lanes' streams: True once its lanes ended, False if it died."""
        if pipes.ON_LOOP:
            os.set_blocking(conn.fileno(), False)  # read on this loop as messages come (`pipes`)
        while self.sup.live(w):
            try:
                raw = (await pipes.read_message(conn.fileno()) if pipes.ON_LOOP else  # into one buffer, in place
                       await threads.run_sync(conn.recv_bytes, abandon_on_cancel=True))
            except (EOFError, OSError):
                await threads.run_sync(proc.join, 5)
                if proc.exitcode == NO_MAIN_GUARD:
                    raise _no_main_guard_error() from None
                return False
            msg = _dec.decode(raw)
            if msg.kind == "batch":
                samples = _unpack(msg)
                self.sup.received(msg.lane, samples)
                await self.sends[msg.lane].send(samples)
                self.sup.set_skipped(w, msg.counts)
            elif msg.kind == "end":
                self.sup.set_skipped(w, msg.counts)
                self.sup.ended.add(msg.lane)
                await self.sends[msg.lane].aclose()
            else:
                raise _worker_error(*msg.error)
        return True


_PIPE_BYTES = 1 << 20  # a batch of images is megabytes: 64 KiB pipes hand it over in a hundred wake-ups


def _widen(conn: Any) -> None:
    """Give the data pipe `_PIPE_BYTES` of buffer where the platform allows it (Linux's F_SETPIPE_SZ, up to
    /proc/sys/fs/pipe-max-size); elsewhere, or when refused, it keeps its size, which only costs speed."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


def _worker_error(name: str, text: str) -> Exception:
    """The error a worker reported, as its ZephonError class (by name: nothing is unpickled)."""
    cls = getattr(_exceptions, name, ZephonError)
    return cls(text) if isinstance(cls, type) and issubclass(cls, Exception) else ZephonError(text)


async def _stop_worker(proc: Any, data_r: Any, ctrl_w: Any) -> None:
    """Workers only read: closing their pipes and terminating them loses nothing."""
    ctrl_w.close()
    data_r.close()
    with anyio.CancelScope(shield=True):
        if proc.pid is None:  # never started
            return
        await threads.run_sync(proc.join, 0.5)
        if proc.is_alive():
            proc.terminate()
            await threads.run_sync(proc.join, 5)


def _worker_main(payload: bytes, data_w: Any, ctrl_r: Any, wrap_store: Callable[[Store], Store] | None,
                 counters: Any) -> None:
    # Ctrl-C in a terminal signals the whole process group: the trainer's process takes it and stops
    # the workers; a worker that took it too printed a KeyboardInterrupt traceback each
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg_raw, plan_raw, states_raw, credits, environ, png_text = msgspec.msgpack.decode(payload)
    os.environ.clear()  # the parent's environment now (credentials, ZEPHON_*), not the fork server's
    os.environ.update(environ)
    use_png_text_limits(png_text)
    cfg = msgspec.convert(cfg_raw, Config)
    plan = msgspec.convert(plan_raw, DataPlan)
    states = [msgspec.convert(s, LaneState) for s in states_raw]
    try:
        anyio.run(_worker, cfg, plan, states, credits, data_w, ctrl_r, wrap_store, counters)
    except BaseException as exc:  # report, then exit: the parent raises it
        err = _exceptions.root_error(exc)
        try:
            data_w.send_bytes(_enc.encode(_Msg("error", error=(type(err).__name__, str(err)))))
        except OSError:
            pass


async def _worker(cfg: Config, plan: DataPlan, states: list[LaneState], initial_credits: list[int], data_w: Any,
                  ctrl_r: Any, wrap_store: Callable[[Store], Store] | None, counters: Any) -> None:
    tokenizer = Tokenize.for_config(cfg)
    credits = {s.lane: anyio.Semaphore(n) for s, n in zip(states, initial_credits)}
    out_send, out_recv = anyio.create_memory_object_stream[bytes](len(states))
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(managed_memory())  # as in the loader's process (ZEPHON_MALLOC)
        stores = await open_stores(cfg, stack, wrap_store, planned=True)
        local = lane_worker_config(cfg)
        async with _run_local(local, plan, stores, tokenizer, {s.lane: s for s in states}) as (streams, shared):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_credits, ctrl_r, credits, tg.cancel_scope)
                tg.start_soon(_send_all, out_recv, data_w)
                async with anyio.create_task_group() as lanes_tg:
                    for lane, recv in streams.items():
                        lanes_tg.start_soon(_forward, lane, recv, credits[lane], out_send.clone(), shared, counters)
                out_send.close()


async def _forward(lane: int, recv: Any, credit: anyio.Semaphore, out: Any, shared: Lanes, counters: Any) -> None:
    async with out:
        async for batch in recv:
            await credit.acquire()
            _write_counters(shared.stores, counters)  # before the batch leaves: the parent sees its reads
            await out.send(_pack(lane, batch, shared.record_counts()))
        _write_counters(shared.stores, counters)
        await out.send(_enc.encode(_Msg("end", lane, counts=shared.record_counts())))


_COUNTERS = ("requests", "retries", "bytes_read")  # the store counters a worker shares with the parent


def _write_counters(stores: list[Store], counters: Any) -> None:
    stats = [s.statistics() for s in stores]
    for i, name in enumerate(_COUNTERS):
        counters[i] = sum(getattr(st, name) for st in stats)


async def _send_all(recv: Any, conn: Any) -> None:
    if not pipes.ON_LOOP:
        async for raw in recv:
            await threads.run_sync(conn.send_bytes, raw)
        return
    fd = conn.fileno()
    os.set_blocking(fd, False)  # written on this loop as the parent drains it (`pipes`)
    try:
        async for raw in recv:
            await pipes.write_message(fd, raw)
    finally:
        os.set_blocking(fd, True)  # for `_worker_main`'s error report, a blocking `send_bytes`


async def _credits(conn: Any, credits: dict[int, anyio.Semaphore], scope: anyio.CancelScope) -> None:
    if pipes.ON_LOOP:
        os.set_blocking(conn.fileno(), False)
        try:
            await pipes.Credits(conn.fileno(), lambda lane: credits[lane].release()).run()
        except OSError:
            pass
        scope.cancel()  # the parent is gone or done: stop
        return
    while True:
        try:
            raw = await threads.run_sync(conn.recv_bytes, abandon_on_cancel=True)
        except (EOFError, OSError):
            scope.cancel()  # the parent is gone or done: stop
            return
        credits[int.from_bytes(raw, "little")].release()


def _unpack_bytes(raw: bytes) -> list[Sample]:
    return _unpack(_dec.decode(raw))


#: What the ray backend takes from here: how lanes run inside a worker, and the batches' wire format.
_WIRE = Wire(run_local=_run_local, pack=_pack, unpack=_unpack_bytes, error=_worker_error)
