"""A small safetensors reader/writer (no pickle): 8-byte little-endian header length, a JSON
header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian bytes. Loading memory-maps the file, so a pull writes in place."""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from zephon_stream.errors import AccessDenied, ConfigError, DataError, ObjectNotFound, ZephonError

__all__ = ["Mapped", "allocate", "load", "load_index", "save", "shard_files"]

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    **{k: v for k, v in (("F8_E8M0", getattr(torch, "float8_e8m0fnu", None)),
                         ("F4", getattr(torch, "float4_e2m1fn_x2", None))) if v is not None},
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# F4 counts FP4 values, two a byte; torch's float4_e2m1fn_x2 counts the bytes: the last dim differs by 2
_PACKED = {"F4": 2}
MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header
MAX_DIMS = 64  # torch's limit on a tensor's dims


class _Entry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    lo: int
    hi: int


def _header(path: str | os.PathLike[str]) -> tuple[int, dict[str, _Entry]]:
    """(offset of the data, the checked tensor entries): DataError naming the file for anything
    malformed, before any tensor is read."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise DataError(f"{where}: {size} bytes is too short for a safetensors file", key=where, offset=0)
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise DataError(f"{where}: not a safetensors file? Its first 8 bytes give a header length of {n}, "
                                f"more than the file ({size} bytes) or {MAX_HEADER}", key=where, offset=0)
            text = f.read(n)
    except OSError as exc:
        raise _os_error(where, exc) from exc
    header = _json(where, text)
    header.pop("__metadata__", None)
    entries = {name: _entry(where, name, info, size - 8 - n, 8 + n) for name, info in header.items()}
    spans = sorted((e.lo, e.hi, name) for name, e in entries.items() if e.hi > e.lo)
    for (_, hi, a), (lo, _, b) in itertools.pairwise(spans):
        if lo < hi:
            raise DataError(f"{where}: tensors {a!r} and {b!r} overlap at data byte {lo}", key=where, offset=8 + n + lo)
    return 8 + n, entries


def _json(where: str, text: bytes) -> dict:
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, a 5000-digit int, deep nesting
        raise DataError(f"{where}: header is not valid JSON ({_short(exc)})", key=where, offset=8) from exc
    if not isinstance(header, dict):
        raise DataError(f"{where}: header is a JSON {type(header).__name__}, not an object", key=where, offset=8)
    return header


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a repeated key (json keeps the last one silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {_short(key)} appears twice")
        out[key] = value
    return out


def _entry(where: str, name: str, info: object, data: int, start: int) -> _Entry:
    """One tensor's entry: a known dtype, a shape of ints, offsets inside the data, sizes that agree."""
    def bad(what: str, offset: int = 8) -> DataError:
        return DataError(f"{where}: tensor {_short(name)} {what}", key=where, offset=offset)

    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"has a bad header entry {_short(info)}: need exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise bad(f"has dtype {_short(dtype)}, not one of {sorted(_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise bad(f"has shape {_short(shape)}: need a list of at most {MAX_DIMS} ints >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"has data_offsets {_short(offsets)}: need [begin, end], ints >= 0")
    lo, hi = offsets
    if not lo <= hi <= data:
        raise bad(f"has data_offsets [{lo}, {hi}] outside the {data} data bytes of the file (or begin > end)",
                  start + min(lo, data))
    per = _PACKED.get(dtype, 1)
    if per > 1 and (not shape or shape[-1] % per):
        raise bad(f"is {dtype} of shape {shape}: its last dim must be a multiple of {per} (values packed {per} "
                  "a byte)")
    if per > 1:
        shape = [*shape[:-1], shape[-1] // per]
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if hi - lo != nbytes:
        raise bad(f"spans {hi - lo} bytes [{lo}, {hi}), but shape {info['shape']} of {dtype} needs {nbytes}",
                  start + lo)
    return _Entry(_DTYPES[dtype], tuple(shape), lo, hi)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _short(x: object, limit: int = 120) -> str:
    text = repr(x) if not isinstance(x, BaseException) else str(x)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _os_error(where: str, exc: OSError, doing: str = "read") -> ZephonError:
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFound(f"{where}: no such file")
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{where}: permission denied")
    if isinstance(exc, IsADirectoryError):
        return DataError(f"{where} is a directory, not a safetensors file", key=where)
    return DataError(f"{where}: cannot be {doing} ({exc.strerror or exc})", key=where)


class Mapped(dict[str, torch.Tensor]):
    """Tensors memory-mapped from one file (or the files of a sharded checkpoint, `files`);
    `flush()` makes in-place writes durable."""

    def __init__(self, mm: np.memmap | None, files: Sequence[str] = ()) -> None:
        super().__init__()
        self._mms = [mm] if mm is not None else []
        self.files = list(files)

    def flush(self) -> None:
        for mm in self._mms:
            mm.flush()


def load_index(path: str | os.PathLike[str], *, writable: bool = False) -> Mapped:
    """The tensors of a sharded checkpoint, named by its Hugging Face index
    (`model.safetensors.index.json`: `{"weight_map": {tensor: file}}`, files beside it), as one
    mapping. Every file's tensors must be the ones the index gives it, each in one file only."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read(MAX_HEADER + 1))
    except OSError as exc:
        raise _os_error(where, exc) from exc
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a 5000-digit int, deep nesting
        raise DataError(f"{where}: not a safetensors index (JSON with a weight_map): {_short(exc)}", key=where) from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise DataError(f"{where}: not a safetensors index: it needs a weight_map of tensor names to file names",
                        key=where)
    root = os.path.dirname(os.path.abspath(where))
    files = sorted(set(weight_map.values()))
    out = Mapped(None, [os.path.join(root, name) for name in files])
    for name, full in zip(files, out.files, strict=True):
        if os.path.basename(name) != name:
            raise DataError(f"{where}: file {name!r} is not a file name beside the index", key=where)
        part = load(full, writable=writable)
        want = sorted(k for k, v in weight_map.items() if v == name)
        if sorted(part) != want:
            extra, missing = sorted(set(part) - set(want)), sorted(set(want) - set(part))
            raise DataError(f"{full} does not hold the tensors its index gives it: {len(missing)} missing "
                            f"{missing[:3]}, {len(extra)} not in the index {extra[:3]}", key=full)
        out.update(part)
        out._mms += part._mms
    return out


def load(path: str | os.PathLike[str], *, writable: bool = False) -> Mapped:
    """Tensors memory-mapped from `path`. With writable=True, writes to them go to the file.

    A missing file is ObjectNotFound, an unreadable one AccessDenied, a malformed one DataError."""
    start, entries = _header(path)
    where = os.fspath(path)
    for name, e in entries.items():
        if (start + e.lo) % e.dtype.itemsize and writable:
            raise DataError(f"{where}: tensor {name!r} is not aligned to its {e.dtype.itemsize}-byte elements, so it "
                            "cannot be updated in place: rewrite the file with zephon's or HF's writer",
                            key=where, offset=start + e.lo)
    total = max((e.hi for e in entries.values()), default=0)
    try:
        mode = "r+" if writable else "c"
        mm = np.memmap(path, dtype=np.uint8, mode=mode, offset=start, shape=(total,)) if total else None
    except OSError as exc:
        raise _os_error(where, exc) from exc
    out = Mapped(mm)
    for name, e in entries.items():
        buf = torch.from_numpy(mm[e.lo : e.hi]) if mm is not None and e.hi > e.lo else torch.empty(0, dtype=torch.uint8)
        if (start + e.lo) % e.dtype.itemsize:
            buf = buf.clone()  # a read-only load may copy a misaligned tensor
        out[name] = buf.view(e.dtype).reshape(e.shape)
    return out


def save(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
         metadata: dict[str, str] | None = None) -> None:
    """Write tensors to `path` atomically, widest elements first so every tensor stays aligned."""
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ConfigError(f"tensor {name!r} is {t.dtype}, which safetensors cannot hold: use one of "
                              f"{sorted(_DTYPES)}")
    text, order, _ = _layout({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, metadata)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            t = tensors[name].detach().contiguous().cpu()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)


def allocate(path: str | os.PathLike[str], tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
             metadata: dict[str, str] | None = None) -> None:
    """Create `path` holding zero-filled tensors of these dtypes and shapes, laid out as `save`
    lays them out, without writing the zeros (a sparse file where the filesystem has them).
    An existing file at `path` is replaced. Its blocks are reserved (`posix_fallocate`, where the
    filesystem has it): a sparse file on a full disk is created, and the first write through its
    memory map is a SIGBUS, not an error."""
    for name, (dtype, _) in tensors.items():
        if dtype not in _NAMES:
            raise ConfigError(f"tensor {name!r} is {dtype}, which safetensors cannot hold: use one of "
                              f"{sorted(_DTYPES)}")
    text, _, total = _layout(tensors, metadata)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            f.truncate(8 + len(text) + total)
            _reserve(f.fileno(), 8 + len(text) + total)
    except OSError as exc:
        raise _os_error(os.fspath(path), exc, "written") from exc


def _reserve(fd: int, size: int) -> None:
    """Reserve `size` bytes of disk for `fd`: ENOSPC now, as an OSError. A filesystem that cannot
    (EOPNOTSUPP, EINVAL) keeps the file sparse."""
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise


def shard_files(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], max_bytes: int,
                stem: str = "model") -> dict[str, list[str]]:
    """The files of a sharded checkpoint of `tensors` with at most `max_bytes` of tensor data each,
    split and named as Hugging Face's `save_pretrained` does (huggingface_hub's split): in the
    tensors' order, a file takes tensors until the next would pass the bound; a tensor over it
    gets a file of its own, placed before the file being filled. `{stem}-00001-of-00003.safetensors`,
    or `{stem}.safetensors` for one file."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > max_bytes:
            groups.append([name])
            continue
        if size + nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return {f"{stem}.safetensors": groups[0]}
    return {f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors": names for i, names in enumerate(groups, 1)}


def _layout(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
            ) -> tuple[bytes, list[str], int]:
    """(the padded JSON header, the names in file order, the data bytes) for these tensors."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    order = sorted(tensors, key=lambda k: (-tensors[k][0].itemsize, k))
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * dtype.itemsize
        per = _PACKED.get(_NAMES[dtype], 1)
        if per > 1 and not shape:
            raise ConfigError(f"tensor {name!r} is a 0-dim {dtype}: safetensors counts its values along the last "
                              f"dim ({per} a byte), so it needs one: reshape it to (1,)")
        shown = [*shape[:-1], shape[-1] * per] if per > 1 and shape else list(shape)
        header[name] = {"dtype": _NAMES[dtype], "shape": shown, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keeps tensor data 8-byte aligned
    return text, order, offset
