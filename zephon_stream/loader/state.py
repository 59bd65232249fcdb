"""Checkpoint state: typed plain data, msgpack-encoded, versioned, one record per lane.

A lane's state nests the states of its operators, in pipeline order, plus the lane's own
counters; it holds counters, cursors and document references, never payloads: restore
re-reads the (at most `shuffle_window + 1`, plus `packing_window` with best_fit packing)
referenced documents. Its size is bounded by the shuffle and packing windows and the number of
sources, whatever the dataset size or position.

```
LaneState(lane=3, samples=120, done=False,
          sources=[FeedState(position=4, offset=8812), ...],   # one per source: the next unread document
          mix=MixState(counts=[...], position=517, since=0, base=[]),   # since/base: see operators.mix
          shuffle=ShuffleState(window=[(0, 4, 1200, 310), ...], pulls=453),
          pack=PackState(carry=(1, 2, 0, 2048), offset=96))   # best_fit: window=[((0, 3, 88, 940), 0), ...]
```

Format 2 is this nesting; format 1 (one flat record per lane) is still read and converted.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NoReturn

import msgspec

from zephon_stream.engine.rng import permutation
from zephon_stream.errors import CheckpointError, IncompatibleState
from zephon_stream.loader.config import Config, ScheduleEntry
from zephon_stream.loader.plan import DataPlan, SourceData
from zephon_stream.operators.feed import FeedState
from zephon_stream.operators.mix import MixState
from zephon_stream.operators.pack import PackState
from zephon_stream.operators.shuffle import ShuffleState
from zephon_stream.operators.types import DocRef

__all__ = [
    "FORMAT_VERSION", "LaneState", "LoaderState", "Refusal", "StateHeader", "check_lane_state", "lane_key",
    "split_at", "state_from_bytes", "state_to_bytes",
]

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


class LaneState(msgspec.Struct, frozen=True, array_like=True):
    """One lane's state: its counters, then each operator's state in pipeline order."""

    lane: int
    samples: int  # samples this lane has handed out
    done: bool  # the lane's data is exhausted (max_epochs reached)
    sources: list[FeedState]  # per source: the cursor of the next unread document
    mix: MixState
    shuffle: ShuffleState
    pack: PackState
    shuffles: list[ShuffleState] = []  # shuffle_scope = "source": each source's window (empty: none yet, or "lane")

    @classmethod
    def initial(cls, lane: int, n_sources: int) -> LaneState:
        """The state of a lane that has handed out nothing."""
        return cls(lane, 0, False, [FeedState(0, 0)] * n_sources, MixState([0] * n_sources, 0),
                   ShuffleState([], 0), PackState(None, 0))


class _LaneStateV1(msgspec.Struct, frozen=True, array_like=True):
    """Format 1: the same content, flat."""

    lane: int
    samples: int
    done: bool
    cursors: list[tuple[int, int]]
    counts: list[int]
    position: int
    window: list[DocRef]
    pulls: int
    carry: DocRef | None
    carry_offset: int

    def upgrade(self) -> LaneState:
        return LaneState(self.lane, self.samples, self.done, [FeedState(p, o) for p, o in self.cursors],
                         MixState(self.counts, self.position), ShuffleState(self.window, self.pulls),
                         PackState(self.carry, self.carry_offset))


class StateHeader(msgspec.Struct, frozen=True):
    """What every rank's state carries: the format, what the state is valid for, and the position."""

    format_version: int
    order_digest: str
    data_fingerprint: str
    lanes: int
    global_batch_size: int
    step: int  # global batches consumed
    order: dict[str, Any] = {}  # the settings `order_digest` covers (Config.order_settings), to name a change
    # the Loader.set_weights log, in call order: one entry per call that changed it (every rank holds all of it)
    decisions: list[ScheduleEntry] = []
    data_sources: dict[str, SourceData] = {}  # by source name; absent in checkpoints before it


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
        if header.format_version not in READABLE_VERSIONS:
            raise CheckpointError(f"checkpoint format_version {header.format_version} is not supported: this "
                                  f"version of zephon-stream reads formats {READABLE_VERSIONS}; resume with the "
                                  "version that wrote it")
        if header.step < 0:
            raise IncompatibleState(f"checkpoint header field step = {header.step}: must be >= 0; the checkpoint "
                                    "was edited or damaged: use the file as saved or start fresh")
        keys = sorted(k for k in state if k.startswith("lane_"))
        if header.format_version == 1:
            lanes = [_decode(_lane_v1_decoder, state[k], k).upgrade() for k in keys]
        else:
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
_lane_v1_decoder = msgspec.msgpack.Decoder(_LaneStateV1)
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


