"""Checkpoint state: typed plain data, msgpack-encoded, versioned, one record per lane.

A lane's state holds counters, cursors and document references, never payloads: restore
re-reads the (at most `shuffle_window + 1`) referenced documents. Its size is bounded by the
shuffle window and the number of sources, whatever the dataset size or position.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec

from zephon_stream.errors import CheckpointError, IncompatibleState
from zephon_stream.loader.config import Config
from zephon_stream.engine.rng import permutation

if TYPE_CHECKING:
    from zephon_stream.loader.lane import DataPlan

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
    def from_dict(cls, state: Mapping[str, bytes]) -> LoaderState:
        """Decode a `to_dict()` result. Anything else (hostile bytes included) is a CheckpointError."""
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise CheckpointError(f"not a zephon-stream loader state: expected a dict of str keys, got "
                                  f"{type(state).__name__}")
        if "meta" not in state:
            raise CheckpointError(f"not a zephon-stream loader state: no 'meta' key among {sorted(state)[:5]}")
        header = _decode(_header_decoder, state["meta"], "meta")
        if header.format_version != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint format_version {header.format_version} is not supported "
                                  f"(this version reads {FORMAT_VERSION})")
        if header.step < 0:
            raise IncompatibleState(f"checkpoint header field step = {header.step}: must be >= 0; the checkpoint "
                                    "was edited or damaged: use the file as saved or start fresh")
        keys = sorted(k for k in state if k.startswith("lane_"))
        lanes = [_decode(_lane_decoder, state[k], k) for k in keys]
        for key, ls in zip(keys, lanes):
            if key != lane_key(ls.lane):
                raise IncompatibleState(f"checkpoint entry {key!r} has lane field {ls.lane}: an entry holds the "
                                        "state of the lane it is named after; use the file as saved")
        return cls(header, lanes)


def lane_key(lane: int) -> str:
    return f"lane_{lane:04d}"


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(StateHeader)
_lane_decoder = msgspec.msgpack.Decoder(LaneState)
_file_decoder = msgspec.msgpack.Decoder(dict[str, bytes])


def _decode(decoder: msgspec.msgpack.Decoder, data: object, key: str) -> Any:
    # Only bytes-like values: `bytes(n)` of an int would allocate n bytes.
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointError(f"checkpoint entry {key!r} is a {type(data).__name__}, not bytes: "
                              "pass the dict that state_dict() returned")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nesting in `order`
        raise CheckpointError(f"checkpoint entry {key!r} is not a zephon-stream state: {exc}") from exc


def state_to_bytes(state: dict[str, bytes]) -> bytes:
    """One file's worth of a rank's `state_dict()` (for saving without torch.distributed.checkpoint)."""
    return _encoder.encode({k: bytes(v) for k, v in state.items()})


def state_from_bytes(data: bytes) -> dict[str, bytes]:
    try:
        return _file_decoder.decode(data)
    except (msgspec.DecodeError, TypeError) as exc:  # DecodeError includes ValidationError
        raise CheckpointError(f"not a zephon-stream state file: {exc}") from exc


# ---- validation against the config and the data ---------------------------------------------


def split_at(n_splits: int, lanes: int, max_epochs: int, lane: int, position: int) -> tuple[int, int] | None:
    """(epoch, index in that epoch's permutation) of the split at `position` of `lane`'s sequence
    for a source of `n_splits` splits; None past the last epoch (`max_epochs` > 0)."""
    epoch, index = divmod(lane + position * lanes, n_splits)
    return None if max_epochs and epoch >= max_epochs else (epoch, index)


def check_lane_state(ls: LaneState, config: Config, plan: DataPlan | None = None) -> None:
    """Refuse a lane state that no run of `config` (over `plan`'s data, when given) can write.

    Every field is checked against the config and against the others: counters, cursors,
    window and carry references (each a document already read, no two alike). With the plan,
    every split position must exist and, for JSON Lines, every offset lie inside its split.
    Raises `IncompatibleState` naming the lane and the field. What needs the data itself
    (a cursor at a record start, `carry_offset` within the carried document's tokens) is
    checked where the data is read again (`check_carry_offset`).
    """
    bad = _Refusal(ls.lane)
    _check_counters(ls, config, bad)
    _check_cursors(ls, len(config.sources), bad)
    _check_refs(ls, config, bad)
    if plan is not None:
        _check_positions(ls, config, plan, bad)


def check_carry_offset(ls: LaneState, carry_tokens: int) -> None:
    """Refuse a `carry_offset` outside the carried document, once its `carry_tokens` are known."""
    if ls.carry is not None and not ls.carry_offset < carry_tokens:
        _Refusal(ls.lane)("carry_offset", ls.carry_offset, f"the carried document {tuple(ls.carry)} has "
                          f"{carry_tokens} tokens, so it must be < {carry_tokens}")


class _Refusal:
    def __init__(self, lane: int) -> None:
        self.lane = lane

    def __call__(self, field: str, value: object, why: str) -> NoReturn:
        raise IncompatibleState(f"lane {self.lane} state field {field} = {value!r}: {why}; this state was not "
                                "written by a run of this config over this data (edited or damaged?): resume "
                                "from the checkpoint as saved, or start fresh")


def _check_counters(ls: LaneState, config: Config, bad: _Refusal) -> None:
    if not 0 <= ls.lane < config.lanes:
        bad("lane", ls.lane, f"the config has lanes = {config.lanes}")
    for field in ("samples", "position", "pulls", "carry_offset"):
        if getattr(ls, field) < 0:
            bad(field, getattr(ls, field), "must be >= 0")
    if len(ls.counts) != len(config.sources) or min(ls.counts, default=0) < 0:
        bad("counts", ls.counts, f"needs one count >= 0 per source ({len(config.sources)} sources)")
    taken = sum(ls.counts)  # every document counts 1 (mix = "documents") or its tokens, at least its EOS
    if taken < ls.position or (config.mix == "documents" and taken != ls.position):
        bad("counts", ls.counts, f"they add up to {taken} for {ls.position} documents taken (position)")
    if config.shuffle_window and ls.pulls + len(ls.window) != ls.position:
        bad("pulls", ls.pulls, f"pulls + window size ({len(ls.window)}) must equal position ({ls.position})")
    if not config.shuffle_window and ls.pulls:
        bad("pulls", ls.pulls, "must be 0 with shuffle_window = 0")
    if ls.done and (not config.max_epochs or ls.window or ls.carry is not None):
        bad("done", ls.done, "a lane is done only with max_epochs > 0, once its window and carry are empty")


def _check_cursors(ls: LaneState, n_sources: int, bad: _Refusal) -> None:
    if len(ls.cursors) != n_sources:
        bad("cursors", ls.cursors, f"needs one cursor per source ({n_sources} sources)")
    for s, (position, offset) in enumerate(ls.cursors):
        if position < 0 or offset < 0:
            bad(f"cursors[{s}]", (position, offset), "a split position and offset must be >= 0")
        if (ls.counts[s] == 0) != ((position, offset) == (0, 0)):
            bad(f"cursors[{s}]", (position, offset), f"counts[{s}] = {ls.counts[s]}: a cursor moves exactly "
                "when documents of its source are taken")


def _check_refs(ls: LaneState, config: Config, bad: _Refusal) -> None:
    if len(ls.window) > config.shuffle_window:
        bad("window", f"{len(ls.window)} documents", f"holds at most shuffle_window = {config.shuffle_window}")
    if ls.carry is None and ls.carry_offset:
        bad("carry_offset", ls.carry_offset, "must be 0 when no document is carried")
    seen: set[tuple[int, int, int]] = set()
    for field, ref in _refs(ls):
        source, position, offset, length = ref
        if not 0 <= source < len(config.sources) or position < 0 or offset < 0 or length < 1:
            bad(field, tuple(ref), f"needs 0 <= source < {len(config.sources)}, position >= 0, offset >= 0 "
                "and length >= 1")
        if (position, offset + length) > tuple(ls.cursors[source]):
            bad(field, tuple(ref), f"the document lies past cursors[{source}] = {tuple(ls.cursors[source])}: "
                "only documents already read can be in the window or carried")
        if (source, position, offset) in seen:
            bad(field, tuple(ref), "the same document is referenced twice")
        seen.add((source, position, offset))


def _refs(ls: LaneState) -> list[tuple[str, DocRef]]:
    refs = [(f"window[{i}]", ref) for i, ref in enumerate(ls.window)]
    return refs + ([("carry", ls.carry)] if ls.carry is not None else [])


def _check_positions(ls: LaneState, config: Config, plan: DataPlan, bad: _Refusal) -> None:
    """Each split position names a split of the data; JSONL offsets lie inside it."""
    places = [(f"cursors[{s}]", s, p, off, 0) for s, (p, off) in enumerate(ls.cursors) if (p, off) != (0, 0)]
    places += [(field, s, p, off, n) for field, (s, p, off, n) in _refs(ls)]
    for field, source, position, offset, length in places:
        src = plan.sources[source]
        at = split_at(len(src.splits), config.lanes, config.max_epochs, ls.lane, position)
        value = (position, offset) if field.startswith("cursors") else (source, position, offset, length)
        if at is None:
            bad(field, value, f"split position {position} of source {src.name!r} lies past the end of the data "
                f"(max_epochs = {config.max_epochs})")
        split = src.splits[_permutation(len(src.splits), config.seed, source, at[0])[at[1]]]
        shard = src.shards[split.shard]
        if shard.frames:  # zstd: decoded sizes are unknown until the frames are read
            continue
        tail = shard.size - split.start  # a split's last record may run on past its end
        if offset + length > tail or (length and offset >= split.end - split.start):
            bad(field, value, f"the split at position {position} is bytes [{split.start}, {split.end}) of "
                f"{shard.key!r} ({shard.size} bytes): the offset lies outside it")


@functools.lru_cache(maxsize=16)
def _permutation(n: int, seed: int, source: int, epoch: int) -> list[int]:
    return permutation(n, seed, source, epoch)
