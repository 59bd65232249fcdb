"""SinglePack (`packing = "none"`): one document per sample, padded.

```
docs:      a:3  b:10  c:5                           (length after ':'; seq_len = 4)
samples:   [a a a .]  [b b b b]  [b b b b]  [b b . .]  [c c c c]  [c . . .]
truncate:  [a a a .]  [b b b b]  [c c c c]          (b: 1 document, 6 tokens dropped; c: 1, 1)
```

A document longer than `seq_len` is cut into `seq_len` pieces, one per sample; with `truncate`
only its first piece is kept, and the documents cut and the tokens dropped are counted in the
state (`PackState.truncated`, `.dropped`), so `Loader.statistics()` reports them for exactly the
samples consumed, across resumes. Labels are each token's target in its document
(`pack.assemble`): a piece's last label is the document's next token, also when truncating.
The state is the document being cut and its offset.
"""

from __future__ import annotations

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.operators.pack import Cut, PackState, assemble, check_counters, check_piece
from zephon_stream.operators.types import Doc, DocRef, Sample

__all__ = ["SinglePack"]


class SinglePack:
    def __init__(self, seq_len: int, pad_id: int, truncate: bool, upstream: Operator[Doc]) -> None:
        if seq_len < 2:
            raise ValueError(f"SinglePack seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.pad_id, self.truncate, self.upstream = seq_len, pad_id, truncate, upstream
        self.carry: Doc | None = None
        self.offset = self.truncated = self.dropped = 0

    def __repr__(self) -> str:
        return f"SinglePack(seq_len={self.seq_len}, truncate={self.truncate})"

    async def next(self) -> Sample | None:
        if self.carry is None:
            self.carry, self.offset = await self.upstream.next(), 0
            if self.carry is None:
                return None
        doc, n = self.carry, len(self.carry[1])
        cut = Cut(doc, self.offset, min(self.seq_len, n - self.offset))
        self.offset += cut.take
        if self.truncate and self.offset < n:
            self.truncated, self.dropped = self.truncated + 1, self.dropped + n - self.offset
            self.offset = n
        if self.offset == n:
            self.carry, self.offset = None, 0
        return assemble([cut], self.seq_len, self.pad_id, True)

    def state(self) -> PackState:
        return PackState(self.carry[0] if self.carry else None, self.offset, [], self.truncated, self.dropped)

    def refs(self, state: PackState) -> list[DocRef]:
        return [tuple(state.carry)] if state.carry is not None else []

    def restore(self, state: PackState, resolve: Resolve) -> None:
        check_counters(state, window=False, truncate=self.truncate)
        carry = None
        if state.carry is None:
            if state.offset:
                refuse("pack.offset", state.offset, "must be 0 when no document is carried")
        elif self.truncate:
            refuse("pack.carry", tuple(state.carry), "with truncate a document is never carried past its sample")
        else:
            carry = resolve(tuple(state.carry))
            check_piece("pack.offset", carry, state.offset, self.seq_len)
        self.carry, self.offset = carry, state.offset
        self.truncated, self.dropped = state.truncated, state.dropped