def check_lane_state(ls: LaneState, config: Config, plan: DataPlan | None = None) -> None:
    """Refuse a lane state that no run of `config` (over `plan`'s data, when given) can write.

    Every field is checked against the config and against the others: counters, cursors,
    window and carry references (each a document already read, no two alike). With the plan,
    every split position must exist and, for JSON Lines, every offset lie inside its split.
    Raises `IncompatibleState` naming the lane and the field. What needs the data itself (a
    cursor at a record start, `pack.offset` within the carried document's tokens) is checked
    where the data is read again.
    """
    bad = Refusal(ls.lane)
    _check_counters(ls, config, bad)
    _check_cursors(ls, len(config.sources), bad)
    _check_pieces(ls, config.piece_tokens, bad)
    _check_refs(ls, config, bad)
    if plan is not None:
        _check_positions(ls, config, plan, bad)


class Refusal:
    """Raises IncompatibleState for one lane: `bad(field, value, why)`."""

    def __init__(self, lane: int) -> None:
        self.lane = lane

    def __call__(self, field: str, value: object, why: str) -> NoReturn:
        raise IncompatibleState(f"lane {self.lane} state field {field} = {value!r}: {why}; this state was not "
                                "written by a run of this config over this data (edited or damaged?): resume "
                                "from the checkpoint as saved, or start fresh")


def _check_counters(ls: LaneState, config: Config, bad: Refusal) -> None:
    mix, shuffle, pack = ls.mix, ls.shuffle, ls.pack
    if not 0 <= ls.lane < config.lanes:
        bad("lane", ls.lane, f"the config has lanes = {config.lanes}")
    for field, value in (("samples", ls.samples), ("mix.position", mix.position), ("shuffle.pulls", shuffle.pulls),
                         ("pack.offset", pack.offset)):
        if value < 0:
            bad(field, value, "must be >= 0")
    if len(mix.counts) != len(config.sources) or min(mix.counts, default=0) < 0:
        bad("mix.counts", mix.counts, f"needs one count >= 0 per source ({len(config.sources)} sources)")
    taken = sum(mix.counts)  # every document counts 1 (mix = "documents") or its tokens, at least its EOS
    if taken < mix.position or (config.mix == "documents" and taken != mix.position):
        bad("mix.counts", mix.counts, f"they add up to {taken} for {mix.position} documents taken (mix.position)")
    _check_mix_phase(ls, config, bad)
    if _by_source(config):
        _check_source_windows(ls, config, bad)
    elif ls.shuffles:
        bad("shuffles", f"{len(ls.shuffles)} windows", 'per-source windows need shuffle_scope = "source"')
    elif config.shuffle_window and shuffle.pulls + len(shuffle.window) != mix.position:
        bad("shuffle.pulls", shuffle.pulls, f"shuffle.pulls + window size ({len(shuffle.window)}) must equal "
            f"mix.position ({mix.position})")
    if not config.shuffle_window and shuffle.pulls:
        bad("shuffle.pulls", shuffle.pulls, "must be 0 with shuffle_window = 0")
    if ls.done and (not config.max_epochs or shuffle.window or any(w.window for w in ls.shuffles)
                    or pack.carry is not None or pack.window):
        bad("done", ls.done, "a lane is done only with max_epochs > 0, once its windows and carry are empty")


def _by_source(config: Config) -> bool:
    return config.shuffle_scope == "source" and config.shuffle_window > 0


