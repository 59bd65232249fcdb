"""A rank's local tensors as word arrays, and per-chunk plans mapping chunk words to them.

A `ChunkPlan` is the affine map of one publisher chunk onto one local state, computed once:
for each tensor part of the chunk it knows whether the local rank holds exactly the
publisher's piece (`same`: a contiguous slice), the whole tensor (`whole`), or some other
piece (`other`: held elements are found per position). Reads, writes and digests go through
it, on CPU by numpy views of the tensors' memory, on CUDA by torch indexing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from zephon_stream.errors import ConfigError
from zephon_stream.refit.hashing import MASK, Plane, contiguous_sum, cut, element_sum, element_sums, weave, weave_sum
from zephon_stream.refit.layout import WORD, Chunk, Piece, RankStream, Sharding, TensorTable

__all__ = ["ChunkPlan", "LocalState", "Placed", "same_memory", "sync_tied", "tied"]

_TORCH_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Placed(NamedTuple):
    """A tensor of `shape` that lives inside `host` (e.g. q_proj inside a fused qkv_proj):
    its element e is host element `piece.to_global(e)`, the same affine map a shard uses."""

    host: torch.Tensor
    piece: Piece
    shape: tuple[int, ...]


class LocalState:
    """The tensors of one rank, checked against the global table and that rank's sharding.

    A tensor may be given as `Placed` inside a larger host tensor: reads and writes then go
    through its map into the host's memory."""

    def __init__(self, table: TensorTable, sharding: Sharding,
                 tensors: Mapping[str, torch.Tensor | Placed]) -> None:
        if set(tensors) != set(table.index):
            missing, extra = sorted(set(table.index) - set(tensors)), sorted(set(tensors) - set(table.index))
            raise ConfigError(f"state_dict does not match the tensor table: missing {missing}, unexpected {extra}")
        self.table, self.sharding = table, sharding
        self.pieces: list[Piece] = []
        self.words: list[np.ndarray | torch.Tensor] = []
        self.hosts: list[Piece | None] = []  # local element -> host element, for Placed tensors
        for spec in table.specs:
            t = tensors[spec.name]
            want = sharding.local_shape(spec)
            shape = t.shape if isinstance(t, Placed) else tuple(t.shape)
            if isinstance(t, Placed):
                self.hosts.append(t.piece)
                t = t.host
            else:
                self.hosts.append(None)
            if str(t.dtype).removeprefix("torch.") != spec.dtype or tuple(shape) != want:
                raise ConfigError(
                    f"tensor {spec.name!r} is {t.dtype} {tuple(shape)}, expected torch.{spec.dtype} {want}"
                )
            if t.layout != torch.strided:
                raise ConfigError(f"tensor {spec.name!r} is {str(t.layout).removeprefix('torch.')}: a refit moves "
                                  "dense tensors: call .to_dense() before it")
            if t.device.type == "meta":  # it has no memory: a pull would write nowhere and say it had
                raise ConfigError(f"tensor {spec.name!r} is on the meta device and holds no data: allocate it "
                                  "first (e.g. module.to_empty(device=...))")
            if not t.is_contiguous():
                raise ConfigError(f"tensor {spec.name!r} is not contiguous: call .contiguous() before a refit")
            flat = t.detach().reshape(-1).view(_TORCH_WORD[spec.itemsize])
            self.words.append(flat.numpy().view(WORD[spec.itemsize]) if flat.device.type == "cpu" else flat)
            self.pieces.append(sharding.piece(spec))
        # tensors of the table that share memory here (a target that ties what the version holds apart)
        self.shared = _shared_memory([(i, tensors[spec.name]) for i, spec in enumerate(table.specs)])

    def host_index(self, tensor: int, e: np.ndarray) -> np.ndarray:
        """Where local elements `e` of table tensor `tensor` are in its word array."""
        host = self.hosts[tensor]
        return e if host is None else host.to_global(e)


def _shared_memory(indexed: Sequence[tuple[int, torch.Tensor | Placed]]) -> list[tuple[int, int]]:
    """The pairs of tensors (by table index) whose memory overlaps. Tensors placed in one host
    (`Fuse`) hold pieces of it the name map checked, and are not compared with each other."""
    spans = []
    for i, t in indexed:
        host = t.host if isinstance(t, Placed) else t
        size = host.numel() * host.element_size()
        if size:
            start = host.untyped_storage().data_ptr() + host.storage_offset() * host.element_size()
            spans.append((str(host.device), start, start + size, i, id(host) if isinstance(t, Placed) else None))
    spans.sort(key=lambda s: s[:2])
    pairs, open_ = [], []  # spans that start before the current one and may still reach it
    for dev, start, end, i, host in spans:
        open_ = [o for o in open_ if o[0] == dev and o[2] > start]
        pairs += [(o[3], i) for o in open_ if o[4] is None or o[4] != host]
        open_.append((dev, start, end, i, host))
    return pairs


