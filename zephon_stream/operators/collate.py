"""Collate: a rank's samples of one global batch into a dict of torch tensors.

With a `[vision]` config the batch also holds the images of its samples, in sample order:

- `pixel_values` `[patches, 3 * temporal_patch_size * patch_size**2]`: every image cut into
  patches as Qwen2-VL's processor does; uint8 (normalise on the device with
  `zephon_stream.vision.normalize`) or float32 normalised, as `vision.pixel_dtype` says;
- `image_grid_thw` `[images, 3]`: each image's grid in patches;
- `image_sample` `[images]`: the row of the batch that holds each image;
- `mm_token_type_ids` `[B, seq_len]`: 1 where an image placeholder token stands, else 0.
"""

from __future__ import annotations

import hashlib
import mmap
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon_stream.operators.types import IGNORE, Sample

__all__ = [
    "PIXEL_BUFFERS", "PixelBuffers", "collate", "document_ids", "padding_sample", "sample_digests", "source_tokens",
]


def padding_sample(seq_len: int, pad_id: int, lane: int, index: int) -> Sample:
    """What a slot holds once its lane's data is exhausted (max_epochs > 0): no real tokens."""
    return Sample(np.full(seq_len, pad_id, dtype=np.uint32), np.full(seq_len, IGNORE, dtype=np.int32),
                  np.zeros(seq_len, dtype=np.int32), [], 0, lane, index)


def collate(samples: list[Sample], step: int, slots: range, config: Any = None) -> dict[str, object]:
    """Stack samples into `[B, seq_len]` tensors.

    `cu_seqlens` are the document boundaries over the flattened batch (padding is one segment
    of its own), ready for varlen attention; `num_tokens` counts non-padding tokens per sample.
    `document_ids` `[B, seq_len]` numbers the documents (pieces of documents) of each sample
    0, 1, 2... in order and marks padding -1, the per-token ids flex attention's document mask
    compares: `doc[b, q] == doc[b, kv]` and `q >= kv` keeps every row non-empty (a padding
    query sees the padding before it) and never lets a token see another document.
    `labels` are -100 where a target is not trained (a chat source's tokens outside `loss_on`,
    image spans, and, with `mask_cross_document_labels`, across documents).
    `segment_sources` gives the source index of each of those segments (-1 for padding), e.g. for
    per-source losses: `segment_sources.repeat_interleave(cu_seqlens.diff())` is a source per token.
    """
    seq_len, rows = len(samples[0].input_ids), len(samples)
    bounds = [0]
    sources: list[int] = []
    pieces: list[int] = []  # each segment's number inside its sample (-1: padding), for document_ids
    for b, s in enumerate(samples):
        for n in s.segments:
            bounds.append(bounds[-1] + n)
        sources += s.sources if len(s.sources) == len(s.segments) else [-1] * len(s.segments)
        pieces += range(len(s.segments))
        if s.num_tokens < seq_len:
            bounds.append((b + 1) * seq_len)
            sources.append(-1)
            pieces.append(-1)
    import torch  # imported here so lane worker processes never load torch

    lengths = np.diff(bounds)
    # int64 rows written in place (each row cast as it is copied): no per-sample arrays, no stacked copy
    ids, labels, positions = (torch.empty((rows, seq_len), dtype=torch.int64) for _ in range(3))
    ids_np, labels_np, positions_np = ids.numpy(), labels.numpy(), positions.numpy()
    for b, s in enumerate(samples):
        ids_np[b], labels_np[b], positions_np[b] = s.input_ids, s.labels, s.position_ids
    batch = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "document_ids": torch.from_numpy(np.repeat(np.array(pieces, dtype=np.int64), lengths).reshape(rows, seq_len)),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "segment_sources": torch.tensor(sources, dtype=torch.int64),
        "max_seqlen": int(lengths.max()) if len(lengths) else 0,
        "num_tokens": torch.tensor([s.num_tokens for s in samples], dtype=torch.int64),
        "slots": torch.tensor(list(slots), dtype=torch.int64),
        "lanes": torch.tensor([s.lane for s in samples], dtype=torch.int64),
        "step": step,
    }
    if config is not None and config.labels == "unshifted":  # HF style: the model shifts them itself
        batch["labels"] = torch.cat([torch.full_like(batch["labels"][:, :1], IGNORE), batch["labels"][:, :-1]], dim=1)
    if config is not None and config.vision is not None:
        batch.update(_images(samples, config.vision))
    return batch


def document_ids(segments: Sequence[int], seq_len: int) -> np.ndarray:
    """Which segment of a sample each position belongs to (0, 1, ...), -1 for padding: int64 `[seq_len]`."""
    out = np.full(seq_len, -1, dtype=np.int64)
    filled = sum(segments)
    out[:filled] = np.repeat(np.arange(len(segments), dtype=np.int64), segments)
    return out


def _images(samples: list[Sample], vision: Any) -> dict[str, object]:
    import torch

    from zephon_stream.vision.image import normalize, patch_rows

    spec = vision.image_spec()
    grids = [g for s in samples for g in s.grids]
    rows = [t * h * w for t, h, w in grids]
    out, at = PIXEL_BUFFERS.take(sum(rows), spec.row_size), 0
    pixels = torch.from_numpy(out)  # holds `out`, and through it the pooled buffer, while the batch lives
    for frame, n in zip((frame for s in samples for frame in s.images), rows):
        patch_rows(frame, spec, out[at:at + n])  # each image's patches written once, in place
        at += n
    seq_len = len(samples[0].input_ids)
    types = [s.token_types if s.token_types is not None else np.zeros(seq_len, np.uint8) for s in samples]
    return {
        "pixel_values": normalize(pixels) if vision.pixel_dtype == "float32" else pixels,
        "image_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        "image_sample": torch.tensor([b for b, s in enumerate(samples) for _ in s.images], dtype=torch.int64),
        "mm_token_type_ids": torch.from_numpy(np.stack(types).astype(np.int64)),
    }


