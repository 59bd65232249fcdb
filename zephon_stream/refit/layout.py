"""Canonical layout: the tensor table, shardings, and the fixed affine maps between them.

A version's weights form one flat canonical byte space: tensors in a fixed order (grouped by
element size, then dtype, then name), each at a byte offset. A rank that holds a shard of a tensor
(split along one dim into `world_size` equal pieces, or the whole tensor) maps each local element
to a canonical element with an affine map, computed once::

    tensor viewed as [A, S, B] around its split dim; rank r holds s in [r*S/R, (r+1)*S/R)
    local (a, s, b)  ->  canonical a*S*B + (s + r*S/R)*B + b

A publisher rank's *stream* is its local tensors' bytes back to back in canonical tensor order
(replicated tensors only on rank 0). The stream is cut into chunks of at most `chunk_bytes`,
and never across a change of element size, so each chunk is an array of one word width.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from zephon_stream.errors import ConfigError

if TYPE_CHECKING:  # the layout is plain numbers: a relay node checks MANIFESTs without loading torch
    import torch

__all__ = ["ITEMSIZE", "MAX_CHUNK_BYTES", "Chunk", "Piece", "RankStream", "Sharding", "TensorSpec", "TensorTable",
           "check_chunk_bytes", "check_count", "dtype_of", "itemsize_of"]

MAX_CHUNK_BYTES = 1 << 30  # the largest chunk a manifest may declare (and a subscriber will decode)

# The dtypes a refit carries, by torch's name (`str(t.dtype)` without "torch."), and their sizes.
ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,  # MX block scales (MXFP8, MXFP4)
    "float4_e2m1fn_x2": 1,  # two FP4 values a byte (MXFP4 / NVFP4 weights): a refit moves the bytes
}
WORD = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called `name` (ConfigError if a refit cannot carry it). Imports torch."""
    import torch

    itemsize_of(name)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype {name!r} is not in torch {torch.__version__}: upgrade torch on this node")
    return dtype


def itemsize_of(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not supported by the refit codec: use one of "
                          f"{sorted(ITEMSIZE)}") from None


def check_count(name: str, value: object, lo: int) -> int:
    """`value` as an int >= lo, or ConfigError naming the parameter and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name}={value!r} must be an int >= {lo}")
    return value


def check_chunk_bytes(chunk_bytes: object) -> int:
    """`chunk_bytes` as an int, or ConfigError: a multiple of 8 (the widest word) in [8, MAX_CHUNK_BYTES]."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise ConfigError(f"chunk_bytes={chunk_bytes!r} must be an int, a multiple of 8 from 8 to {MAX_CHUNK_BYTES}")
    if not 8 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ConfigError(f"chunk_bytes={chunk_bytes} is out of range: use 8 to {MAX_CHUNK_BYTES} (1 GiB)")
    if chunk_bytes % 8:
        raise ConfigError(f"chunk_bytes={chunk_bytes} is not a multiple of 8: use {chunk_bytes - chunk_bytes % 8 or 8}")
    return chunk_bytes


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of the canonical table: global shape, and its byte offset in canonical space."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize_of(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class TensorTable:
    """Tensors in canonical order (element size descending, dtype, name) with their offsets."""

    def __init__(self, items: Iterable[tuple[str, str, tuple[int, ...]]]) -> None:
        specs = sorted(items, key=lambda it: (-itemsize_of(it[1]), it[1], it[0]))
        names = [s[0] for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate tensor names in table: {sorted(names)}")
        offset, out = 0, []
        for name, dtype, shape in specs:
            if any(d < 0 for d in shape):
                raise ConfigError(f"tensor {name!r} has a negative dimension in shape {shape}")
            spec = TensorSpec(name, dtype, tuple(int(d) for d in shape), offset)
            out.append(spec)
            offset += spec.nbytes
        self.specs: list[TensorSpec] = out
        self.nbytes = offset
        self.index = {s.name: i for i, s in enumerate(out)}
        self.digest = hashlib.blake2b(msgspec.msgpack.encode(out), digest_size=16).hexdigest()

    def __repr__(self) -> str:
        return f"TensorTable({len(self.specs)} tensors, {self.nbytes} bytes, digest={self.digest[:12]})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorTable) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @classmethod
    def from_specs(cls, specs: Iterable[TensorSpec]) -> TensorTable:
        return cls((s.name, s.dtype, s.shape) for s in specs)

    @classmethod
    def from_local(cls, state: Mapping[str, torch.Tensor], sharding: Sharding) -> TensorTable:
        """The global table of a rank's local state_dict: split dims scaled back by world_size."""
        import torch

        items = []
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):  # an int or a list in a state_dict: an AttributeError, before
                raise ConfigError(f"state_dict[{name!r}] is {type(t).__name__}, not a tensor: a refit version holds "
                                  "tensors only (publish the others another way, or as tensors)")
            shape = list(t.shape)
            dim = sharding.dims.get(name)
            if dim is not None:
                if not 0 <= dim < len(shape):
                    raise ConfigError(f"sharding splits {name!r} along dim {dim}, but its shape is {tuple(shape)}")
                shape[dim] *= sharding.world_size
            items.append((name, str(t.dtype).removeprefix("torch."), tuple(shape)))
        return cls(items)


