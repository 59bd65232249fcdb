"""The operator protocol: one shape for every stateful stage of a lane.

```
op = Shuffle(size=64, seed=7, lane=3, upstream=mix)
item = await op.next()             # the next item, or None when the upstream has ended
snap = op.state()                  # a small frozen msgspec Struct: counters, cursors, references
...
again = Shuffle(size=64, seed=7, lane=3, upstream=mix_again)
again.restore(snap, resolve)       # set back; `resolve(ref)` gives an item that `refs(snap)` named
```

A state holds references to items (`refs(state)`), never the items: whoever restores re-reads
the referenced items (a bounded number) and passes them through `resolve`. So a checkpoint is
small whatever the payloads, and restore never replays the stream. `restore` checks its state
against the operator's configuration and `refuse`s it (IncompatibleState) naming the field.

Flink's rule holds: the methods of one operator are never called concurrently. Operators know
nothing of ranks, processes, stores or credentials.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NoReturn, Protocol, TypeVar

from zephon_stream.errors import IncompatibleState

__all__ = ["Operator", "Ref", "Resolve", "refuse"]

T = TypeVar("T", covariant=True)
Ref = Hashable
Resolve = Callable[[Any], Any]


class Operator(Protocol[T]):
    async def next(self) -> T | None:
        """The next item, or None at the end (and every time after)."""
        ...

    def state(self) -> Any:
        """The state right after the last item handed out: a frozen msgspec Struct."""
        ...

    def refs(self, state: Any) -> list[Any]:
        """The items `state` refers to, which `restore` will ask `resolve` for."""
        ...

    def restore(self, state: Any, resolve: Resolve) -> None:
        """Set the operator back to `state` (before its first `next`)."""
        ...


def refuse(field: str, value: object, why: str) -> NoReturn:
    """Refuse a state in `restore`: `IncompatibleState("field = value: why")` (the lane adds which lane)."""
    raise IncompatibleState(f"{field} = {value!r}: {why}")
