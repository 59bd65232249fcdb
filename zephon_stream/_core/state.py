"""Checkpoint state: typed plain data, msgpack-encoded, versioned, one record per lane.

A lane's state holds counters, cursors and document references, never payloads: restore
re-reads the (at most `shuffle_window + 1`) referenced documents. Its size is bounded by the
shuffle window and the number of sources, whatever the dataset size or position.
"""

from __future__ import annotations

import msgspec

from .._exceptions import CheckpointError

FORMAT_VERSION = 1
DocRef = tuple[int, int, int, int]  # (source, split position in the lane, decoded offset, length)


class LaneState(msgspec.Struct, frozen=True, array_like=True):
    lane: int
    samples: int  # samples this lane has handed out
    done: bool  # the lane's data is exhausted (max_epochs reached)
    cursors: list[tuple[int, int]]  # per source: (split position, offset) of the next unread document
    counts: list[int]  # per source: tokens (or documents) taken by the mixer
    position: int  # documents taken by the mixer
    window: list[DocRef]  # shuffle window, in window order
    pulls: int  # documents taken out of the shuffle window
    carry: DocRef | None  # document being packed
    carry_offset: int  # tokens of `carry` already packed


class LoaderState(msgspec.Struct, frozen=True):
    format_version: int
    order_digest: str
    data_fingerprint: str
    lanes: int
    global_batch_size: int
    step: int  # global batches consumed
    lane_states: list[LaneState]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LoaderState)


def encode_state(state: LoaderState) -> bytes:
    return _encoder.encode(state)


def decode_state(data: bytes) -> LoaderState:
    try:
        state = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"checkpoint is not a zephon-stream loader state: {exc}") from exc
    if state.format_version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format_version {state.format_version} is not supported "
                              f"(this version reads {FORMAT_VERSION})")
    return state
