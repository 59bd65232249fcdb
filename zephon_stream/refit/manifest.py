"""Version manifests, and the checks a hostile manifest must pass.

A MANIFEST lists every chunk of one version: its window, the sizes and blake2b digests of the
objects that carry it (where they live is `refit.versions`' business), and its plain digest.
`decode_manifest` trusts nothing it has not checked against the tensor table the manifest
itself declares; `read_bounded` never reads more than the size limit allows.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated

import msgspec

from zephon_stream.connectors.base import Store
from zephon_stream.errors import ConfigError, ConnectorError, DataError, RefitError
from zephon_stream.refit.layout import MAX_CHUNK_BYTES, RankStream, Sharding, TensorSpec, TensorTable, itemsize_of

__all__ = ["ChunkEntry", "Manifest", "check_publishable", "decode_manifest", "encode_manifest", "object_digest",
           "read_bounded"]

MAX_SIZE = 1 << 44  # bytes: a model, a chunk window, an object
MAX_WORLD = 1 << 16
MAX_DIMS, MAX_DIM = 16, 1 << 40
U64 = Annotated[int, msgspec.Meta(ge=0)]  # checked < 2**64 below
Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_SIZE)]
Version = Annotated[int, msgspec.Meta(ge=1, le=1 << 48)]
MAX_MANIFEST_BYTES = 64 << 20  # looked up at each call (tests lower it)
MAX_LAYOUT_SEGMENTS = 1 << 22  # tensor pieces over all ranks a manifest may make a reader lay out
ATTEMPT = re.compile(r"^[0-9a-f]{8,32}$")


class ChunkEntry(msgspec.Struct, frozen=True, array_like=True):
    """One chunk of one version: its window, its objects' sizes and digests, its plain digest."""

    rank: Size
    offset: Size
    length: Size
    itemsize: Annotated[int, msgspec.Meta(ge=1, le=8)]
    kind: Annotated[int, msgspec.Meta(ge=0, le=2)]  # 0: unchanged (no object), 1 sparse, 2 dense XOR
    size: Size = 0
    digest: str = ""  # blake2b-128 of the compressed delta object
    plain: U64 = 0  # additive digest of the chunk's bytes at this version
    changes: Size = 0
    key_size: Size = 0  # keyframe (FULL) object, on keyframe versions
    key_digest: str = ""
    over_size: Size = 0  # overwrite (SPARSE_SET) object, when published
    over_digest: str = ""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a subscriber needs to check and apply version `version`."""

    format: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    version: Version
    base_version: Version | None  # None: no delta, a pure keyframe
    keyframe: bool
    attempt: str
    table: list[TensorSpec]
    table_digest: str
    world_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD)]
    split_dims: dict[str, Annotated[int, msgspec.Meta(ge=0, le=64)]]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=8, le=1 << 32)]
    chunks: list[ChunkEntry]
    model_digest: U64
    base_model_digest: U64 | None = None
    model_bytes: Size = 0
    delta_bytes: Size = 0
    key_bytes: Size = 0
    over_bytes: Size = 0
    changes: Size = 0
    # tied tensors, carried once: {name: the table tensor whose memory it shares}; a subscriber
    # copies the source into a target that does not share it
    aliases: dict[str, str] = {}

    def sharding(self, rank: int) -> Sharding:
        return Sharding(rank=rank, world_size=self.world_size, dims=dict(self.split_dims))

    def follows_another(self, version: int, model_digest: int) -> bool:
        """Whether this is a delta from `version` of another model than `model_digest`: the prefix
        holding it was started again (or another tree writes it) since that version was read."""
        return self.base_version == version and self.base_model_digest != model_digest


class Part(msgspec.Struct, frozen=True):
    """One publisher rank's share of a version, written before the MANIFEST."""

    rank: int
    chunks: list[ChunkEntry]
    changes: int


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Manifest)
_part_dec = msgspec.msgpack.Decoder(Part)
# The largest a chunk's entry can encode to: bounds a manifest's size from its chunk count.
_ENTRY_BYTES = len(_enc.encode(ChunkEntry(MAX_WORLD, MAX_SIZE, MAX_SIZE, 8, 2, MAX_SIZE, "0" * 32, (1 << 64) - 1,
                                          MAX_SIZE, MAX_SIZE, "0" * 32, MAX_SIZE, "0" * 32)))


