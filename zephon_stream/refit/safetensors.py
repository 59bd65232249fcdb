"""A small safetensors reader/writer (no pickle): 8-byte little-endian header length, a JSON
header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian bytes. Loading memory-maps the file, so a pull writes in place."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping

import numpy as np
import torch

from .._exceptions import DataError

__all__ = ["Mapped", "load", "save"]

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
MAX_HEADER = 100 << 20


def _header(path: str | os.PathLike[str]) -> tuple[int, dict[str, dict]]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DataError(f"{path}: {size} bytes is too short for a safetensors file", key=str(path), offset=0)
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise DataError(f"{path}: header length {n} exceeds the file or {MAX_HEADER}", key=str(path), offset=0)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: header is not JSON ({exc})", key=str(path), offset=8) from exc
    if not isinstance(header, dict):
        raise DataError(f"{path}: header is not a JSON object", key=str(path), offset=8)
    header.pop("__metadata__", None)
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = _DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{path}: tensor {name!r} has a bad header entry {info!r}", key=str(path), offset=8) from exc
        if any(d < 0 for d in shape) or not 0 <= lo <= hi <= data or hi - lo != math.prod(shape) * dtype.itemsize:
            raise DataError(f"{path}: tensor {name!r} span {lo}..{hi} does not fit shape {shape} and the file",
                            key=str(path), offset=8 + n + lo)
        spans.append((lo, hi, name))
    spans.sort()
    for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
        if lo < hi:
            raise DataError(f"{path}: tensors {a!r} and {b!r} overlap", key=str(path), offset=8 + n + lo)
    return 8 + n, header


class Mapped(dict[str, torch.Tensor]):
    """Tensors memory-mapped from one file; `flush()` makes in-place writes durable."""

    def __init__(self, mm: np.memmap | None) -> None:
        super().__init__()
        self._mm = mm

    def flush(self) -> None:
        if self._mm is not None:
            self._mm.flush()


def load(path: str | os.PathLike[str], *, writable: bool = False) -> Mapped:
    """Tensors memory-mapped from `path`. With writable=True, writes to them go to the file."""
    start, header = _header(path)
    total = os.path.getsize(path) - start
    mm = np.memmap(path, dtype=np.uint8, mode="r+" if writable else "c", offset=start, shape=(total,)) if total else None
    out = Mapped(mm)
    for name, info in header.items():
        dtype = _DTYPES[info["dtype"]]
        lo, hi = info["data_offsets"]
        if (start + lo) % dtype.itemsize and writable:
            raise DataError(f"{path}: tensor {name!r} is not aligned to its {dtype.itemsize}-byte elements, so it "
                            "cannot be updated in place: rewrite the file with zephon's or HF's writer",
                            key=str(path), offset=start + lo)
        buf = torch.from_numpy(mm[lo:hi]) if mm is not None and hi > lo else torch.empty(0, dtype=torch.uint8)
        if (start + lo) % dtype.itemsize:
            buf = buf.clone()  # a read-only load may copy a misaligned tensor
        out[name] = buf.view(dtype).reshape(info["shape"])
    return out


def save(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write tensors to `path` atomically, widest elements first so every tensor stays aligned."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset, blobs = 0, []
    for name in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keeps tensor data 8-byte aligned
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)
