"""Publishing from inside a trainer's event loop while training goes on.

A publish reads the weights for as long as it encodes and uploads them, but the trainer wants
to take its next step at once. `PublishLoop` takes a snapshot of the state (a copy into one
reused CPU buffer, in worker threads, `piece_bytes` at a time) and publishes the snapshot in
the background, on the trainer's own loop::

    async with PublishLoop(Publisher(uri)) as publishing:   # or a publisher already entered
        async for batch in stream:                      # the loader, on the same loop
            await anyio.to_thread.run_sync(train_step, batch)
            if step % k == 0:
                await publishing.submit(model.state_dict())   # returns once the snapshot is taken

At most one publish is in flight: `submit` first waits for the previous one (backpressure: a
trainer that publishes faster than the store takes versions slows down instead of queueing
copies of the model). Memory: the model, the snapshot and the publisher's shadow (three copies
on CPU; the model's own may be on the GPU). Every CPU step (copy, XOR, zstd, hash) runs in the
publisher's `threads`; the event loop only schedules them and does the uploads' I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType

import anyio
import msgspec
import torch
from anyio.abc import TaskGroup

from zephon_stream.errors import unwrap_groups
from zephon_stream.refit.layout import TensorTable, check_count
from zephon_stream.refit.manifest import check_publishable
from zephon_stream.refit.publisher import Publisher, VersionInfo, copy_state

__all__ = ["PublishLoop", "PublishStatistics"]


class PublishStatistics(msgspec.Struct, frozen=True):
    """What a PublishLoop has done: versions published, seconds spent snapshotting, publishing,
    and waiting in `submit` for the previous publish (the trainer's only stall)."""

    published: int
    in_flight: bool
    last: VersionInfo | None
    snapshot_s: float
    publish_s: float
    waited_s: float


class PublishLoop:
    """Publish snapshots of a live state in the background, one at a time (an async context manager)."""

    def __init__(self, publisher: Publisher, *, piece_bytes: int = 64 << 20,
                 on_published: Callable[[VersionInfo, float], None] | None = None) -> None:
        check_count("piece_bytes", piece_bytes, 1)
        self.publisher, self.piece_bytes, self.on_published = publisher, piece_bytes, on_published
        self._tg: TaskGroup | None = None
        self._opened = False
        self._idle = anyio.Event()
        self._idle.set()
        self._buffer: dict[str, torch.Tensor] = {}
        self._published, self._last = 0, None
        self._snapshot_s = self._publish_s = self._waited_s = 0.0

    def __repr__(self) -> str:
        return f"PublishLoop({self.publisher!r}, piece_bytes={self.piece_bytes})"

    async def __aenter__(self) -> PublishLoop:
        self._opened = not self.publisher.is_open  # a publisher the caller has not entered: ours to open and close
        if self._opened:
            await self.publisher.__aenter__()
        self._tg = await anyio.create_task_group().__aenter__()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        try:
            with unwrap_groups():  # a failed publish raises as itself
                return await tg.__aexit__(et, e, tb)  # waits for the publish in flight
        finally:
            if self._opened:
                await self.publisher.__aexit__(None, None, None)

    async def submit(self, state: Mapping[str, torch.Tensor]) -> None:
        """Snapshot `state` and start publishing it; returns once `state` may change again."""
        if self._tg is None:
            raise RuntimeError("PublishLoop.submit outside `async with PublishLoop(...)`")
        pub = self.publisher  # a layout no version can hold is refused here, not in the background publish
        check_publishable(TensorTable.from_local(state, pub.sharding), pub.sharding, pub.chunk_bytes)
        t = time.perf_counter()
        await self._idle.wait()
        self._idle = anyio.Event()
        t1 = time.perf_counter()
        try:
            self._buffer = await copy_state(state, self._buffer, self.publisher._cpu, self.piece_bytes)
        except BaseException:
            self._idle.set()
            raise
        self._waited_s += t1 - t
        self._snapshot_s += time.perf_counter() - t1
        self._tg.start_soon(self._publish, self._buffer)

    async def drain(self) -> VersionInfo | None:
        """Wait for the publish in flight, if any; returns the newest version published."""
        await self._idle.wait()
        return self._last

    @property
    def snapshot(self) -> Mapping[str, torch.Tensor]:
        """The CPU copy last submitted: the version being (or last) published. Read it, never
        write it; the next `submit` overwrites it once the publish in flight is done."""
        return self._buffer

    def statistics(self) -> PublishStatistics:
        return PublishStatistics(self._published, not self._idle.is_set(), self._last, self._snapshot_s,
                                 self._publish_s, self._waited_s)

    async def _publish(self, snapshot: dict[str, torch.Tensor]) -> None:
        t = time.perf_counter()
        try:
            info = await self.publisher.publish(snapshot)
            self._publish_s += time.perf_counter() - t
            self._published, self._last = self._published + 1, info
            if self.on_published is not None:
                self.on_published(info, time.time())
        finally:
            self._idle.set()
