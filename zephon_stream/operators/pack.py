"""Pack: concatenate documents and cut the stream into `seq_len` samples; nothing is dropped.

```
docs:     [a a a a E][b b E][c c c c c c c E]      (E = EOS, appended by tokenize)
samples:  [a a a a E b]  [b E c c c c]  [c c c E . .]     seq_len = 6, '.' = padding at the end
labels:   [a a a E - b]  [E - c c c c]  [c c E - - -]     '-' = -100 (across a document, or padding)
position: [0 1 2 3 4 0]  [0 1 0 1 2 3]  [0 1 2 3 0 0]
```

Labels are the next token of the stream; with `mask_cross_document_labels` the label of a
document's last token (its EOS) is -100. `position_ids` restart at every document and at every
sample start; `segments` are the document pieces inside the sample (for `cu_seqlens`).
The only state is the document being cut (`carry`) and how many of its tokens were emitted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from zephon_stream.operators.mix import Doc

IGNORE = -100


class Sample:
    """One packed sample, plus where it came from and the lane state right after it."""

    __slots__ = ("input_ids", "labels", "position_ids", "segments", "num_tokens", "lane", "index", "state")

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray,
                 segments: list[int], num_tokens: int, lane: int, index: int, state: object = None) -> None:
        self.input_ids, self.labels, self.position_ids = input_ids, labels, position_ids
        self.segments, self.num_tokens, self.lane, self.index, self.state = (
            segments, num_tokens, lane, index, state)


class Pack:
    def __init__(self, seq_len: int, pad_id: int, mask_cross_document: bool,
                 pull: Callable[[], Awaitable[Doc | None]]) -> None:
        self.seq_len, self.pad_id, self.mask, self._pull = seq_len, pad_id, mask_cross_document, pull
        self.carry: Doc | None = None
        self.offset = 0
        self._arange = np.arange(seq_len, dtype=np.int32)

    def __repr__(self) -> str:
        return f"Pack(seq_len={self.seq_len}, mask_cross_document={self.mask})"

    def restore(self, carry: Doc | None, offset: int) -> None:
        self.carry, self.offset = carry, offset

    async def next(self, lane: int, index: int) -> Sample | None:
        n = self.seq_len
        ids = np.full(n, self.pad_id, dtype=np.uint32)
        positions = np.zeros(n, dtype=np.int32)
        segments: list[int] = []
        ends: list[bool] = []
        filled = 0
        while filled < n:
            if self.carry is None:
                self.carry, self.offset = await self._pull(), 0
                if self.carry is None:
                    break
            tokens = self.carry[1]
            take = min(n - filled, len(tokens) - self.offset)
            ids[filled:filled + take] = tokens[self.offset:self.offset + take]
            positions[filled:filled + take] = self._arange[:take]
            filled += take
            self.offset += take
            segments.append(take)
            ends.append(self.offset == len(tokens))
            if ends[-1]:
                self.carry = None
        if filled == 0:
            return None
        labels = np.full(n, IGNORE, dtype=np.int32)
        labels[:filled - 1] = ids[1:filled]
        if filled == n:
            if self.carry is None:
                self.carry, self.offset = await self._pull(), 0  # the last label is the next token
            if self.carry is not None:
                labels[n - 1] = int(self.carry[1][self.offset])
        if self.mask:
            doc_ends = np.cumsum(segments)[np.asarray(ends)] - 1
            labels[doc_ends] = IGNORE
        return Sample(ids, labels, positions, segments, filled, lane, index)
