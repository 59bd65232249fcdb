"""Pack: concatenate documents and cut the stream into `seq_len` samples; nothing is dropped.

```
docs:     [a a a a E][b b E][c c c c c c c E]      (E = EOS, appended by tokenize)
samples:  [a a a a E b]  [b E c c c c]  [c c c E . .]     seq_len = 6, '.' = padding at the end
labels:   [a a a E - b]  [E - c c c c]  [c c E - - -]     '-' = -100 (across a document, or padding)
position: [0 1 2 3 4 0]  [0 1 0 1 2 3]  [0 1 2 3 0 0]
```

Labels are the next token of the stream; with `mask_cross_document` the label of a document's
last token (its EOS) is -100. `position_ids` restart at every document and at every sample
start; `segments` are the document pieces inside the sample (for `cu_seqlens`), `sources` the
source of each piece. The only state
is the document being cut (`carry`) and how many of its tokens were emitted.

An image+text document (`ImageDoc`) starts with its image span, which is never cut: when the
span does not fit in what is left of a sample, the sample ends there (padded) and the span
opens the next one. Its caption may run on into the next sample like any text. A label whose
target lies in an image span is -100, and `token_types` marks the image placeholders.

```
docs:     [T T E][s i i i e c c E]                 (s, e = vision start/end, i = image, c = caption)
samples:  [T T E . . .]  [s i i i e c]  [c E ...]  seq_len = 6: the span (5) does not fit after 3
labels:   [T E - - - -]  [- - - - c c]  [E - ...]
```
"""

from __future__ import annotations

import msgspec
import numpy as np

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.operators.types import IGNORE, Doc, DocRef, ImageDoc, Sample

__all__ = ["IGNORE", "Pack", "PackState"]


class PackState(msgspec.Struct, frozen=True, array_like=True):
    carry: DocRef | None  # the document being cut
    offset: int  # its tokens already packed


class Pack:
    def __init__(self, seq_len: int, pad_id: int, mask_cross_document: bool, upstream: Operator[Doc]) -> None:
        if seq_len < 2:
            raise ValueError(f"Pack seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.pad_id, self.mask, self.upstream = seq_len, pad_id, mask_cross_document, upstream
        self.carry: Doc | None = None
        self.offset = 0
        self._arange = np.arange(seq_len, dtype=np.int32)

    def __repr__(self) -> str:
        return f"Pack(seq_len={self.seq_len}, mask_cross_document={self.mask})"

    async def next(self) -> Sample | None:
        n = self.seq_len
        ids = np.full(n, self.pad_id, dtype=np.uint32)
        positions = np.zeros(n, dtype=np.int32)
        segments: list[int] = []
        sources: list[int] = []
        ends: list[bool] = []
        spans: list[tuple[int, ImageDoc]] = []  # (where in the sample, document) of each image span
        filled = 0
        while filled < n:
            if self.carry is None:
                self.carry, self.offset = await self.upstream.next(), 0
                if self.carry is None:
                    break
            tokens = self.carry[1]
            if isinstance(tokens, ImageDoc) and self.offset == 0:
                if tokens.span > n - filled:  # never cut an image span: it opens the next sample
                    break
                spans.append((filled, tokens))
            take = min(n - filled, len(tokens) - self.offset)
            ids[filled:filled + take] = tokens[self.offset:self.offset + take]
            positions[filled:filled + take] = self._arange[:take]
            filled += take
            self.offset += take
            segments.append(take)
            sources.append(self.carry[0][0])
            ends.append(self.offset == len(tokens))
            if ends[-1]:
                self.carry = None
        if filled == 0:
            return None
        labels = np.full(n, IGNORE, dtype=np.int32)
        labels[:filled - 1] = ids[1:filled]
        if filled == n:
            if self.carry is None:
                self.carry, self.offset = await self.upstream.next(), 0  # the last label is the next token
            if self.carry is not None:
                nxt = self.carry[1]
                in_span = isinstance(nxt, ImageDoc) and self.offset < nxt.span
                labels[n - 1] = IGNORE if in_span else int(nxt[self.offset])
        if self.mask:
            doc_ends = np.cumsum(segments)[np.asarray(ends)] - 1
            labels[doc_ends] = IGNORE
        if not spans:
            return Sample(ids, labels, positions, segments, filled, sources=sources)
        types = np.zeros(n, dtype=np.uint8)
        for at, doc in spans:
            labels[max(at - 1, 0):at + doc.span - 1] = IGNORE  # targets inside the span
            types[at + doc.placeholders[0]:at + doc.placeholders[1]] = 1
        return Sample(ids, labels, positions, segments, filled, images=[d.image for _, d in spans],
                      grids=[d.grid for _, d in spans], token_types=types, sources=sources)

    def state(self) -> PackState:
        return PackState(self.carry[0] if self.carry else None, self.offset if self.carry else 0)

    def refs(self, state: PackState) -> list[DocRef]:
        return [tuple(state.carry)] if state.carry is not None else []

    def restore(self, state: PackState, resolve: Resolve) -> None:
        if state.carry is None:
            if state.offset != 0:
                refuse("pack.offset", state.offset, "must be 0 when no document is carried")
            self.carry, self.offset = None, 0
            return
        carry = resolve(tuple(state.carry))
        if not 0 <= state.offset < len(carry[1]):
            refuse("pack.offset", state.offset, f"the carried document {tuple(state.carry)} has {len(carry[1])} "
                   f"tokens, so it must be in [0, {len(carry[1])})")
        if isinstance(carry[1], ImageDoc) and 0 < state.offset < carry[1].span:
            refuse("pack.offset", state.offset, f"it cuts the image span [0, {carry[1].span}) of the carried document "
                   f"{tuple(state.carry)}, which packing never does")
        self.carry, self.offset = carry, state.offset
