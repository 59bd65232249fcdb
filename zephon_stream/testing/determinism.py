"""Harnesses that prove determinism: per-sample digests of a whole world of ranks, with resume.

A *record* is `(step, slot, lane, tokens, sha256)` for one sample, where `sha256` is the
digest of its `input_ids` as little-endian uint32 (what `zephon stream --digests` prints),
followed by `:<pixels_sha256>` when the sample holds images, so pixels are compared too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from zephon_stream.loader.config import Config
from zephon_stream.loader.loader import Loader
from zephon_stream.operators.collate import sample_digests

__all__ = ["Record", "batch_records", "lane_documents", "lane_token_streams", "rank_records", "real", "run_world"]

Record = tuple[int, int, int, int, str]


def batch_records(batch: dict[str, Any]) -> list[Record]:
    return [(d["step"], d["slot"], d["lane"], d["tokens"],
             d["sha256"] + (f":{d['pixels_sha256']}" if d["pixels_sha256"] else ""))
            for d in sample_digests(batch)]


def rank_records(loader: Loader, steps: int | None) -> list[Record]:
    """Records of the next `steps` batches of one rank (all remaining batches if None)."""
    out: list[Record] = []
    if steps == 0:
        return out
    for b, batch in enumerate(loader):
        out += batch_records(batch)
        if steps is not None and b + 1 == steps:
            break
    return out


def run_world(config: Config, dp_size: int, steps: int | None, *, backend: str | None = None,
              resume: list[dict[str, Any]] | None = None, wrap_store: Callable[..., Any] | None = None,
              ) -> tuple[list[Record], list[dict[str, Any]]]:
    """Run every rank of a `dp_size` world for `steps` batches (one after another, in-process).

    Returns the records of all ranks sorted by slot, and each rank's `state_dict()` at the end.
    """
    records: list[Record] = []
    states = []
    for rank in range(dp_size):
        loader = Loader(config, dp_rank=rank, dp_size=dp_size, backend=backend, wrap_store=wrap_store)
        if resume:
            loader.load_state_dict(resume)
        records += rank_records(loader, steps)
        states.append(loader.state_dict())
    return sorted(records, key=lambda r: r[1]), states


def real(records: Iterable[Record]) -> list[Record]:
    """Records that hold data (a rank's tail after its lanes end holds only padding)."""
    return [r for r in records if r[3] > 0]


def lane_token_streams(batches: Iterable[dict[str, Any]]) -> dict[int, list[int]]:
    """Each lane's real tokens, concatenated in sample order (for exactly-once checks)."""
    out: dict[int, list[int]] = {}
    for batch in batches:
        for row, lane, n in zip(batch["input_ids"].numpy(), batch["lanes"].tolist(), batch["num_tokens"].tolist()):
            out.setdefault(lane, []).extend(np.asarray(row[:n]).tolist())
    return out


def lane_documents(tokens: list[int], eos: int) -> list[tuple[int, ...]]:
    """A lane's token stream (`lane_token_streams`) cut into its documents, each ending with `eos`
    (for exactly-once checks: the stream of a lane that ran to its end holds whole documents)."""
    docs, cur = [], []
    for t in tokens:
        cur.append(t)
        if t == eos:
            docs.append(tuple(cur))
            cur = []
    assert not cur, "a lane's stream must end with a whole document"
    return docs
