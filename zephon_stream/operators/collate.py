"""Collate: a rank's samples of one global batch into a dict of torch tensors."""

from __future__ import annotations

import numpy as np

from zephon_stream.operators.types import IGNORE, Sample

__all__ = ["collate", "padding_sample"]


def padding_sample(seq_len: int, pad_id: int, lane: int, index: int) -> Sample:
    """What a slot holds once its lane's data is exhausted (max_epochs > 0): no real tokens."""
    return Sample(np.full(seq_len, pad_id, dtype=np.uint32), np.full(seq_len, IGNORE, dtype=np.int32),
                  np.zeros(seq_len, dtype=np.int32), [], 0, lane, index)


def collate(samples: list[Sample], step: int, slots: range) -> dict[str, object]:
    """Stack samples into `[B, seq_len]` tensors.

    `cu_seqlens` are the document boundaries over the flattened batch (padding is one segment
    of its own), ready for varlen attention; `num_tokens` counts non-padding tokens per sample.
    """
    seq_len = len(samples[0].input_ids)
    bounds = [0]
    for b, s in enumerate(samples):
        base = b * seq_len
        for n in s.segments:
            bounds.append(bounds[-1] + n)
        if s.num_tokens < seq_len:
            bounds.append(base + seq_len)
    import torch  # imported here so lane worker processes never load torch

    lengths = np.diff(bounds)
    return {
        "input_ids": torch.from_numpy(np.stack([s.input_ids for s in samples]).astype(np.int64)),
        "labels": torch.from_numpy(np.stack([s.labels for s in samples]).astype(np.int64)),
        "position_ids": torch.from_numpy(np.stack([s.position_ids for s in samples]).astype(np.int64)),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "max_seqlen": int(lengths.max()) if len(lengths) else 0,
        "num_tokens": torch.tensor([s.num_tokens for s in samples], dtype=torch.int64),
        "slots": torch.tensor(list(slots), dtype=torch.int64),
        "lanes": torch.tensor([s.lane for s in samples], dtype=torch.int64),
        "step": step,
    }
