"""The ray backend: this rank's lanes run in Ray actors, on this host or across a cluster.

```
trainer process (rank r)                         Ray actor w (any node)
  sequencer <- lane streams <- _Actors._drain  <--pull(lane, seq)--  _LaneActor: lanes of group w,
               (sample_buffer + 1 each)           msgpack bytes       threads policy, own stores
```

Lanes are split over `ray_actors` actors (`lanes[w::ray_actors]`), each reserving
`ray_num_cpus` CPUs and reading the sources itself, exactly as a worker process of the
processes backend does. A lane's batches come back by pulls: the trainer side keeps at most
`sample_buffer` pulls in flight per lane, less the batches already waiting here, and asks for
one more whenever the sequencer takes one (the credits of the processes backend). A pull
names its sequence number, so the actor answers a lane's pulls in order whatever order Ray
runs them in. Each answer is msgpack bytes (the wire format of the processes backend): Ray
carries them as plain bytes, and nothing the data decides is unpickled here.

An actor that dies (SIGKILL, a lost node) is replaced by one started where its lanes stood
(`restarts`). Ray is imported only when this backend runs: it is the optional `ray` extra.
Without `ray_address`, a local Ray bound to 127.0.0.1 is started for the run, its files in a
temporary directory of its own, and shut down after; an instance already initialized in this
process is used as it is.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, NamedTuple

import anyio
import msgspec

from zephon_stream import errors as _exceptions
from zephon_stream.connectors.base import Store, StoreStatistics
from zephon_stream.engine import threads
from zephon_stream.engine.cpu import rayon_threads
from zephon_stream.errors import ConfigError
from zephon_stream.loader.config import Config
from zephon_stream.loader.lane import lane_worker_config, png_text_limits, use_png_text_limits
from zephon_stream.loader.plan import DataPlan, open_stores
from zephon_stream.loader.restarts import Supervision, supervised
from zephon_stream.loader.state import LaneState
from zephon_stream.operators.read import RecordCounts
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import Sample

__all__ = ["ACTOR_NAME", "Wire", "run_ray"]

#: The class name of the lane actors (Ray names their processes `ray::_LaneActor...`).
ACTOR_NAME = "_LaneActor"
_START_TIMEOUT_S = 300  # an actor that is not running by then cannot be placed: say so


class Wire(NamedTuple):
    """What this backend takes from `backends` (which imports this module, not the reverse)."""

    run_local: Callable[..., Any]  # (config, plan, stores, tokenizer, states) -> (streams, lanes): lanes here
    pack: Callable[[int, list[Sample]], bytes]  # a lane's batch as msgpack bytes
    unpack: Callable[[bytes], list[Sample]]
    error: Callable[[str, str], Exception]  # a worker's error, by class name and text


class _Reply(msgspec.Struct, array_like=True):
    """An actor's answer to one pull: a batch (`pack`ed), the lane's end, or the lanes' error."""

    kind: str  # "batch" | "end" | "error"
    batch: bytes = b""
    skipped: RecordCounts = RecordCounts()  # records the actor's lanes skipped and filtered so far
    counters: tuple[int, int, int] = (0, 0, 0)  # the actor's store requests, retries, bytes_read
    error: tuple[str, str] = ("", "")


_enc = msgspec.msgpack.Encoder()
_reply = msgspec.msgpack.Decoder(_Reply)


# ---- the actor ----------------------------------------------------------------------------------

