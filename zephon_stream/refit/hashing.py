"""The additive whole-model hash, updatable from a delta alone.

    digest(model) = sum over elements of  mix(p, v)   (mod 2**64)

where p is the element's canonical byte offset and v its bit pattern zero-extended to 64 bits.
Because the sum is additive, a chunk's or the model's digest moves by
`sum mix(p, new) - sum mix(p, old)` over the changed elements only: O(delta) to update, and the
same value whatever the sharding or chunking that produced it. `mix` is a splitmix64-style
finalizer, so swapping values between positions or flipping bits changes the digest with
probability ~1 - 2**-64. It detects faults, not forgeries: objects carry blake2b digests for that.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MASK", "contiguous_sum", "element_sum", "element_sums"]

MASK = (1 << 64) - 1
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)
_S31, _S29, _S32 = np.uint64(31), np.uint64(29), np.uint64(32)
_BLOCK = 1 << 18


def element_sum(positions: np.ndarray, values: np.ndarray) -> int:
    """sum of mix(p, v) mod 2**64 over matching arrays of byte offsets and word values."""
    return element_sums(positions, values)[0]


def element_sums(positions: np.ndarray, *values: np.ndarray) -> list[int]:
    """element_sum for several value arrays at the same positions, mixing the positions once."""
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
    """element_sum over values laid back to back from canonical byte offset `base`.

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