async def read_bounded(store: Store, key: str, limit: int | None = None) -> bytes:
    """The whole object `key`, read with one ranged read of at most `limit` + 1 bytes.

    `limit` defaults to MAX_MANIFEST_BYTES, looked up at each call. An object over the limit is
    refused with RefitError naming the key and its size, never read whole into memory.
    ObjectNotFound (and any other store error) passes through.
    """
    limit = MAX_MANIFEST_BYTES if limit is None else limit
    data = await store.read(key, 0, limit + 1)
    if len(data) <= limit:
        return data
    try:
        size = f"{(await store.head(key)).size} bytes"
    except ConnectorError:
        size = "more than that"  # gone since the read: the size no longer matters
    raise RefitError(f"{key} is {size}, over the {limit}-byte limit of a refit MANIFEST or record: not written by "
                     "zephon (corrupt or hostile); delete it, or publish a new version past it")


def check_publishable(table: TensorTable, sharding: Sharding, chunk_bytes: int) -> None:
    """Refuse (ConfigError) a layout whose MANIFEST no reader would accept, before anything is written."""
    _check_table(table.specs)
    if table.nbytes > MAX_SIZE:
        raise ConfigError(f"the model holds {table.nbytes} bytes, over the {MAX_SIZE}-byte limit of one prefix")
    world = sharding.world_size
    if world > MAX_WORLD:
        raise ConfigError(f"world_size={world} is over the limit of {MAX_WORLD} ranks")
    unknown = sorted(set(sharding.dims) - set(table.index))
    if unknown:
        raise ConfigError(f"sharding splits tensors {unknown} that the state_dict does not hold")
    _check_segments(len(table.specs), world, len(sharding.dims))
    chunks = sum(len(RankStream(table, Sharding(r, world, sharding.dims), chunk_bytes).chunks) for r in range(world))
    size = len(_enc.encode(table.specs)) + chunks * _ENTRY_BYTES + 4096
    if size > MAX_MANIFEST_BYTES:
        raise ConfigError(f"{chunks} chunks would make a MANIFEST of up to {size} bytes, over the "
                          f"{MAX_MANIFEST_BYTES}-byte limit: raise chunk_bytes")


def _check_table(specs: list[TensorSpec]) -> None:
    for spec in specs:
        itemsize_of(spec.dtype)
        if len(spec.shape) > MAX_DIMS or any(d < 0 or d > MAX_DIM for d in spec.shape):
            raise ConfigError(f"tensor {spec.name!r} has shape {spec.shape}: a refit tensor has at most {MAX_DIMS} "
                              f"dims of at most {MAX_DIM} elements each")


def _check_segments(tensors: int, world_size: int, split: int) -> None:
    """Laying out every rank's stream makes one piece per tensor on rank 0 and per split tensor on
    the others: bound that work before doing it."""
    segments = tensors + (world_size - 1) * split
    if segments > MAX_LAYOUT_SEGMENTS:
        raise ConfigError(f"{tensors} tensors, {split} split over {world_size} ranks make {segments} tensor pieces, "
                          f"over the limit of {MAX_LAYOUT_SEGMENTS}")


def object_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def encode_manifest(m: Manifest | Part) -> bytes:
    return _enc.encode(m)


def decode_part(data: bytes, key: str) -> Part:
    try:
        return _part_dec.decode(data)
    except msgspec.DecodeError as exc:
        raise DataError(f"{key}: not a valid part record ({exc})", key=key) from exc