class _LaneActor:
    """Runs a group of lanes (threads policy) and answers pulls. Its methods run on Ray's event loop."""

    def __init__(self, run_local: Callable[..., Any], pack: Callable[[int, list[Sample]], bytes],
                 wrap_store: Callable[[Store], Store] | None) -> None:
        self.run_local, self.pack, self.wrap_store = run_local, pack, wrap_store
        self.ready, self.finished = anyio.Event(), anyio.Event()
        self.streams: dict[int, Any] = {}
        self.turn: dict[int, anyio.Condition] = {}
        self.next: dict[int, int] = {}
        self.error = ("", "")
        self.skipped: Callable[[], RecordCounts] = RecordCounts
        self.stores: list[Store] = []
        self.task: Any = None

    async def start(self, payload: bytes) -> int:
        """Start the lanes of `payload` (config, plan, states); returns this process's id."""
        import asyncio  # Ray runs async actors on asyncio: the lanes live in a task of the actor's loop

        cfg_raw, plan_raw, states_raw, png_text = msgspec.msgpack.decode(payload)
        cfg = lane_worker_config(msgspec.convert(cfg_raw, Config))
        use_png_text_limits(png_text)  # the trainer's, as the threads backend decodes under them
        size_tokenizer_pool(cfg.ray_num_cpus)  # before this process first tokenizes
        states = [msgspec.convert(s, LaneState) for s in states_raw]
        self.turn = {s.lane: anyio.Condition() for s in states}
        self.next = {s.lane: 0 for s in states}
        self.task = asyncio.get_running_loop().create_task(
            self._serve(cfg, msgspec.convert(plan_raw, DataPlan), {s.lane: s for s in states}))
        await self.ready.wait()
        return os.getpid()

    async def _serve(self, cfg: Config, plan: DataPlan, states: dict[int, LaneState]) -> None:
        try:
            async with AsyncExitStack() as stack:
                self.stores = await open_stores(cfg, stack, self.wrap_store, planned=True)
                tokenizer = Tokenize.for_config(cfg)
                async with self.run_local(cfg, plan, self.stores, tokenizer, states) as (
                        streams, shared):
                    self.streams, self.skipped = streams, shared.record_counts
                    self.ready.set()
                    await anyio.sleep_forever()  # the lanes run until the trainer side kills this actor
        except BaseException as exc:  # answered to the next pulls, then raised by the trainer side
            err = _exceptions.root_error(exc)
            self.error = (type(err).__name__, str(err))
        finally:
            self.finished.set()
            self.ready.set()

    async def pull(self, lane: int, seq: int) -> bytes:
        """The `seq`-th batch of `lane` since start (pulls of a lane are answered in `seq` order)."""
        await self.ready.wait()
        if self.error[0] or lane not in self.turn:
            return self._reply("error")
        async with self.turn[lane]:
            while self.next[lane] != seq:
                await self.turn[lane].wait()
            reply = await self._next_batch(lane)
            self.next[lane] += 1
            self.turn[lane].notify_all()
        return reply

    async def _next_batch(self, lane: int) -> bytes:
        try:
            batch = await self.streams[lane].receive()
        except anyio.EndOfStream:
            return self._reply("end")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            await self.finished.wait()
            return self._reply("error")
        return self._reply("batch", self.pack(lane, batch))

    def _reply(self, kind: str, batch: bytes = b"") -> bytes:
        stats = [s.statistics() for s in self.stores]
        counters = (sum(s.requests for s in stats), sum(s.retries for s in stats), sum(s.bytes_read for s in stats))
        error = self.error if kind == "error" else ("", "")
        if kind == "error" and not error[0]:
            error = ("ZephonError", "the lane actor stopped before its lanes ended")
        return _enc.encode(_Reply(kind, batch, self.skipped(), counters, error))


def size_tokenizer_pool(cpus: float, environ: Any = os.environ) -> None:
    """Give this actor's tokenizer pool the CPUs the actor reserves (`ray_num_cpus`, at least one
    thread) unless `RAYON_NUM_THREADS` sizes it (`engine.cpu.rayon_threads`): `tokenizers` would
    otherwise start a thread per core of the node in every actor, each with a glibc arena and a
    word cache of its own (see `backends.worker_environ`, which does the same for worker
    processes). Rayon reads it when the pool starts, at the process's first tokenizer call; the
    word caches are sized from it too."""
    if rayon_threads(environ) is None:
        environ["RAYON_NUM_THREADS"] = str(max(1, int(cpus)))


@functools.cache
def _actor_class() -> Any:
    import ray

    return ray.remote(_LaneActor)


# ---- the trainer side ---------------------------------------------------------------------------

@asynccontextmanager
async def run_ray(cfg: Config, plan: DataPlan, states: dict[int, LaneState],
                  wrap_store: Callable[[Store], Store] | None, wire: Wire) -> AsyncIterator[Any]:
    """Run `states`' lanes in Ray actors; yield (streams, credit, skipped, store counters, restarts)."""
    lanes = sorted(states)
    groups = [lanes[w::cfg.ray_actors] for w in range(min(cfg.ray_actors, len(lanes)))]
    async with ray_session(cfg, len(groups)):
        pool = _Actors(cfg, plan, wrap_store, wire, Supervision(cfg, states, groups))
        async with supervised(pool, lanes, len(groups), cfg.sample_buffer) as out:
            yield out


