"""A restore's documents: read again at once, tokenized in the order the lane needs them.

A lane state refers to documents (a shuffle window, the packer's carry or window); restoring
re-reads them. Reading and decoding them is cheap next to tokenizing them, so the lane reads
every one first (one pass over each split involved) and hands their records to a `Reread`,
which tokenizes:

- at once (`load`), what an operator needs whole in `restore` (the packer's documents);
- when first asked (`fetch`), a shuffle window's documents: the window holds them as
  `Deferred` payloads and fetches one when a pull takes it. A fetch tokenizes that document
  and the next ones of its source in need order (`Shuffle.refs` lists a window that way), in
  chunks that double from `first_chunk` up to the source's batch size.

```
need order  w17 w3 w40 w8 w22 w5 w61 ...   (the window's documents, as the next pulls take them)
fetch(w17): tokenize [w17]                 first pull: one tokenizer call of one document
fetch(w3):  tokenize [w3 w40]              the next chunk, twice as long
fetch(w40): already there
```

So the first sample after a restore waits for the few documents its pulls take, not the
whole window; what the lane yields does not change (payloads are the same either way).
Memory: the records of the documents not tokenized yet, bounded by the window sizes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from zephon_stream.errors import IncompatibleState
from zephon_stream.operators.shuffle import Deferred
from zephon_stream.operators.types import Doc, DocRef

__all__ = ["Reread", "interleave"]

Tokenize = Callable[[int, list[Doc]], Awaitable[list[Doc]]]  # (source, [(ref, record)]) -> [(ref, tokens)]


class Reread:
    """Records of re-read documents (`{ref: record}`, in need order), tokenized on demand.

    `tokenize(source, docs)` tokenizes documents of one source; `batch(source)` is the most
    documents a call takes; `refused(detail)` makes the lane's IncompatibleState. Its methods
    are called from the lane's one task, never concurrently.
    """

    def __init__(self, records: dict[DocRef, Any], tokenize: Tokenize, batch: Callable[[int], int],
                 refused: Callable[[str], IncompatibleState], first_chunk: int = 1) -> None:
        self._todo = dict(records)  # not tokenized yet, in need order
        self._ready: dict[DocRef, Any] = {}  # tokenized, not handed out yet
        self._tokenize, self._batch, self._refused = tokenize, batch, refused
        self._chunk = max(1, first_chunk)
        self.calls = 0  # tokenizer calls made (for tests and statistics)

    def __repr__(self) -> str:
        return f"Reread({len(self._todo)} to tokenize, {len(self._ready)} ready)"

    async def load(self, refs: Iterable[DocRef]) -> None:
        """Tokenize `refs` now (by source, a call per batch), for `now`."""
        by_source: dict[int, list[DocRef]] = {}
        for ref in refs:
            if ref in self._todo:
                by_source.setdefault(ref[0], []).append(ref)
        for source, mine in by_source.items():
            step = self._batch(source)
            for i in range(0, len(mine), step):
                await self._run(source, mine[i:i + step])

    def now(self, ref: DocRef) -> Doc:
        """The document `ref`, tokenized by `load` (a `Resolve` for operators that need it whole)."""
        ref = tuple(ref)
        if ref not in self._ready:
            raise self._refused(f"of a checkpoint's document {ref}: it was not loaded before the restore "
                                "that needs it (a bug: report it)")
        return ref, self._ready[ref]

    def later(self, ref: DocRef) -> Doc:
        """The document `ref`, its payload `Deferred` unless already tokenized (a `Resolve` for windows)."""
        ref = tuple(ref)
        if ref in self._ready:
            return ref, self._ready.pop(ref)
        return ref, Deferred(self.fetch)

    async def fetch(self, ref: DocRef) -> Any:
        """The tokens of `ref`, tokenizing it and the next documents of its source in need order."""
        if ref not in self._ready:
            if ref not in self._todo:
                raise self._refused(f"of a checkpoint's document {ref}: fetched twice (a bug: report it)")
            size = min(self._chunk, self._batch(ref[0]))
            self._chunk *= 2
            following = (r for r in self._todo if r[0] == ref[0] and r != ref)
            await self._run(ref[0], [ref, *(r for _, r in zip(range(size - 1), following))])
        return self._ready.pop(ref)

    async def _run(self, source: int, refs: list[DocRef]) -> None:
        docs = [(ref, self._todo.pop(ref)) for ref in refs]
        self.calls += 1
        tokens = dict(await self._tokenize(source, docs))
        lost = [ref for ref in refs if ref not in tokens]
        if lost:  # the first run tokenized these: a skipped record here means other data or another tokenizer
            raise self._refused(f"window or carry = {lost[:3]}: these documents of source {source} no longer "
                                "tokenize (skipped as bad records)")
        self._ready.update(tokens)


def interleave(orders: list[list[DocRef]]) -> list[DocRef]:
    """One need order from several (one per window): their first documents, then their seconds, ..."""
    out = []
    for i in range(max(map(len, orders), default=0)):
        out += [order[i] for order in orders if i < len(order)]
    return out