def decode_manifest(data: bytes, key: str, *, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> tuple[Manifest, TensorTable]:
    """Decode and check a MANIFEST: strict types, then every size, offset and digest relation.

    Refuses with DataError naming the key and the offending field; never trusts a size before
    checking it against the tensor table the manifest itself declares.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise DataError(f"{key}: manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}", key=key)
    try:
        m = _dec.decode(data)
    except msgspec.DecodeError as exc:
        raise DataError(f"{key}: not a valid refit manifest ({exc})", key=key) from exc
    try:
        table = _check(m, max_chunk_bytes)
    except (ValueError, OverflowError) as exc:
        raise DataError(f"{key}: invalid manifest for version {m.version}: {exc}", key=key) from exc
    return m, table


def _check(m: Manifest, max_chunk_bytes: int) -> TensorTable:
    if not ATTEMPT.match(m.attempt):
        raise ValueError(f"attempt tag {m.attempt!r} is not 8-32 lowercase hex digits")
    if m.base_version is not None and m.base_version != m.version - 1:
        raise ValueError(f"base_version {m.base_version} is not version-1 = {m.version - 1}")
    if m.base_version is None and not m.keyframe:
        raise ValueError("a version without a base must be a keyframe")
    if (m.base_version is None) != (m.base_model_digest is None):
        raise ValueError("base_version and base_model_digest come together: a delta names its base's digest")
    if m.chunk_bytes > max_chunk_bytes:
        raise ValueError(f"chunk_bytes {m.chunk_bytes} is over the limit of {max_chunk_bytes}")
    if m.chunk_bytes % 8:
        raise ValueError(f"chunk_bytes {m.chunk_bytes} is not a multiple of 8")
    _check_table(m.table)
    _check_segments(len(m.table), m.world_size, len(m.split_dims))
    table = TensorTable.from_specs(m.table)
    if table.digest != m.table_digest or [s.offset for s in table.specs] != [s.offset for s in m.table]:
        raise ValueError(f"tensor table digest {m.table_digest!r} does not match its tensors ({table.digest!r})")
    digests = [c.plain for c in m.chunks] + [m.model_digest, m.base_model_digest or 0]
    if max(digests) >= 1 << 64:
        raise ValueError("a digest does not fit in 64 bits")
    if sum(c.plain for c in m.chunks) % (1 << 64) != m.model_digest:
        raise ValueError(f"model_digest {m.model_digest:016x} is not the sum of the chunk digests")
    if m.model_bytes != table.nbytes:
        raise ValueError(f"model_bytes {m.model_bytes} but the table holds {table.nbytes}")
    if table.nbytes > len(m.chunks) * m.chunk_bytes:
        raise ValueError(f"table of {table.nbytes} bytes cannot fit in {len(m.chunks)} chunks of {m.chunk_bytes}")
    if set(m.split_dims) - set(table.index):
        raise ValueError(f"split_dims names unknown tensors {sorted(set(m.split_dims) - set(table.index))}")
    if len(m.aliases) > len(table.specs) * 16:
        raise ValueError(f"{len(m.aliases)} tied names for {len(table.specs)} tensors")
    for alias, source in m.aliases.items():
        if alias in table.index or source not in table.index or source in m.split_dims:
            raise ValueError(f"tied name {alias!r} -> {source!r}: a tie names a tensor outside the table as an "
                             "unsplit tensor of it")
    expected = [c for r in range(m.world_size) for c in RankStream(table, m.sharding(r), m.chunk_bytes).chunks]
    if len(expected) != len(m.chunks):
        raise ValueError(f"{len(m.chunks)} chunks listed, the layout has {len(expected)}")
    for i, (c, e) in enumerate(zip(m.chunks, expected, strict=True)):
        _check_chunk(m, i, c, e)
    return table


def _check_chunk(m: Manifest, i: int, c: ChunkEntry, e: object) -> None:
    if (c.rank, c.offset, c.length, c.itemsize) != (e.rank, e.offset, e.length, e.itemsize):
        raise ValueError(f"chunk {i} window {(c.rank, c.offset, c.length, c.itemsize)} is not the layout's {e}")
    bound = 2 * c.length + 4096  # zstd never expands by more than this
    if c.size > bound or c.key_size > bound or c.over_size > bound + c.length * 8:
        raise ValueError(f"chunk {i} declares object sizes ({c.size}, {c.key_size}, {c.over_size}) over {bound}")
    if c.changes > c.length // c.itemsize:
        raise ValueError(f"chunk {i} declares {c.changes} changes in {c.length // c.itemsize} words")
    if (c.kind == 0) != (c.size == 0) or (c.kind == 0 and c.changes) or (c.kind and not c.changes):
        raise ValueError(f"chunk {i}: kind {c.kind}, size {c.size} and changes {c.changes} disagree")
    if m.base_version is None and c.kind:
        raise ValueError(f"chunk {i} has a delta in a version without a base")
    if m.keyframe != bool(c.key_size) and c.length:
        raise ValueError(f"chunk {i}: keyframe={m.keyframe} but key object size {c.key_size}")
    for size, dig in ((c.size, c.digest), (c.key_size, c.key_digest), (c.over_size, c.over_digest)):
        if bool(size) != bool(dig) or (dig and not re.fullmatch(r"[0-9a-f]{32}", dig)):
            raise ValueError(f"chunk {i}: object size {size} with digest {dig!r}")
