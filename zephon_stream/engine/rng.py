"""Counter-based randomness: every random choice is a pure function of its inputs.

No RNG object is ever carried in state. `mix64(a, b, ...)` folds integers through SplitMix64's
finalizer; a permutation of `n` items for (seed, source, epoch) is a Fisher-Yates shuffle
whose j-th draw is `mix64(seed, source, epoch, j)`. The functions are stable across Python,
NumPy and platform versions because they use only 64-bit integer arithmetic.
"""

from __future__ import annotations

__all__ = ["mix64", "permutation"]

_M = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M
    return x ^ (x >> 31)


def mix64(*values: int) -> int:
    """A 64-bit hash of a tuple of integers."""
    h = 0x6A09E667F3BCC908
    for v in values:
        h = _splitmix(h ^ (v & _M))
    return h


def permutation(n: int, *key: int) -> list[int]:
    """A uniformly random permutation of range(n), a pure function of `key`."""
    out = list(range(n))
    for j in range(n - 1, 0, -1):
        r = mix64(*key, j) % (j + 1)
        out[j], out[r] = out[r], out[j]
    return out
