"""torch.distributed helpers: an overlapped host-to-device stage and global-batch digests.

```
loader = Loader(config)                       # dp_rank/dp_size from the default process group
feed = ToDevice(loader, "cuda")               # pinned, copied on a side stream, one batch ahead
for batch in feed:
    loss = model(batch["input_ids"]) ...
    dcp.save({"model": ..., "loader": feed}, checkpoint_id=...)   # checkpoint `feed`, not `loader`
    feed.set_weights({"web": 0.7, "code": 0.3}, at_step=batch["step"] + 1)   # `feed`'s, not `loader`'s
    digest = global_batch_digest(batch)       # a collective: every DP rank calls it; rank 0 gets it
```

Read-ahead and checkpoints: `ToDevice` takes batch n+1 out of the loader before it hands out
batch n, so the loader's own state is one batch ahead of the trainer. `ToDevice.state_dict()`
is the loader's state right after the last batch it handed out, which is what a resume needs.
`ToDevice.set_weights()` likewise takes any step not yet handed out: for a step read ahead, it
puts the loader back where the trainer is and reads those batches again with the new weights.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from zephon_stream.errors import ConfigError

__all__ = ["ToDevice", "batch_digest", "global_batch_digest"]

Batch = dict[str, Any]


class ToDevice:
    """The batches of `loader` on `device`, with the host-to-device copy overlapping the step.

    On CUDA each batch's tensors are put in pinned memory and copied with `non_blocking=True` on
    a side stream; an event recorded after the copy is waited on by the consuming stream only
    when the batch is handed out, so batch n+1's copy runs while the trainer computes on batch n
    (`ahead` batches are in flight; default 1). On any other device (CPU) a batch passes through
    unchanged; `ahead` defaults to 0 there and may be set to exercise the read-ahead path.

    It is a torch.distributed.checkpoint Stateful: `state_dict()` is the loader's state after the
    last batch handed out (not after the read-ahead); `load_state_dict()` passes to the loader.
    """

    def __init__(self, loader: Any, device: str | torch.device | None = None, *,
                 ahead: int | None = None) -> None:
        self.loader = loader
        self.device = torch.device(device if device is not None else "cpu")
        self.cuda = self.device.type == "cuda"
        self.ahead = (1 if self.cuda else 0) if ahead is None else ahead
        if self.ahead < 0:
            raise ValueError(f"ahead={ahead}: must be >= 0 (batches copied before the current one is used)")
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._state: dict[str, bytes] | None = None  # the loader's state after the last batch handed out
        # while iterating: the loader's iteration, and the batches read ahead (with the state after each)
        self._batches: Iterator[Batch] | None = None
        self._window: collections.deque[tuple[Batch, Any, dict[str, bytes]]] = collections.deque()

    def __repr__(self) -> str:
        return f"ToDevice({self.loader!r}, device={str(self.device)!r}, ahead={self.ahead})"

    def state_dict(self) -> dict[str, bytes]:
        return self._state if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.loader.load_state_dict(state_dict)
        self._state = None

    def set_weights(self, weights: Any, at_step: int) -> None:
        """`Loader.set_weights` from the trainer's point of view: `at_step` may be any step not yet
        handed out, also one this feed has read ahead (`loader.set_weights` refuses those: the
        loader has consumed them). The batches read ahead are then dropped and read again from the
        last one handed out, with the decision (and any made since) in the loader's log. Call it
        from the loop's thread, between batches."""
        if self._batches is not None and self._window:
            self.loader._decision(weights, at_step)  # a bad call changes nothing
            handed = self._window[0][0]["step"]  # the next batch to hand out
            if at_step < handed:
                raise ConfigError(f"set_weights(at_step={at_step}): step {at_step} was already handed out (this "
                                  f"feed has handed out batches 0..{handed - 1}); decide for a step >= {handed}, "
                                  "the next batch's")
            if at_step < self.loader.step:  # read ahead: read again from the last batch handed out
                log = list(self.loader.decisions)
                self._put_back()
                assert log[:len(self.loader.decisions)] == self.loader.decisions  # the log then, and since
                for entry in log[len(self.loader.decisions):]:  # decided after that batch was read
                    self.loader.set_weights(entry.weights, at_step=entry.step)
                self._batches = iter(self.loader)
        self.loader.set_weights(weights, at_step=at_step)

    def __iter__(self) -> Iterator[Batch]:
        self._state = self.loader.state_dict()
        self._window.clear()
        self._batches = iter(self.loader)
        try:
            while True:
                while len(self._window) <= self.ahead and (batch := next(self._batches, None)) is not None:
                    self._window.append((*self._start_copy(batch), self.loader.state_dict()))
                if not self._window:
                    return
                yield self._hand_out(*self._window.popleft())
        finally:
            self._put_back()  # what was read ahead, never handed out, the next iteration sends again
            self._batches = None

    def _put_back(self) -> None:
        """Close the loader's iteration and drop the read-ahead: the loader is back after the last
        batch handed out."""
        assert self._batches is not None and self._state is not None
        self._batches.close()
        if self._window:
            self._window.clear()
            self.loader.load_state_dict(self._state)

    def _start_copy(self, batch: Batch) -> tuple[Batch, Any]:
        if not self.cuda:
            return batch, None
        with torch.cuda.stream(self._stream):
            moved = {k: v.pin_memory().to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                     for k, v in batch.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        return moved, event

    def _hand_out(self, batch: Batch, event: Any, state: dict[str, bytes]) -> Batch:
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for v in batch.values():
                if torch.is_tensor(v):  # allocated on the side stream, used on this one
                    v.record_stream(current)
        self._state = state
        return batch


def batch_digest(input_ids: torch.Tensor, slots: Iterable[int] | torch.Tensor | None = None) -> str:
    """SHA-256 of `input_ids` rows as little-endian uint32, rows sorted by slot if `slots` is given."""
    ids = input_ids.detach().cpu().numpy()
    if slots is not None:
        ids = ids[np.argsort(np.asarray(torch.as_tensor(slots).cpu()), kind="stable")]
    return hashlib.sha256(np.ascontiguousarray(ids.astype("<u4")).tobytes()).hexdigest()


def global_batch_digest(batch: Batch, group: Any = None) -> str | None:
    """The `batch_digest` of the whole global batch, on rank 0 of the DP `group`; None elsewhere.

    A collective over `group` (default: the default process group, if initialized): every rank of
    the group calls it for the same step. Tensor/pipeline peers pass their DP group. Without an
    initialized process group it digests `batch` alone (a single-process run's global batch).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return batch_digest(batch["input_ids"], batch["slots"])
    rows = torch.cat([batch["slots"].reshape(-1, 1), batch["input_ids"]], dim=1).to(torch.int64)
    rows = rows.to(_collective_device(group, rows.device))
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))] if first else None
    dist.gather(rows, parts, group=group, group_dst=0)
    if not first:
        return None
    everything = torch.cat(parts)
    return batch_digest(everything[:, 1:], everything[:, 0])


def _collective_device(group: Any, device: torch.device) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device