class _Actors:
    """The lane actors of one run: pulls under per-lane credits, and restarts of actors that die."""

    def __init__(self, cfg: Config, plan: DataPlan, wrap_store: Callable[[Store], Store] | None, wire: Wire,
                 sup: Supervision) -> None:
        self.cfg, self.wrap_store, self.wire, self.sup = cfg, wrap_store, wire, sup
        self.plan = msgspec.msgpack.encode(plan)  # encoded once: every actor start ships it
        self.png_text = png_text_limits(cfg)
        self.sends: dict[int, Any] = {}
        self.group_of = {lane: w for w, group in enumerate(sup.groups) for lane in group}
        self.actors: list[Any] = [None] * len(sup.groups)  # the live actor of each group (None while starting)
        self.inflight: dict[int, deque[Any]] = {}  # each lane's pulls, oldest first
        self.seq: dict[int, int] = {}  # each lane's next pull number at its live actor
        self.wake = {lane: anyio.Event() for lane in self.group_of}
        self.counters = [(0, 0, 0)] * len(sup.groups)
        self.counted_before = [(0, 0, 0)] * len(sup.groups)  # the reads of dead actors

    def credit(self, lane: int) -> None:
        """The sequencer took a batch of `lane`: pull one more (at the live actor, or at the next one)."""
        self.sup.credited(lane)
        if self.actors[self.group_of[lane]] is not None:
            self._pull(lane)

    def _pull(self, lane: int) -> None:
        actor = self.actors[self.group_of[lane]]
        self.inflight[lane].append(actor.pull.remote(lane, self.seq[lane]))
        self.seq[lane] += 1
        self.wake[lane].set()

    def store_statistics(self) -> StoreStatistics:
        sums = [sum(c[i] + b[i] for c, b in zip(self.counters, self.counted_before)) for i in range(3)]
        return StoreStatistics(requests=sums[0], retries=sums[1], bytes_read=sums[2])

    async def supervise(self, w: int) -> None:
        """Run actor `w` until its lanes end; start another where they stood when it dies."""
        while self.sup.live(w):
            actor = _actor_class().options(num_cpus=self.cfg.ray_num_cpus).remote(
                self.wire.run_local, self.wire.pack, self.wrap_store)
            try:
                died = await self._serve(w, actor)
            finally:
                self.actors[w] = None
                _kill(actor)
            if died is None:
                return
            self.sup.lost(w, f"Ray actor: {died}")
            self.counted_before[w] = tuple(a + b for a, b in zip(self.counted_before[w], self.counters[w]))
            self.counters[w] = (0, 0, 0)

    async def _serve(self, w: int, actor: Any) -> str | None:
        """Run `actor` for group `w` until its lanes end (None), or until it is lost (why)."""
        lanes = self.sup.live(w)
        started = actor.start.remote(_enc.encode((self.cfg, msgspec.Raw(self.plan), self.sup.states(w), self.png_text)))
        # the actor goes live and its lanes' credits become pulls in one step: no credit is lost
        self.actors[w] = actor
        for lane in lanes:
            self.inflight[lane], self.seq[lane] = deque(), 0
            for _ in range(self.sup.credits(lane)):
                self._pull(lane)
        died: list[str] = []
        async with anyio.create_task_group() as tg:
            async def watch(step: Callable[..., Any], *args: Any) -> None:
                try:
                    await step(*args)
                except _lost() as exc:
                    died.append(type(exc).__name__)
                    tg.cancel_scope.cancel()

            await watch(self._started, started)
            for lane in lanes if not died else []:
                tg.start_soon(watch, self._drain, w, lane)
        return died[0] if died else None

    async def _started(self, started: Any) -> None:
        with anyio.move_on_after(_START_TIMEOUT_S) as waited:
            await _get(started)
        if waited.cancelled_caught:
            raise ConfigError(f"Ray placed no lane actor in {_START_TIMEOUT_S} s: each asks for ray_num_cpus = "
                              f"{self.cfg.ray_num_cpus} CPUs; lower ray_num_cpus or ray_actors "
                              f"({self.cfg.ray_actors}), or add nodes to the cluster")

    async def _drain(self, w: int, lane: int) -> None:
        """Hand `lane`'s answers to its stream, in order, until it ends."""
        queue = self.inflight[lane]
        while True:
            if not queue:
                await self.wake[lane].wait()
                self.wake[lane] = anyio.Event()
                continue
            reply = _reply.decode(await _get(queue[0]))
            queue.popleft()
            self.counters[w] = reply.counters
            self.sup.set_skipped(w, reply.skipped)
            if reply.kind == "end":
                self.sup.ended.add(lane)
                await self.sends[lane].aclose()
                return
            if reply.kind != "batch":
                raise self.wire.error(*reply.error)
            samples = self.wire.unpack(reply.batch)
            self.sup.received(lane, samples)
            await self.sends[lane].send(samples)


