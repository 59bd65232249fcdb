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
    """element_sum over values laid back to back from canonical byte offset `base`."""
    total = 0
    step = np.uint64(itemsize)
    for lo in range(0, len(values), _BLOCK):
        v = values[lo : lo + _BLOCK]
        p = np.arange(len(v), dtype=np.uint64)
        p *= step
        p += np.uint64(base + lo * itemsize)
        total += element_sum(p, v)
    return total & MASK
