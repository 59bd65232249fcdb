"""The items that flow through a lane: document references, documents and packed samples."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["IGNORE", "Doc", "DocRef", "Sample"]

DocRef = tuple[int, int, int, int]  # (source, split position in the lane, decoded offset, length in bytes)
Doc = tuple[DocRef, Any]  # (reference, token ids: a uint32 array, or text before tokenizing)
IGNORE = -100  # the label of a position that is not trained on


class Sample:
    """One packed sample, plus the lane and lane-local index that produced it and the lane state
    right after it (which becomes the checkpoint once the trainer consumes the sample)."""

    __slots__ = ("input_ids", "labels", "position_ids", "segments", "num_tokens", "lane", "index", "state")

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray,
                 segments: list[int], num_tokens: int, lane: int = -1, index: int = -1, state: object = None) -> None:
        self.input_ids, self.labels, self.position_ids = input_ids, labels, position_ids
        self.segments, self.num_tokens, self.lane, self.index, self.state = (
            segments, num_tokens, lane, index, state)
