"""The additive whole-model hash, updatable from a delta alone.

    digest(model) = sum over elements of  mix(p, v)   (mod 2**64)

where p is the element's canonical byte offset and v its bit pattern zero-extended to 64 bits.
Because the sum is additive, a chunk's or the model's digest moves by
`sum mix(p, new) - sum mix(p, old)` over the changed elements only: O(delta) to update, and the
same value whatever the sharding or chunking that produced it. `mix` is a splitmix64-style
finalizer, so swapping values between positions or flipping bits changes the digest with
probability ~1 - 2**-64. It detects faults, not forgeries: objects carry blake2b digests for that.

Two implementations return the same values. The compiled one (`_digest.c`, built with the
package: the GIL is released, AVX2 loops where the CPU has them) runs about 4x faster than the
numpy code here, which is the reference and the fallback where the extension was not built.
The environment variable ZEPHON_DIGEST, read at import, chooses:

    unset or "auto"   compiled when it was built, else numpy
    "c"               compiled; ConfigError at import when it was not built (to catch a silent fallback)
    "numpy"           the numpy reference

`implementation()` says which one runs. `weave_sum` is the keyframe loader's one pass: byte
planes (as the codec stores them) woven into the chunk's words and hashed while they are in cache.
A plane is one buffer or a tuple of pieces (a raw plane read in place inside its zstd frame).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from zephon_stream.errors import ConfigError

__all__ = ["MASK", "Plane", "contiguous_sum", "cut", "element_sum", "element_sums", "implementation", "weave",
           "weave_sum"]

MASK = (1 << 64) - 1
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)
_S31, _S29, _S32 = np.uint64(31), np.uint64(29), np.uint64(32)
_BLOCK = 1 << 18

try:
    import zephon_stream.refit._digest as _compiled
except ImportError as exc:  # not built (no compiler when installed): the numpy reference serves
    _compiled, _MISSING = None, exc
else:
    _MISSING = None


def _choose(setting: str) -> ModuleType | None:
    if setting in ("", "auto"):
        return _compiled
    if setting == "numpy":
        return None
    if setting == "c":
        if _compiled is None:
            raise ConfigError(f"ZEPHON_DIGEST=c, but the compiled digest kernels did not import ({_MISSING}): "
                              "reinstall with a C compiler (pip install --no-build-isolation -e .), or unset it")
        return _compiled
    raise ConfigError(f"ZEPHON_DIGEST={setting!r} is not an implementation: use auto, c or numpy")


_kernel = _choose(os.environ.get("ZEPHON_DIGEST", ""))


def implementation() -> str:
    """'c' (the compiled kernels) or 'numpy' (the reference): which one computes digests."""
    return "numpy" if _kernel is None else "c"


def _words(values: np.ndarray, itemsize: int) -> bool:
    """Whether the compiled kernels read `values` as the reference does: 1-D unsigned native words
    (a signed view is sign-extended by numpy, so it stays on the reference)."""
    dt = values.dtype
    return values.ndim == 1 and dt.kind == "u" and dt.itemsize == itemsize and dt.isnative




def element_sum(positions: np.ndarray, values: np.ndarray) -> int:
    """sum of mix(p, v) mod 2**64 over matching arrays of byte offsets and word values."""
    return element_sums(positions, values)[0]


def element_sums(positions: np.ndarray, *values: np.ndarray) -> list[int]:
    """element_sum for several value arrays at the same positions."""
    k = _kernel
    if k is not None and all(_words(v, v.dtype.itemsize) and len(v) == len(positions) for v in values):
        pos = np.asarray(positions)
        if pos.dtype not in (np.dtype(np.uint64), np.dtype(np.int64)) or not pos.flags.c_contiguous:
            pos = np.ascontiguousarray(pos, dtype=np.uint64)  # int64 bits read as uint64: numpy's own cast
        return [k.element_sum(pos, v.dtype.itemsize, np.ascontiguousarray(v)) for v in values]
    return _element_sums(positions, *values)


def _element_sums(positions: np.ndarray, *values: np.ndarray) -> list[int]:
    """The reference: mixes the positions once for all value arrays."""
    totals = [0] * len(values)
    for lo in range(0, len(positions), _BLOCK):
        pk = np.asarray(positions[lo : lo + _BLOCK], dtype=np.uint64) * _K1
        for k, v in enumerate(values):
            x = np.asarray(v[lo : lo + _BLOCK]).astype(np.uint64)
            x *= _K2
            x += pk
            x ^= x >> _S31
            x *= _K3
            x ^= x >> _S29
            x *= _K1
            x ^= x >> _S32
            totals[k] += int(x.sum(dtype=np.uint64))
    return [t & MASK for t in totals]


def contiguous_sum(base: int, itemsize: int, values: np.ndarray) -> int:
    """element_sum over values laid back to back from canonical byte offset `base`."""
    k = _kernel
    if k is not None and _words(values, itemsize):
        return k.contiguous_sum(base, itemsize, np.ascontiguousarray(values))
    return _contiguous_sum(base, itemsize, values)


Plane = memoryview | bytes | np.ndarray | tuple[memoryview | bytes | np.ndarray, ...]  # a tuple: pieces in order


def weave(planes: Sequence[Plane], out: np.ndarray) -> None:
    """out's words from byte planes: plane b holds byte b (little-endian) of every word."""
    cols = _columns(planes, out)
    for b, plane in enumerate(planes):
        at = 0
        for piece in plane if isinstance(plane, tuple) else (plane,):
            data = np.frombuffer(piece, dtype=np.uint8)
            cols[at : at + len(data), b] = data
            at += len(data)


