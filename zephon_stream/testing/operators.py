"""The save/restore round trip every operator passes (grain's and torchdata's midpoint checks).

```
await assert_roundtrip(lambda: chain_of_operators(), resolve=docs.__getitem__)
```

`make()` builds a fresh chain of operators, upstream first, the operator under test last. For
every point `k` of the whole run (0, each item, and past the end) the check takes a chain `k`
items in, snapshots the state of every operator of the chain, sends each state through msgpack, and
restores a fresh chain from them; that chain gives one item and is snapshot and restored once
more (resume twice). The items after `k` must be the ones the uninterrupted run gave.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import msgspec
import numpy as np

from zephon_stream.engine.operator import Operator, Resolve

__all__ = ["ListSource", "ListSourceState", "assert_roundtrip", "item_key"]


class ListSourceState(msgspec.Struct, frozen=True, array_like=True):
    index: int


class ListSource:
    """An upstream operator over a fixed list of items: the fake source of operator tests."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items, self.index = list(items), 0

    def __repr__(self) -> str:
        return f"ListSource({len(self.items)} items)"

    async def next(self) -> Any:
        if self.index >= len(self.items):
            return None
        self.index += 1
        return self.items[self.index - 1]

    def state(self) -> ListSourceState:
        return ListSourceState(self.index)

    def refs(self, state: ListSourceState) -> list[Hashable]:
        return []

    def restore(self, state: ListSourceState, resolve: Resolve) -> None:
        self.index = state.index


def item_key(item: Any) -> Any:
    """A comparable form of a document, a sample or anything with numpy arrays inside."""
    if item is None or isinstance(item, (int, str, bytes)):
        return item
    if isinstance(item, np.ndarray):
        return (str(item.dtype), item.tobytes())
    if isinstance(item, (tuple, list)):
        return tuple(item_key(x) for x in item)
    slots = getattr(type(item), "__slots__", ())
    return tuple((name, item_key(getattr(item, name))) for name in slots if name not in ("state", "lane", "index"))


async def assert_roundtrip(make: Callable[[], Sequence[Operator[Any]]], *, resolve: Resolve,
                           limit: int = 10_000) -> int:
    """Check save/restore at every point of `make()`'s run; returns the number of items checked."""
    full = await _drain(make()[-1], limit)
    want = [item_key(x) for x in full]
    for k in range(len(full) + 2):  # past the end too: the end is a state like any other
        chain = make()
        head = [await chain[-1].next() for _ in range(k)]
        resumed = _restored(make(), _snapshot(chain), resolve)
        first = await resumed[-1].next()
        again = _restored(make(), _snapshot(resumed), resolve)  # resume twice
        rest = ([first] if first is not None else []) + await _drain(again[-1], limit)
        got = [item_key(x) for x in head[:len(full)] + rest]
        assert got == want, f"{resumed[-1]!r}: resuming after {k} items changed the items after it"
    return len(full)


def _snapshot(chain: Sequence[Operator[Any]]) -> list[tuple[type, bytes]]:
    return [(type(s), msgspec.msgpack.encode(s)) for s in (op.state() for op in chain)]


def _restored(chain: Sequence[Operator[Any]], states: list[tuple[type, bytes]],
              resolve: Resolve) -> Sequence[Operator[Any]]:
    for op, (kind, raw) in zip(chain, states, strict=True):
        state = msgspec.msgpack.decode(raw, type=kind)
        for ref in op.refs(state):
            resolve(ref)  # every reference must resolve
        op.restore(state, resolve)
    return chain


async def _drain(op: Operator[Any], limit: int) -> list[Any]:
    out = []
    while (item := await op.next()) is not None:
        out.append(item)
        assert len(out) <= limit, f"{op!r} produced more than {limit} items"
    return out