class Sharding(msgspec.Struct, frozen=True):
    """Which part of each tensor a rank holds: tensors in `dims` are split along that dim into
    `world_size` equal pieces and the rank holds piece `rank`; all others are whole (replicas)."""

    rank: int = 0
    world_size: int = 1
    dims: dict[str, int] = {}

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"sharding rank={self.rank} world_size={self.world_size}: need 0 <= rank < world_size")

    def piece(self, spec: TensorSpec) -> Piece:
        dim = self.dims.get(spec.name)
        if dim is None or self.world_size == 1:
            return Piece(1, 1, spec.numel, 0, 1)
        if not 0 <= dim < len(spec.shape):
            raise ConfigError(f"sharding splits {spec.name!r} along dim {dim}, but its shape is {spec.shape}")
        size = spec.shape[dim]
        if size % self.world_size:
            raise ConfigError(
                f"tensor {spec.name!r} dim {dim} has size {size}, not divisible by world_size {self.world_size}"
            )
        a = math.prod(spec.shape[:dim])
        b = math.prod(spec.shape[dim + 1 :])
        step = size // self.world_size
        return Piece(a, size, b, self.rank * step, step)

    def local_shape(self, spec: TensorSpec) -> tuple[int, ...]:
        dim = self.dims.get(spec.name)
        if dim is None or self.world_size == 1:
            return spec.shape
        shape = list(spec.shape)
        shape[dim] //= self.world_size
        return tuple(shape)


class Piece(msgspec.Struct, frozen=True):
    """A tensor as [A, S, B] around its split dim, of which the rank holds s in [lo, lo+step)."""

    a: int
    s: int
    b: int
    lo: int
    step: int

    @property
    def whole(self) -> bool:
        return self.step == self.s

    def to_global(self, e: np.ndarray) -> np.ndarray:
        """Local element indices -> canonical element indices within the tensor (the affine map)."""
        if self.whole:
            return e
        inner = self.step * self.b
        a, rem = np.divmod(e, inner)
        return a * (self.s * self.b) + self.lo * self.b + rem

    def from_global(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Canonical element indices -> (held mask, local indices of the held ones)."""
        if self.whole:
            return np.ones(len(g), dtype=bool), g
        a, rem = np.divmod(g, self.s * self.b)
        s, b = np.divmod(rem, self.b)
        held = (s >= self.lo) & (s < self.lo + self.step)
        return held, (a * self.step + s - self.lo) * self.b + b


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    """A window [offset, offset+length) of publisher rank `rank`'s stream, of one word width."""

    rank: int
    offset: int
    length: int
    itemsize: int

    @property
    def words(self) -> int:
        return self.length // self.itemsize


class Segment(msgspec.Struct, frozen=True):
    """Tensor `tensor` (table index) at stream bytes [start, start+nbytes) of one rank."""

    tensor: int
    start: int
    nbytes: int
    piece: Piece


class RankStream:
    """Publisher rank `sharding.rank`'s stream over `table`, and its chunks."""

    def __init__(self, table: TensorTable, sharding: Sharding, chunk_bytes: int) -> None:
        check_chunk_bytes(chunk_bytes)
        self.table, self.sharding, self.chunk_bytes = table, sharding, chunk_bytes
        self.segments: list[Segment] = []
        pos = 0
        for i, spec in enumerate(table.specs):
            if spec.name not in sharding.dims and sharding.rank != 0:
                continue  # replicas are published by rank 0 alone
            piece = sharding.piece(spec)
            nbytes = piece.a * piece.step * piece.b * spec.itemsize
            self.segments.append(Segment(i, pos, nbytes, piece))
            pos += nbytes
        self.nbytes = pos
        self._starts = np.array([s.start for s in self.segments], dtype=np.int64)
        self.chunks = self._cut()

    def _cut(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        region_start, region_item = 0, 0
        for seg in [*self.segments, None]:
            item = self.table.specs[seg.tensor].itemsize if seg is not None else 0
            end = seg.start if seg is not None else self.nbytes
            if item != region_item or seg is None:
                for off in range(region_start, end, self.chunk_bytes):
                    chunks.append(Chunk(self.sharding.rank, off, min(self.chunk_bytes, end - off), region_item))
                region_start, region_item = end, item
        return chunks

    def segments_in(self, chunk: Chunk) -> list[Segment]:
        lo = int(np.searchsorted(self._starts, chunk.offset, side="right")) - 1
        out = []
        for seg in self.segments[max(lo, 0) :]:
            if seg.start >= chunk.offset + chunk.length:
                break
            if seg.start + seg.nbytes > chunk.offset and seg.nbytes:
                out.append(seg)
        return out
