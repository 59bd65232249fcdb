"""Codec invariants: XOR round-trips for every bit pattern, composition, hostile objects refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import DataError
from zephon_stream.refit import codec
from zephon_stream.refit.layout import WORD

SPECIAL = {  # +-0, NaN payloads, inf, subnormals, for each width
    2: [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7E00, 0x7C01],
    4: [0, 0x80000000, 0x7FC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800000, 0x00000001, 0x807FFFFF],
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x7C, 0xFC],
    8: [0, 1 << 63, 0x7FF8000000000001, 0x7FF0000000000000, 1],
}


@st.composite
def pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    w = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 700))
    word = st.one_of(st.sampled_from(SPECIAL[w]), st.integers(0, (1 << (8 * w)) - 1))
    old = np.array(draw(st.lists(word, min_size=n, max_size=n)), dtype=WORD[w])
    new = old.copy()
    for i in draw(st.lists(st.integers(0, n - 1), max_size=n)):
        new[i] = draw(word)
    return old, new


@given(pairs(), st.sampled_from([1, 3]))
@settings(max_examples=150, deadline=None)
def test_xor_roundtrip_every_bit_pattern(pair: tuple[np.ndarray, np.ndarray], level: int) -> None:
    old, new = pair
    obj, pos, x = codec.encode_xor(old, new, level)
    differ = (old.view(np.uint8).reshape(len(old), -1) != new.view(np.uint8).reshape(len(new), -1)).any(1)
    assert pos.tolist() == np.flatnonzero(differ).tolist()  # bit patterns, never float equality
    if obj is None:
        assert old.tobytes() == new.tobytes()
        return
    d = codec.decode(obj, kinds=(codec.SPARSE_XOR, codec.DENSE_XOR), itemsize=old.itemsize, words=len(old), key="k")
    got = old.copy()
    p = d.positions if d.positions is not None else np.arange(len(old))
    got[p] ^= d.values if d.positions is not None else d.values
    assert got.tobytes() == new.tobytes()
    over = codec.encode_sparse(codec.SPARSE_SET, len(old), pos, new[pos])
    d = codec.decode(over, kinds=(codec.SPARSE_SET,), itemsize=old.itemsize, words=len(old), key="k")
    twice = old.copy()
    for _ in range(2):  # overwrite is idempotent: the retry form
        twice[d.positions] = d.values
    assert twice.tobytes() == new.tobytes()


def test_signed_zero_and_nan_payload_are_changes() -> None:
    old = np.array([0x0000, 0x7FC0, 0x3F80], dtype="<u2")  # +0.0, NaN, 1.0 in bf16
    new = np.array([0x8000, 0x7FC1, 0x3F80], dtype="<u2")  # -0.0, NaN with another payload, 1.0
    pos, _ = codec.diff(old, new)
    assert pos.tolist() == [0, 1]


@pytest.mark.parametrize("n", [0, 1, codec._DIFF_BLOCK - 1, codec._DIFF_BLOCK, codec._DIFF_BLOCK + 1,
                               3 * codec._DIFF_BLOCK + 7])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_blocked_diff_across_block_edges(n: int, width: int) -> None:
    rng = np.random.default_rng(n + width)
    old = rng.integers(0, 1 << (8 * width), n, dtype=np.uint64).astype(WORD[width])
    new = old.copy()
    edges = [i for b in range(0, n + 1, codec._DIFF_BLOCK) for i in (b - 1, b) if 0 <= i < n]
    touched = np.unique(np.concatenate([rng.integers(0, max(n, 1), n // 50), edges]).astype(np.int64))
    new[touched] ^= WORD[width].type(1)
    pos, x = codec.diff(old, new)
    assert pos.tolist() == touched.tolist()
    assert (x == 1).all() and x.dtype == old.dtype


@given(st.lists(pairs(), min_size=1, max_size=1), st.integers(2, 6), st.randoms(use_true_random=False))
@settings(max_examples=40, deadline=None)
def test_compose_equals_sequential_apply(first: list, k: int, rnd) -> None:
    states = [first[0][0]]
    for _ in range(k):
        s = states[-1].copy()
        for _ in range(rnd.randint(0, len(s))):
            s[rnd.randrange(len(s))] = rnd.getrandbits(8 * s.itemsize)
        states.append(s)
    deltas = [codec.diff(a, b) for a, b in zip(states, states[1:])]
    pos, val = codec.compose_xor(deltas)
    got = states[0].copy()
    got[pos] ^= val
    assert got.tobytes() == states[-1].tobytes()
    pos, val = codec.compose_set([(p, b[p]) for (p, _), b in zip(deltas, states[1:])])
    got = states[0].copy()
    got[pos] = val
    assert got.tobytes() == states[-1].tobytes()


def _obj() -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 5000).astype("<u2")
    new = old.copy()
    new[::37] ^= 3
    new[4000] ^= 0x8000
    obj, _, _ = codec.encode_xor(old, new)
    return obj, old, new


@pytest.mark.parametrize("cut", [0, 5, 16, 30, -1])
def test_truncated_object_refused(cut: int) -> None:
    obj, old, _ = _obj()
    with pytest.raises(DataError, match="truncated|shorter|sections|not a zstd|corrupt|declares"):
        codec.decode(obj[:cut], kinds=(1, 2), itemsize=2, words=len(old), key="v2/chunk-0")


def test_hostile_header_refused() -> None:
    obj, old, _ = _obj()
    bomb = bytearray(obj)
    bomb[12:16] = (1 << 31).to_bytes(4, "little")  # claims 2**31 words
    with pytest.raises(DataError, match="does not match the chunk"):
        codec.decode(bytes(bomb), kinds=(1, 2), itemsize=2, words=len(old), key="k")
    with pytest.raises(DataError, match="does not match the chunk"):
        codec.decode(obj, kinds=(1, 2), itemsize=4, words=len(old), key="k")


def test_flipped_byte_refused_or_caught_by_digest() -> None:
    obj, old, new = _obj()
    for at in range(16, len(obj), max(1, len(obj) // 40)):
        bad = bytearray(obj)
        bad[at] ^= 0x10
        try:
            d = codec.decode(bytes(bad), kinds=(1, 2), itemsize=2, words=len(old), key="k")
        except DataError:
            continue
        got = old.copy()
        got[d.positions] ^= d.values  # decodes to other bytes: the object digest is what catches it
        assert d.positions is not None
