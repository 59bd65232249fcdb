"""Checkpoint state: typed plain data, msgpack-encoded, versioned, one record per lane.

A lane's state holds counters, cursors and document references, never payloads: restore
re-reads the (at most `shuffle_window + 1`) referenced documents. Its size is bounded by the
shuffle window and the number of sources, whatever the dataset size or position.
"""

from __future__ import annotations

from typing import Any

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


class StateHeader(msgspec.Struct, frozen=True):
    """What every rank's state carries: the format, what the state is valid for, and the position."""

    format_version: int
    order_digest: str
    data_fingerprint: str
    lanes: int
    global_batch_size: int
    step: int  # global batches consumed
    order: dict[str, Any] = {}  # the settings `order_digest` covers (Config.order_settings), to name a change


class LoaderState(msgspec.Struct, frozen=True):
    """One rank's state: the header and one record per lane it owns."""

    header: StateHeader
    lane_states: list[LaneState]

    def to_dict(self) -> dict[str, bytes]:
        """`{"meta": ..., "lane_03": ..., ...}`: one key per lane, so checkpoint tools
        (torch.distributed.checkpoint included) store lanes separately and any world size can
        load exactly the lanes it owns."""
        out = {"meta": _encoder.encode(self.header)}
        out.update({lane_key(ls.lane): _encoder.encode(ls) for ls in self.lane_states})
        return out

    @classmethod
    def from_dict(cls, state: dict[str, bytes]) -> LoaderState:
        if "meta" not in state:
            raise CheckpointError(f"not a zephon-stream loader state: no 'meta' key among {sorted(state)[:5]}")
        header = _decode(_header_decoder, state["meta"], "meta")
        if header.format_version != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint format_version {header.format_version} is not supported "
                                  f"(this version reads {FORMAT_VERSION})")
        lanes = [_decode(_lane_decoder, v, k) for k, v in sorted(state.items()) if k.startswith("lane_")]
        for key, ls in zip(sorted(k for k in state if k.startswith("lane_")), lanes):
            if key != lane_key(ls.lane):
                raise CheckpointError(f"checkpoint entry {key!r} holds the state of lane {ls.lane}")
        return cls(header, lanes)


def lane_key(lane: int) -> str:
    return f"lane_{lane:04d}"


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(StateHeader)
_lane_decoder = msgspec.msgpack.Decoder(LaneState)
_file_decoder = msgspec.msgpack.Decoder(dict[str, bytes])


def _decode(decoder: msgspec.msgpack.Decoder, data: object, key: str) -> object:
    try:
        return decoder.decode(bytes(data))  # type: ignore[arg-type]
    except (TypeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"checkpoint entry {key!r} is not a zephon-stream state: {exc}") from exc


def state_to_bytes(state: dict[str, bytes]) -> bytes:
    """One file's worth of a rank's `state_dict()` (for saving without torch.distributed.checkpoint)."""
    return _encoder.encode({k: bytes(v) for k, v in state.items()})


def state_from_bytes(data: bytes) -> dict[str, bytes]:
    try:
        return _file_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"not a zephon-stream state file: {exc}") from exc
