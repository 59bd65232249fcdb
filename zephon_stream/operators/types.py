"""The items that flow through a lane: document references, documents and packed samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = ["IGNORE", "ChatDoc", "Conversation", "Doc", "DocRef", "ImageDoc", "LaneFailure", "Sample", "field",
           "located", "trained_mask"]

# (source, split position in the lane, decoded offset, length in bytes), and with `piece_tokens` a fifth
# element for a piece of a longer document: its first token. Four or five ints (states check the length).
DocRef = tuple[int, ...]
Doc = tuple[DocRef, Any]  # (reference, token ids: a uint32 array, or text before tokenizing)
IGNORE = -100  # the label of a position that is not trained on


def field(record: Any, name: str) -> Any:
    """The value a field setting (`text_field`, `messages_field`...) names in a JSON record: the
    key `name` itself, else a dotted path into nested objects (`"doc.body"`), as Parquet's
    columns resolve. None where neither is there."""
    if not isinstance(record, dict):
        return None
    if name in record or "." not in name:
        return record.get(name)
    for part in name.split("."):
        if not isinstance(record, dict):
            return None
        record = record.get(part)
    return record


class ImageDoc:
    """The tokens of an image+text document, and its image: resized, as one frame of patches
    (`vision.patch_frame`: uint8 [grid_h * grid_w, 3, patch_size^2]).

    Its first `span` ids are the image span (vision start, placeholders, vision end), which
    packing never cuts and labels never train on; `placeholders` is the `[begin, end)` of the
    image tokens inside it. `len()` and indexing act on the ids, so the operators that count
    or cut tokens treat it as they treat a text document's array.
    """

    __slots__ = ("ids", "image", "grid", "span", "placeholders")

    def __init__(self, ids: np.ndarray, image: np.ndarray, grid: tuple[int, int, int], span: int,
                 placeholders: tuple[int, int]) -> None:
        self.ids, self.image, self.grid, self.span, self.placeholders = ids, image, grid, span, placeholders

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: Any) -> Any:
        return self.ids[index]

    def __repr__(self) -> str:
        return f"ImageDoc({len(self.ids)} ids, {len(self.image)} patches, grid {self.grid})"


class Conversation(NamedTuple):
    """A chat record with tools or documents: its messages, and the raw values of its
    `tools_field` and `documents_field` (None when the record has none, or the source names no
    such field). A chat source with neither field passes its messages alone."""

    messages: Any
    tools: Any
    documents: Any = None


class ChatDoc:
    """The tokens of a rendered conversation, and which of them are trained on.

    `trained[i]` is True where token `i` is a target (inside the spans of `loss_on`); a label
    whose target is not trained is -100. `len()` and indexing act on the ids, as for `ImageDoc`.
    """

    __slots__ = ("ids", "trained")

    def __init__(self, ids: np.ndarray, trained: np.ndarray) -> None:
        if len(trained) != len(ids):
            raise ValueError(f"ChatDoc: {len(ids)} ids but {len(trained)} trained flags")
        self.ids, self.trained = ids, trained

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: Any) -> Any:
        return self.ids[index]

    def __repr__(self) -> str:
        return f"ChatDoc({len(self.ids)} ids, {int(self.trained.sum())} trained)"


def trained_mask(tokens: Any) -> np.ndarray | None:
    """Which tokens of a document are targets: a ChatDoc's `trained`, None for all (text, images)."""
    return tokens.trained if isinstance(tokens, ChatDoc) else None


class Sample:
    """One packed sample, plus the lane and lane-local index that produced it and the lane state
    right after it (which becomes the checkpoint once the trainer consumes the sample).

    An image+text sample also has its images (`ImageDoc.image` patch frames, in token order), their
    grids `(t, h, w)` in patches, and `token_types` (1 where an image placeholder stands).

    `sources` is the source index of each of `segments` (the document pieces), so the tokens of
    each source in the sample are known (`--digests`' `source_tokens`, realized shares).
    """

    __slots__ = ("input_ids", "labels", "position_ids", "segments", "num_tokens", "lane", "index", "state",
                 "images", "grids", "token_types", "sources")

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray,
                 segments: list[int], num_tokens: int, lane: int = -1, index: int = -1, state: object = None,
                 images: list[np.ndarray] | None = None, grids: list[tuple[int, int, int]] | None = None,
                 token_types: np.ndarray | None = None, sources: list[int] | None = None) -> None:
        self.input_ids, self.labels, self.position_ids = input_ids, labels, position_ids
        self.segments, self.num_tokens, self.lane, self.index, self.state = (
            segments, num_tokens, lane, index, state)
        self.images, self.grids, self.token_types = images or [], grids or [], token_types
        self.sources = sources or []

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays: ids, labels, positions, token types and images."""
        arrays = [self.input_ids, self.labels, self.position_ids, *self.images]
        return sum(a.nbytes for a in arrays) + (0 if self.token_types is None else self.token_types.nbytes)


class LaneFailure:
    """What a lane sends in place of its sample `index` when making it raised a DataError (a bad
    record with `on_bad_record = "error"`, a source with no document): the sequencer raises
    `error` when the order reaches that sample. Which bad record a run names then follows the
    order, not which lane's thread got there first, and a bad record past the last batch taken
    is never raised. `state` is None: a failure is never part of a checkpoint."""

    __slots__ = ("error", "lane", "index", "state")
    nbytes = 0  # what it holds of the lanes' buffers (`Loader.statistics().buffered_bytes`): no arrays

    def __init__(self, error: BaseException, lane: int = -1, index: int = -1) -> None:
        self.error, self.lane, self.index, self.state = error, lane, index, None

    def __repr__(self) -> str:
        return f"LaneFailure(lane={self.lane}, index={self.index}, {self.error!r})"


def located(where: Callable[[int], str] | None, pos: int) -> str:
    """A document's place in words: the reader's `where(pos)` (a byte of the file, a row of a row
    group), or its offset in its split where no reader says."""
    return where(pos) if where is not None else f"byte {pos} of its split"