class PixelBuffers:
    """The memory behind the batches' `pixel_values`, recycled once the consumer has let a batch go.

    A batch's pixels are tens of MB (the stamps at seq_len 2048: 58 MB). A fresh allocation that
    large is mapped anew by malloc every time, and the kernel faults in and zeroes each of its
    pages as collate first writes them: half of the loader's page faults, 0.15 CPU-seconds per
    epoch of the stamps on the bench machine (numpy's allocator asks for huge pages there, whose
    zeroing and compaction cost as much, and far more on a machine short of free huge pages).
    Here a batch takes a slice of a pooled anonymous mapping instead. A mapping is free again
    when nothing but the pool refers to it: the batch's array (`np.frombuffer` of it) holds it,
    and so does every view, tensor (`torch.from_numpy`) or `.numpy()` made from that array; a
    tensor moved elsewhere (`.to(device)`, `pin_memory()`, `share_memory_()`) lets go of it. So
    memory is never written while a batch on it can still be read, whatever the consumer keeps.

    At most `keep` mappings are pooled: the consumer's current batch, the one being collated and
    one more. A batch that finds none free gets memory of its own, freed with it. A new mapping
    has room for a quarter more bytes than asked, so that a later, larger batch fits too; the
    room costs no resident memory until a batch writes into it.
    """

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._pool: list[mmap.mmap] = []
        self._lock = threading.Lock()  # collates of two streams may run at once

    def take(self, rows: int, width: int) -> np.ndarray:
        """Writable uint8 `[rows, width]` that no live batch shares (contents undefined)."""
        size = rows * width
        if not size:
            return np.empty((rows, width), np.uint8)
        return np.frombuffer(self._memory(size), np.uint8, count=size).reshape(rows, width)

    def _memory(self, size: int) -> mmap.mmap:
        with self._lock:
            free = [i for i in range(len(self._pool)) if _only_pooled(self._pool, i)]
            fits = [i for i in free if len(self._pool[i]) >= size]
            if fits:
                return self._pool[min(fits, key=lambda i: len(self._pool[i]))]
            memory = mmap.mmap(-1, size + size // 4)
            if free:  # too small: a new one takes its place
                self._pool[free[0]] = memory
            elif len(self._pool) < self.keep:
                self._pool.append(memory)
            return memory

    def clear(self) -> None:
        """Drop the pooled mappings (the memory of those in use goes when their batches go)."""
        with self._lock:
            self._pool.clear()


def _only_pooled(pool: list[mmap.mmap], i: int) -> bool:
    """Whether nothing but `pool` refers to its mapping `i`: sys.getrefcount counts the list and its own argument."""
    return sys.getrefcount(pool[i]) == 2


#: The pool behind every batch's `pixel_values` in this process (see `PixelBuffers`).
PIXEL_BUFFERS = PixelBuffers(keep=3)


def sample_digests(batch: dict[str, Any], source_names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One record per sample of a collated batch: what `zephon stream --digests` prints.

    `sha256` digests the sample's `input_ids` (little-endian uint32); `pixels_sha256` the bytes
    of its rows of `pixel_values` exactly as in the batch (null without images); `source_tokens`
    the sample's non-padding tokens per source, by name (`source_names`, in config order; without
    them, by index as a string); `trained` the positions of its `labels` (as the batch holds them:
    shifted, or unshifted with `labels = "unshifted"`) that are not -100.
    """
    ids = batch["input_ids"].numpy().astype("<u4")
    per_sample: list[list[bytes]] = [[] for _ in range(len(ids))]
    if "pixel_values" in batch:
        pixels = batch["pixel_values"].numpy()
        counts = batch["image_grid_thw"].prod(dim=1).tolist()
        starts = np.cumsum([0, *counts])
        for i, row in enumerate(batch["image_sample"].tolist()):
            per_sample[row].append(np.ascontiguousarray(pixels[starts[i]:starts[i + 1]]).tobytes())
    trained = (batch["labels"] != IGNORE).sum(dim=1).tolist()
    return [{"step": batch["step"], "slot": slot, "lane": lane, "tokens": n,
             "sha256": hashlib.sha256(row.tobytes()).hexdigest(), "images": len(images),
             "pixels_sha256": hashlib.sha256(b"".join(images)).hexdigest() if images else None,
             "source_tokens": tokens, "trained": t}
            for row, slot, lane, n, images, tokens, t in zip(ids, batch["slots"].tolist(), batch["lanes"].tolist(),
                                                             batch["num_tokens"].tolist(), per_sample,
                                                             source_tokens(batch, source_names), trained)]


def source_tokens(batch: dict[str, Any], source_names: Sequence[str] = ()) -> list[dict[str, int]]:
    """Each sample's non-padding tokens per source: `{name: tokens}`, every source named (with
    `source_names`), else `{str(index): tokens}` for the sources present."""
    seq_len = batch["input_ids"].shape[1]
    out: list[dict[str, int]] = [dict.fromkeys(source_names, 0) for _ in range(batch["input_ids"].shape[0])]
    bounds = batch["cu_seqlens"].tolist()
    for a, e, s in zip(bounds, bounds[1:], batch["segment_sources"].tolist()):
        if s >= 0:
            name = source_names[s] if s < len(source_names) else str(s)
            row = out[a // seq_len]
            row[name] = row.get(name, 0) + e - a
    return out