def weave_sum(base: int, planes: Sequence[Plane], out: np.ndarray) -> int:
    """`weave` planes into `out` and return contiguous_sum(base, itemsize, out): one pass compiled."""
    k = _kernel
    if k is not None and _words(out, out.dtype.itemsize):
        _columns(planes, out)  # the reference's checks and errors
        return k.weave_sum(base, tuple(planes), out)
    weave(planes, out)
    return _contiguous_sum(base, out.dtype.itemsize, out)


def cut(plane: Plane, lo: int, hi: int) -> Plane:
    """Bytes lo:hi of a plane, in the same form (pieces stay pieces: nothing is copied)."""
    if not isinstance(plane, tuple):
        return plane[lo:hi]
    out, at = [], 0
    for piece in plane:
        n = memoryview(piece).nbytes
        if at < hi and lo < at + n:
            out.append(piece[max(lo - at, 0) : min(hi - at, n)])
        at += n
    return tuple(out)


def _columns(planes: Sequence[Plane], out: np.ndarray) -> np.ndarray:
    """out as (words, itemsize) bytes, after checking the planes fit it."""
    w, n = out.dtype.itemsize, len(out)
    if out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"weave writes a contiguous writable 1-D array, not {out.ndim}-D {out.flags}")
    sizes = [sum(memoryview(q).nbytes for q in p) if isinstance(p, tuple) else memoryview(p).nbytes for p in planes]
    if sizes != [n] * w:
        raise ValueError(f"{len(planes)} planes of {sizes} bytes do not make {n} words of {w} bytes")
    return out.view(np.uint8).reshape(n, w)


def _contiguous_sum(base: int, itemsize: int, values: np.ndarray) -> int:
    """The reference for contiguous_sum.

    The position term p*K1 of a run is an arithmetic progression: one precomputed ramp
    (i * itemsize * K1) plus a per-block constant, and every step writes into two reused
    block buffers that stay in cache (~1.4x the throughput of `element_sum` on positions).
    """
    n = len(values)
    if not n:
        return 0
    block = min(n, _RUN_BLOCK)
    x, y = np.empty(block, np.uint64), np.empty(block, np.uint64)
    ramp = _ramp(itemsize)[:block]
    total = 0
    for lo in range(0, n, block):
        v = values[lo : lo + block]
        k = len(v)
        xs, ys = x[:k], y[:k]
        np.multiply(v, _K2, out=xs, dtype=np.uint64, casting="unsafe")
        xs += ramp[:k]
        xs += np.uint64(((base + lo * itemsize) * int(_K1)) & MASK)
        _finish(xs, ys)
        total += int(xs.sum(dtype=np.uint64))
    return total & MASK


_RUN_BLOCK = 1 << 16  # words: 512 KiB per uint64 buffer, two of them in L2
_ramps: dict[int, np.ndarray] = {}


def _ramp(itemsize: int) -> np.ndarray:
    """i * itemsize * K1 (mod 2**64) for i < _RUN_BLOCK, built once per word size (read-only)."""
    ramp = _ramps.get(itemsize)
    if ramp is None:
        ramp = np.arange(_RUN_BLOCK, dtype=np.uint64) * np.uint64((itemsize * int(_K1)) & MASK)
        ramp.flags.writeable = False
        ramp = _ramps.setdefault(itemsize, ramp)
    return ramp


def _finish(x: np.ndarray, y: np.ndarray) -> None:
    """The splitmix64 finalizer of `mix`, in place on x (y is scratch of the same length)."""
    x ^= np.right_shift(x, _S31, out=y)
    x *= _K3
    x ^= np.right_shift(x, _S29, out=y)
    x *= _K1
    x ^= np.right_shift(x, _S32, out=y)