def _check_source_windows(ls: LaneState, config: Config, bad: Refusal) -> None:
    """shuffle_scope = "source": the lane window is off; each source's window holds only its documents,
    and every document Mix took was pulled from one of them."""
    n = len(config.sources)
    if ls.shuffle.window or ls.shuffle.pulls:
        bad("shuffle", (len(ls.shuffle.window), ls.shuffle.pulls), 'the lane window is off with shuffle_scope = '
            '"source": it must be empty, with no pulls')
    if ls.shuffles and len(ls.shuffles) != n:
        bad("shuffles", f"{len(ls.shuffles)} windows", f"needs one window per source ({n} sources), or none")
    pulls = sum(w.pulls for w in ls.shuffles)
    if pulls != ls.mix.position:
        bad("shuffles", f"{pulls} pulls", f"the pulls of the sources' windows must add up to mix.position "
            f"({ls.mix.position})")
    for s, w in enumerate(ls.shuffles):
        if w.pulls < 0:
            bad(f"shuffles[{s}].pulls", w.pulls, "must be >= 0")
        if len(w.window) > config.shuffle_window:
            bad(f"shuffles[{s}].window", f"{len(w.window)} documents", f"holds at most shuffle_window = "
                f"{config.shuffle_window}")
        if any(ref[0] != s for ref in w.window):
            bad(f"shuffles[{s}].window", [tuple(r) for r in w.window if r[0] != s][:3],
                f"holds only documents of source {s}")


def _check_mix_phase(ls: LaneState, config: Config, bad: Refusal) -> None:
    """`mix.since` is a step the lane has reached; `mix.base` a count per source, each at most the count."""
    mix = ls.mix
    reached = ((ls.samples - 1) * config.lanes + ls.lane) // config.global_batch_size if ls.samples else 0
    if not 0 <= mix.since <= reached:
        bad("mix.since", mix.since, f"the weights in force start at a step in [0, {reached}], the step of the "
            f"lane's last sample ({ls.samples} samples)")
    if mix.base and (len(mix.base) != len(mix.counts) or not all(0 <= b <= c for b, c in zip(mix.base, mix.counts))):
        bad("mix.base", mix.base, f"needs one count per source, each in [0, mix.counts[s]] (counts {mix.counts})")
    if mix.base and not mix.since:
        bad("mix.base", mix.base, "must be empty while the step-0 weights are in force (mix.since = 0)")


def _check_cursors(ls: LaneState, n_sources: int, bad: Refusal) -> None:
    if len(ls.sources) != n_sources:
        bad("sources", [(c.position, c.offset) for c in ls.sources],
            f"needs one cursor per source ({n_sources} sources)")
    for s, cursor in enumerate(ls.sources):
        position, offset, piece = cursor.position, cursor.offset, cursor.piece
        if position < 0 or offset < 0 or piece < 0:
            bad(f"sources[{s}]", (position, offset, piece), "a split position, offset and piece must be >= 0")
        if (ls.mix.counts[s] == 0) != ((position, offset, piece) == (0, 0, 0)):
            bad(f"sources[{s}]", (position, offset), f"mix.counts[{s}] = {ls.mix.counts[s]}: a cursor moves "
                "exactly when documents of its source are taken")


def _check_pieces(ls: LaneState, size: int, bad: Refusal) -> None:
    for s, cursor in enumerate(ls.sources):
        if cursor.piece and (not size or cursor.piece % size):
            bad(f"sources[{s}]", (cursor.position, cursor.offset, cursor.piece), "a cursor inside a document "
                f"stands at a piece start, a multiple of piece_tokens = {size} (and only when it is set)")


def _check_refs(ls: LaneState, config: Config, bad: Refusal) -> None:
    if len(ls.shuffle.window) > config.shuffle_window:
        bad("shuffle.window", f"{len(ls.shuffle.window)} documents",
            f"holds at most shuffle_window = {config.shuffle_window}")
    _check_pack(ls.pack, config, bad)
    seen: set[tuple[int, ...]] = set()
    size = config.piece_tokens
    for field, ref in _refs(ls):
        if len(ref) != 4 and not (size and len(ref) == 5):
            bad(field, tuple(ref), "a document is (source, position, offset, length)" + (
                ", a piece of one the same and its first token" if size else " (pieces need piece_tokens)"))
        source, position, offset, length = ref[:4]
        if not 0 <= source < len(config.sources) or position < 0 or offset < 0 or length < 1:
            bad(field, tuple(ref), f"needs 0 <= source < {len(config.sources)}, position >= 0, offset >= 0 "
                "and length >= 1")
        if len(ref) == 5 and (ref[4] < 0 or ref[4] % size):
            bad(field, tuple(ref), f"a piece starts at a multiple of piece_tokens = {size}")
        cursor = ls.sources[source]
        read = (position, offset + length) <= (cursor.position, cursor.offset) or (
            len(ref) == 5 and (position, offset, ref[4]) < (cursor.position, cursor.offset, cursor.piece))
        if not read:
            bad(field, tuple(ref), f"the document lies past sources[{source}] = {(cursor.position, cursor.offset)}: "
                "only documents already read can be in the window or carried")
        key = (source, position, offset, *ref[4:])
        if key in seen:
            bad(field, tuple(ref), "the same document is referenced twice")
        seen.add(key)