def _memory(t: torch.Tensor) -> tuple:
    """Which elements of which memory `t` views: equal for two names of one tensor."""
    return t.device, t.dtype, tuple(t.shape), t.stride(), t.untyped_storage().data_ptr(), t.storage_offset()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements of the same memory (tied weights: one Parameter
    under two names, as an embedding and an LM head that share it)."""
    return _memory(a) == _memory(b)


def tied(state: Mapping[str, torch.Tensor], keep: Sequence[str] = ()) -> dict[str, str]:
    """{name: the first earlier name of the same memory} over `state`, in its order: the names a
    refit carries once. Empty and non-strided tensors are never tied; names in `keep` never are."""
    first: dict[tuple, str] = {}
    out = {}
    for name, t in state.items():
        if name in keep or not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0 \
                or t.device.type == "meta":
            continue
        key = _memory(t)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def sync_tied(targets: Mapping[str, torch.Tensor | Placed], aliases: Mapping[str, str]) -> list[tuple[str, str]]:
    """The (alias, source) pairs of `targets` whose alias must be copied from its source after a
    pull: those that are not the same memory. A ConfigError if an alias cannot hold its source."""
    out = []
    for alias, source in aliases.items():
        if alias not in targets:
            continue  # a state without the tied name (a checkpoint that stores it once)
        a, s = targets[alias], targets.get(source)
        if s is None:
            raise ConfigError(f"tensor {alias!r} is published as a tie of {source!r}, which the state does not hold")
        if isinstance(a, Placed) or isinstance(s, Placed):
            raise ConfigError(f"tensor {alias!r} (tied to {source!r} in the published version) is mapped into a "
                              "fused tensor: map tied tensors by name only")
        if a.dtype != s.dtype or a.shape != s.shape:
            raise ConfigError(f"tensor {alias!r} is {a.dtype} {tuple(a.shape)}, but it is published as a tie of "
                              f"{source!r}, {s.dtype} {tuple(s.shape)}")
        if not same_memory(a, s):
            out.append((alias, source))
    return out


class _Part(msgspec.Struct, frozen=True):
    tensor: int
    word0: int  # first chunk word of this part
    nwords: int
    elem0: int  # publisher-local element index of word0
    pub: Piece
    mode: str  # "same" | "whole" | "other"


class ChunkPlan:
    """Where the words of `chunk` (of publisher stream `stream`) live in `local`."""

    def __init__(self, chunk: Chunk, stream: RankStream, local: LocalState) -> None:
        self.chunk, self.local, self.table = chunk, local, stream.table
        self.parts: list[_Part] = []
        w = chunk.itemsize
        for seg in stream.segments_in(chunk):
            lo, hi = max(seg.start, chunk.offset), min(seg.start + seg.nbytes, chunk.offset + chunk.length)
            mine = local.pieces[seg.tensor]
            mode = "same" if mine == seg.piece else "whole" if mine.whole else "other"
            self.parts.append(
                _Part(seg.tensor, (lo - chunk.offset) // w, (hi - lo) // w, (lo - seg.start) // w, seg.piece, mode)
            )
        self.owned = all(p.mode != "other" for p in self.parts)
        self.on_cpu = all(isinstance(local.words[p.tensor], np.ndarray) for p in self.parts)

    def _split(self, pos: np.ndarray) -> list[tuple[_Part, np.ndarray | slice, np.ndarray]]:
        """(part, index into pos, local element) for each part, keeping only locally held elements."""
        if len(self.parts) == 1 and self.parts[0].mode == "same":
            p = self.parts[0]
            return [(p, slice(None), pos + (p.elem0 - p.word0) if p.elem0 != p.word0 else pos)]
        out: list[tuple[_Part, np.ndarray | slice, np.ndarray]] = []
        bounds = np.searchsorted(pos, [p.word0 for p in self.parts] + [self.chunk.words])
        for k, p in enumerate(self.parts):
            sel = np.arange(bounds[k], bounds[k + 1])
            e = pos[sel] - p.word0 + p.elem0
            if p.mode == "same":
                out.append((p, sel, e))
                continue
            g = p.pub.to_global(e)
            if p.mode == "whole":
                out.append((p, sel, g))
                continue
            held, local = self.local.pieces[p.tensor].from_global(g)
            out.append((p, sel[held], local[held]))
        return out

    def canonical(self, p: _Part, e_pub: np.ndarray) -> np.ndarray:
        spec = self.table.specs[p.tensor]
        return spec.offset + p.pub.to_global(e_pub).astype(np.uint64) * np.uint64(spec.itemsize)

    def gather(self, pos: np.ndarray) -> np.ndarray:
        """Current values at chunk positions (an owned chunk only)."""
        out = np.empty(len(pos), dtype=WORD[self.chunk.itemsize])
        for p, sel, e in self._split(pos):
            out[sel] = _take(self.local.words[p.tensor], self.local.host_index(p.tensor, e))
        return out

    def read(self) -> np.ndarray:
        """The whole chunk as a fresh array (an owned chunk only)."""
        return self.gather(np.arange(self.chunk.words))

    def current(self) -> np.ndarray:
        """The whole chunk's words to read (an owned chunk only): a view when it is one, else a copy."""
        view = self.view()
        return view if view is not None else self.read()

    def view(self) -> np.ndarray | None:
        """The chunk's words as a view into local memory, when it is one contiguous CPU slice."""
        if len(self.parts) == 1 and self.parts[0].mode == "same" and self.on_cpu:
            p = self.parts[0]
            host = self.local.hosts[p.tensor]
            if host is not None and host.a != 1:
                return None  # interleaved in its host: reached through the map only
            start = p.elem0 + (host.lo * host.b if host is not None else 0)
            return self.local.words[p.tensor][start : start + p.nwords]
        return None

    def write(self, pos: np.ndarray, values: np.ndarray, *, xor: bool) -> None:
        """Set (or XOR) the locally held words at chunk positions."""
        for p, sel, e in self._split(pos):
            _put(self.local.words[p.tensor], self.local.host_index(p.tensor, e), values[sel], xor)

    def change_sum(self, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
        """sum mix(new) - sum mix(old) over chunk positions: the O(delta) digest update."""
        total = 0
        bounds = np.searchsorted(pos, [p.word0 for p in self.parts] + [self.chunk.words])
        for k, p in enumerate(self.parts):
            s = slice(bounds[k], bounds[k + 1])
            where = self.canonical(p, pos[s] - p.word0 + p.elem0)
            now, was = element_sums(where, new[s], old[s])
            total += now - was
        return total & MASK

    def load(self, planes: Sequence[Plane], out: np.ndarray) -> int:
        """Weave the whole chunk's byte planes (see `codec.full_planes`) into `out`, its words,
        and return the chunk's digest. A part of a whole tensor is woven and hashed in one pass
        over each word; a part of a shard piece is woven, then hashed at its canonical positions."""
        total = 0
        for p in self.parts:
            s = slice(p.word0, p.word0 + p.nwords)
            mine = [cut(plane, p.word0, p.word0 + p.nwords) for plane in planes]
            spec = self.table.specs[p.tensor]
            if p.pub.whole:
                total += weave_sum(spec.offset + p.elem0 * spec.itemsize, mine, out[s])
            else:
                weave(mine, out[s])
                total += element_sum(self.canonical(p, np.arange(p.elem0, p.elem0 + p.nwords)), out[s])
        return total & MASK

    def digest(self, words: np.ndarray) -> int:
        """Additive digest of a whole chunk given its words."""
        total = 0
        for p in self.parts:
            vals = words[p.word0 : p.word0 + p.nwords]
            spec = self.table.specs[p.tensor]
            if p.pub.whole:
                total += contiguous_sum(spec.offset + p.elem0 * spec.itemsize, spec.itemsize, vals)
            else:
                total += element_sum(self.canonical(p, np.arange(p.elem0, p.elem0 + p.nwords)), vals)
        return total & MASK


def _take(words: np.ndarray | torch.Tensor, e: np.ndarray) -> np.ndarray:
    if isinstance(words, np.ndarray):
        return words[e]
    return words[torch.from_numpy(e).to(words.device)].cpu().numpy().view(WORD[words.element_size()])


def _put(words: np.ndarray | torch.Tensor, e: np.ndarray, values: np.ndarray, xor: bool) -> None:
    if isinstance(words, np.ndarray):
        if xor:
            words[e] ^= values
        else:
            words[e] = values
        return
    idx = torch.from_numpy(e).to(words.device)
    vals = torch.from_numpy(np.ascontiguousarray(values).view(_np_signed(values))).to(words.device)
    if xor:
        words[idx] ^= vals
    else:
        words[idx] = vals


def _np_signed(values: np.ndarray) -> np.dtype:
    return np.dtype(np.uint8) if values.dtype.itemsize == 1 else np.dtype(f"<i{values.dtype.itemsize}")
