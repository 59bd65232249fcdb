"""Pack (`packing = "concat"`): concatenate documents and cut the stream into `seq_len` samples; nothing is dropped.

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

Every strategy (this one, `operators.best_fit`, `operators.single`) places pieces of documents
(`Cut`s) and lets `assemble` make the sample, so labels follow one rule everywhere: a label is
its token's target, the next token of the same document (across the end of a piece too), and
-100 where that target is not trained: a chat document's tokens outside its loss spans
(`ChatDoc.trained`), or an image span.

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

import functools
from typing import Any, NamedTuple

import msgspec
import numpy as np

from zephon_stream.engine.operator import Operator, Resolve, refuse
from zephon_stream.operators.types import IGNORE, Doc, DocRef, ImageDoc, Sample, trained_mask

__all__ = ["IGNORE", "Cut", "Pack", "PackState", "assemble", "check_counters", "check_piece"]


class PackState(msgspec.Struct, frozen=True, array_like=True):
    """The state of every packing strategy (one type, so a lane state has one shape)."""

    carry: DocRef | None  # concat, none: the document being cut
    offset: int  # its tokens already packed
    window: list[tuple[DocRef, int]] = []  # best_fit: (document, its tokens already packed), in window order
    truncated: int = 0  # none with truncate: documents cut at seq_len so far
    dropped: int = 0  # their tokens past seq_len, dropped


class Cut(NamedTuple):
    """A piece of a document placed in a sample: tokens `[start, start + take)` of `doc`."""

    doc: Doc
    start: int
    take: int


def assemble(cuts: list[Cut], seq_len: int, pad_id: int, mask: bool, after: tuple[Any, int] | None = None) -> Sample:
    """The sample of `cuts`, laid out from position 0 in order and padded with `pad_id`.

    A cut's labels are its tokens' targets, the document's next tokens; at a document's end the
    target is -100 with `mask`, else the next token of the sample (`after`, the stream's token
    after the sample, for the last cut: concat's look-ahead). `position_ids` restart at each cut.
    """
    ids = np.empty(seq_len, dtype=np.uint32)
    labels = np.empty(seq_len, dtype=np.int32)
    positions = np.empty(seq_len, dtype=np.int32)
    ramp = _ramp(seq_len)
    at = 0
    for i, (doc, start, take) in enumerate(cuts):
        tokens, end = doc[1], start + take
        ids[at:at + take] = tokens[start:end]
        positions[at:at + take] = ramp[:take]
        stop = min(end + 1, len(tokens))  # the targets: the document's next tokens, up to its end
        if type(tokens) is np.ndarray:  # plain text: every target is trained (the ids fit int32)
            labels[at:at + stop - start - 1] = tokens[start + 1:stop]
        else:
            labels[at:at + stop - start - 1] = _targets(tokens, start + 1, stop)
        if end == len(tokens):
            nxt = None if mask else (cuts[i + 1].doc[1], cuts[i + 1].start) if i + 1 < len(cuts) else after
            labels[at + take - 1] = IGNORE if nxt is None else _targets(nxt[0], nxt[1], nxt[1] + 1)[0]
        at += take
    ids[at:] = pad_id
    labels[at:] = IGNORE
    positions[at:] = 0
    return Sample(ids, labels, positions, [c.take for c in cuts], at, sources=[c.doc[0][0] for c in cuts])


@functools.lru_cache(maxsize=8)
def _ramp(n: int) -> np.ndarray:
    """0, 1, ..., n-1 as int32 (read-only, shared): every piece's position ids are a prefix."""
    ramp = np.arange(n, dtype=np.int32)
    ramp.flags.writeable = False
    return ramp


def _targets(tokens: Any, begin: int, end: int) -> np.ndarray:
    """Labels whose targets are `tokens[begin:end]`: the ids, -100 where a target is not trained."""
    out = np.array(tokens[begin:end], dtype=np.int32)
    trained = trained_mask(tokens)
    if trained is not None:
        out[~np.asarray(trained[begin:end], dtype=bool)] = IGNORE
    if isinstance(tokens, ImageDoc) and begin < tokens.span:  # an image span is never a target
        out[:tokens.span - begin] = IGNORE
    return out


class Pack:
    def __init__(self, seq_len: int, pad_id: int, mask_cross_document: bool, upstream: Operator[Doc]) -> None:
        if seq_len < 2:
            raise ValueError(f"Pack seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.pad_id, self.mask, self.upstream = seq_len, pad_id, mask_cross_document, upstream
        self.carry: Doc | None = None
        self.offset = 0

    def __repr__(self) -> str:
        return f"Pack(seq_len={self.seq_len}, mask_cross_document={self.mask})"

    async def next(self) -> Sample | None:
        n = self.seq_len
        cuts: list[Cut] = []
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
            cuts.append(Cut(self.carry, self.offset, take))
            filled += take
            self.offset += take
            if self.offset == len(tokens):
                self.carry = None
        if filled == 0:
            return None
        if filled == n and self.carry is None:
            self.carry, self.offset = await self.upstream.next(), 0  # the last label is the next token
        after = (self.carry[1], self.offset) if filled == n and self.carry is not None else None
        sample = assemble(cuts, n, self.pad_id, self.mask, after)
        if spans:
            sample.token_types = np.zeros(n, dtype=np.uint8)
            for at, doc in spans:
                sample.token_types[at + doc.placeholders[0]:at + doc.placeholders[1]] = 1
            sample.images, sample.grids = [d.image for _, d in spans], [d.grid for _, d in spans]
        return sample

    def state(self) -> PackState:
        return PackState(self.carry[0] if self.carry else None, self.offset if self.carry else 0)

    def refs(self, state: PackState) -> list[DocRef]:
        return [tuple(state.carry)] if state.carry is not None else []

    def restore(self, state: PackState, resolve: Resolve) -> None:
        check_counters(state, window=False, truncate=False)
        if state.carry is None:
            if state.offset != 0:
                refuse("pack.offset", state.offset, "must be 0 when no document is carried")
            self.carry, self.offset = None, 0
            return
        carry = resolve(tuple(state.carry))
        check_piece("pack.offset", carry, state.offset)
        if isinstance(carry[1], ImageDoc) and 0 < state.offset < carry[1].span:
            refuse("pack.offset", state.offset, f"it cuts the image span [0, {carry[1].span}) of the carried document "
                   f"{tuple(state.carry)}, which packing never does")
        self.carry, self.offset = carry, state.offset


def check_piece(field: str, doc: Doc, offset: int, seq_len: int = 1, what: str = "the carried document",
                from_end: bool = False) -> None:
    """Refuse `offset` unless it is a piece start of `doc`: inside it, at a multiple of `seq_len`
    from its start (or, `from_end`, 0 or a multiple of `seq_len` before its end)."""
    n = len(doc[1])
    if not 0 <= offset < n:
        refuse(field, offset, f"{what} {tuple(doc[0])} has {n} tokens, so it must be in [0, {n})")
    if (n - offset if from_end and offset else offset) % seq_len:
        where = f"0 or {n} - k * seq_len" if from_end else "multiples of seq_len"
        refuse(field, offset, f"pieces of document {tuple(doc[0])} ({n} tokens) start at {where}, seq_len = {seq_len}")


def check_counters(state: PackState, *, window: bool, truncate: bool) -> None:
    """Refuse the fields of `state` that the strategy restoring it never writes."""
    if state.window and not window:
        refuse("pack.window", f"{len(state.window)} documents", 'only packing = "best_fit" has a window')
    if (state.truncated or state.dropped) and not truncate:
        refuse("pack.truncated", (state.truncated, state.dropped), 'only packing = "none" with truncate cuts documents')
    if state.truncated < 0 or state.dropped < state.truncated:
        refuse("pack.dropped", (state.truncated, state.dropped), "a cut document drops at least one token: "
               "0 <= truncated <= dropped")