def _refs(ls: LaneState) -> list[tuple[str, DocRef]]:
    refs = [(f"shuffle.window[{i}]", ref) for i, ref in enumerate(ls.shuffle.window)]
    refs += [(f"shuffles[{s}].window[{i}]", ref) for s, w in enumerate(ls.shuffles) for i, ref in enumerate(w.window)]
    refs += [(f"pack.window[{i}]", ref) for i, (ref, _) in enumerate(ls.pack.window)]
    return refs + ([("pack.carry", ls.pack.carry)] if ls.pack.carry is not None else [])


def _check_pack(pack: PackState, config: Config, bad: Refusal) -> None:
    """The fields each packing strategy writes: concat and none a carry (and none with truncate
    its counters, never a carry), best_fit a window and no carry. Whether an offset is where a
    piece starts needs the document's length: `BestFitPack.restore` checks it on the re-read data."""
    if pack.carry is None and pack.offset:
        bad("pack.offset", pack.offset, "must be 0 when no document is carried")
    if config.packing == "best_fit":
        if pack.carry is not None:
            bad("pack.carry", tuple(pack.carry), 'packing = "best_fit" carries nothing but its window')
        if len(pack.window) > config.packing_window:
            bad("pack.window", f"{len(pack.window)} documents", f"holds at most packing_window = "
                f"{config.packing_window}")
    elif pack.window:
        bad("pack.window", f"{len(pack.window)} documents", f'only packing = "best_fit" has a window, not '
            f"{config.packing!r}")
    misplaced = [off for _, off in pack.window if off < 0]  # where pieces start needs the document: see restore
    if misplaced:
        bad("pack.window", misplaced, "the offsets of the documents' next pieces must be >= 0")
    if config.packing == "none" and pack.offset % config.seq_len:
        bad("pack.offset", pack.offset, f"pieces start at multiples of seq_len = {config.seq_len}")
    if pack.truncated < 0 or pack.dropped < pack.truncated or (pack.truncated and not config.truncate):
        bad("pack.truncated", (pack.truncated, pack.dropped), "counts cut documents and their dropped tokens "
            "(0 <= truncated <= dropped), only with truncate = true")
    if config.truncate and pack.carry is not None:
        bad("pack.carry", tuple(pack.carry), "with truncate a document is never carried past its sample")


def split_at(n_splits: int, lanes: int, max_epochs: int, lane: int, position: int) -> tuple[int, int] | None:
    """(epoch, index in that epoch's permutation) of the split at `position` of `lane`'s sequence
    for a source of `n_splits` splits; None past the last epoch (`max_epochs` > 0)."""
    epoch, index = divmod(lane + position * lanes, n_splits)
    return None if max_epochs and epoch >= max_epochs else (epoch, index)


def _check_positions(ls: LaneState, config: Config, plan: DataPlan, bad: Refusal) -> None:
    """Each split position names a split of the data; JSONL offsets lie inside it."""
    places = [(f"sources[{s}]", s, c.position, c.offset, 0) for s, c in enumerate(ls.sources)
              if (c.position, c.offset) != (0, 0)]
    places += [(field, *ref[:4]) for field, ref in _refs(ls)]
    for field, source, position, offset, length in places:
        src = plan.sources[source]
        at = split_at(len(src.splits), config.lanes, config.max_epochs, ls.lane, position)
        value = (position, offset) if field.startswith("sources") else (source, position, offset, length)
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