def _lost() -> tuple[type[Exception], ...]:
    """Ray's errors for an actor that died or a reply that is gone: the actor is started again."""
    from ray.exceptions import ObjectLostError, RayActorError

    return RayActorError, ObjectLostError


async def _get(ref: Any) -> Any:
    """The value of a Ray object ref, waited for without blocking the event loop."""
    if _on_asyncio():
        return await ref
    import ray

    return await threads.run_sync(ray.get, ref, abandon_on_cancel=True)


def _on_asyncio() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another event loop (trio)
        return False
    return True


def _kill(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone, or Ray shut down: nothing left to stop
        pass


# ---- the Ray instance ---------------------------------------------------------------------------

@asynccontextmanager
async def ray_session(cfg: Config, actors: int) -> AsyncIterator[None]:
    """Ray, initialized in this process for the block: the one already initialized, the cluster at
    `ray_address`, or a local instance bound to 127.0.0.1 (started, and shut down after)."""
    ray = _import_ray()
    if ray.is_initialized():
        yield
        return
    temp = None if cfg.ray_address else tempfile.mkdtemp(prefix="zephon-ray-")  # short: Ray's socket paths
    owner = _Owner(functools.partial(_init, ray, cfg, actors, temp), ray.shutdown)
    try:
        await threads.run_sync(owner.start)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await threads.run_sync(owner.stop)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


class _Owner:
    """A thread of its own that starts Ray (`start`), lives while it runs, and shuts it down (`stop`).

    A local Ray's GCS and raylet are started with `PR_SET_PDEATHSIG = SIGKILL`, which Linux sends
    when the *thread* that started them ends, not the process. Started from a worker thread of
    the pool, they were killed silently as soon as that worker had been idle for
    `threads.IDLE_SECONDS`, and every actor call then failed once Ray gave up on its GCS.
    """

    def __init__(self, start: Callable[[], None], stop: Callable[[], None]) -> None:
        self._start, self._stop = start, stop
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._stop_error: BaseException | None = None
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zephon-ray-owner", daemon=True)

    def start(self) -> None:
        """Start Ray on the owner thread (blocking); raise what starting it raised."""
        self._thread.start()
        self._started.result()

    def stop(self) -> None:
        """Shut Ray down on the owner thread, which then ends (blocking); raise what that raised."""
        self._go.set()
        self._thread.join()
        if self._stop_error is not None:
            raise self._stop_error

    def _run(self) -> None:
        try:
            self._start()
        except BaseException as exc:
            self._started.set_exception(exc)
            return
        self._started.set_result(None)
        self._go.wait()
        try:
            self._stop()
        except BaseException as exc:
            self._stop_error = exc


def _init(ray: Any, cfg: Config, actors: int, temp: str | None) -> None:
    import logging

    quiet = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": True}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report sent anywhere
    try:
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, **quiet)
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private instance on loopback: no token to hand out
        cpus = max(os.cpu_count() or 1, math.ceil(actors * cfg.ray_num_cpus))  # the actors always fit
        ray.init(num_cpus=cpus, _temp_dir=temp, _node_ip_address="127.0.0.1", **quiet)
    except Exception as exc:  # Ray's own errors: ConnectionError, RuntimeError, ValueError ...
        where = f"the Ray cluster at ray_address = {cfg.ray_address!r}" if cfg.ray_address else "a local Ray"
        raise ConfigError(f'backend "ray" could not start {where}: {type(exc).__name__}: {exc}; check that the '
                          'cluster runs (`ray status`), or use backend "processes"') from exc


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError('backend "ray" needs Ray: pip install "zephon-stream[ray]" (or use backend '
                          '"processes")') from exc
    return ray
