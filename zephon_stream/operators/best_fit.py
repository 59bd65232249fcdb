"""BestFitPack (`packing = "best_fit"`): whole documents, chosen best-fit from a bounded window.

```
docs:     a:5  b:6  c:2  d:3  e:12  f:1  g:4        (length after ':'; seq_len = 8, packing_window = 3)
window:   [a b c]      a, the oldest, opens sample 1 (3 left); refilled: [b c d]; d (3) fits best
samples:  [a a a a a d d d]  [b b b b b b c c]  [e e e e g g g g]  [e e e e e e e e]  [f . . . . . . .]
document_ids: 0 0 0 0 0 1 1 1 ...                   [0 0 0 0 1 1 1 1]                    [0 -1 -1 ...]
```

A sample opens with the oldest piece of the window, then takes, while space is left, the
largest piece that fits in it (ties: the oldest); the window is topped up from upstream after
every piece taken. So a sample is a pure function of the window's contents, and every document
leaves the window within the samples its older pieces fill (within `window` samples for
documents no longer than `seq_len`): no periodic flush is needed, and none happens.

A document longer than `seq_len` is cut into pieces, never dropped: its first piece is what is
left over of whole `seq_len` pieces (`e` above: 12 = 4 + 8), packed like a short document; the
`seq_len` pieces after it fill samples of their own, and the oldest such piece opens the next
sample before anything else, so a long document never holds its place in the window for long.
(Cutting whole pieces first would leave them waiting in the window, unfit for any gap, until they
are the oldest: simulated on lengths like the tests' - 40% of documents up to 4.7 x seq_len -
that pads 3-9% where this pads 0.3-2%, windows 256 to 8.) Labels are each token's
target in its document (`pack.assemble`), so the last label of a piece is the first token of the
next piece. At the end of the data (`max_epochs > 0`) the window drains.

The state is the window: `(document reference, offset of its next piece)` per entry, in window
order; restore re-reads those documents, so a checkpoint holds at most `window` references,
whatever the data.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.operators.pack import Cut, PackState, assemble, check_counters, check_piece
from zephon_stream.operators.types import Doc, DocRef, Sample

__all__ = ["BestFitPack"]


class BestFitPack:
    def __init__(self, seq_len: int, pad_id: int, mask_cross_document: bool, window: int,
                 upstream: Operator[Doc]) -> None:
        if seq_len < 2:
            raise ValueError(f"BestFitPack seq_len must be >= 2, got {seq_len}")
        if window < 1:
            raise ValueError(f"BestFitPack window must be >= 1 document, got {window}")
        self.seq_len, self.pad_id, self.mask, self.size = seq_len, pad_id, mask_cross_document, window
        self.upstream = upstream
        self._clear()

    def _clear(self) -> None:
        # The window by arrival number (a dict keeps insertion order: oldest first), each entry's
        # (next piece's length, -arrival) sorted, so the best fit is one bisection (ties: the
        # oldest), and the long documents under way (their next piece is a whole seq_len).
        self.window: dict[int, tuple[Doc, int]] = {}  # arrival -> (document, offset of its next piece)
        self._sizes: list[tuple[int, int]] = []
        self._started: set[int] = set()
        self._arrivals = 0
        self._ended = False

    def __repr__(self) -> str:
        return f"BestFitPack(seq_len={self.seq_len}, window={self.size}, mask_cross_document={self.mask})"

    async def next(self) -> Sample | None:
        await self._fill()
        if not self.window:
            return None
        # the oldest long document under way, else the oldest
        cuts = [self._take(min(self._started) if self._started else next(iter(self.window)))]
        free = self.seq_len - cuts[0].take
        while free:
            await self._fill()
            best = self._best(free)
            if best is None:
                break
            cuts.append(self._take(best))
            free -= cuts[-1].take
        return assemble(cuts, self.seq_len, self.pad_id, self.mask)

    async def _fill(self) -> None:
        while not self._ended and len(self.window) < self.size:
            doc = await self.upstream.next()
            if doc is None:
                self._ended = True
            else:
                self._add(doc, 0)

    def _add(self, doc: Doc, offset: int) -> None:
        self._arrivals += 1
        self._place(self._arrivals, doc, offset)

    def _place(self, key: int, doc: Doc, offset: int) -> None:
        self.window[key] = (doc, offset)  # a key already there keeps its place in the order
        insort(self._sizes, (self._piece(doc, offset), -key))
        if offset:
            self._started.add(key)

    def _best(self, free: int) -> int | None:
        """The arrival number of the largest piece that fits in `free` tokens (the oldest of equals)."""
        i = bisect_right(self._sizes, (free, 0))  # past every (piece <= free, -arrival < 0)
        return -self._sizes[i - 1][1] if i else None

    def _piece(self, doc: Doc, offset: int) -> int:
        """The length of the next piece of `doc` from `offset`: pieces end at `len - k * seq_len`."""
        return (len(doc[1]) - offset) % self.seq_len or self.seq_len

    def _take(self, key: int) -> Cut:
        """Take the next piece of the document that arrived `key`-th; the rest keeps its place."""
        doc, offset = self.window[key]
        take = self._piece(doc, offset)
        del self._sizes[bisect_left(self._sizes, (take, -key))]
        self._started.discard(key)
        if offset + take == len(doc[1]):
            del self.window[key]
        else:
            self._place(key, doc, offset + take)
        return Cut(doc, offset, take)

    def state(self) -> PackState:
        return PackState(None, 0, [(doc[0], offset) for doc, offset in self.window.values()])

    def refs(self, state: PackState) -> list[DocRef]:
        return [tuple(ref) for ref, _ in state.window]

    def restore(self, state: PackState, resolve: Resolve) -> None:
        check_counters(state, window=True, truncate=False)
        if state.carry is not None or state.offset:
            refuse("pack.carry", (state.carry, state.offset), 'packing = "best_fit" carries nothing but its window')
        refs = self.refs(state)
        if len(refs) > self.size:
            refuse("pack.window", f"{len(refs)} documents", f"holds at most packing_window = {self.size}")
        if len(set(refs)) != len(refs):
            refuse("pack.window", refs, "refers to the same document twice")
        window = [(resolve(ref), offset) for ref, (_, offset) in zip(refs, state.window)]
        for i, (doc, offset) in enumerate(window):
            check_piece(f"pack.window[{i}]", doc, offset, self.seq_len, "the document", from_end=True)
        self._clear()
        for doc, offset in window:
            self._add(doc, offset)
