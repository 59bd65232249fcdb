"""The compiled digest kernels (refit/_digest.c) against the numpy reference, and the joiner's
one-pass keyframe load that uses them: same digests for every word size, length, base and
loop (AVX2 and portable), the exact bytes woven, a corrupt keyframe object named, blake2b off
the event loop, and the numpy fallback when it is forced."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.refit._helpers import assert_same, model, step, zeros_like
from zephon_stream.errors import DataError, DigestMismatch
from zephon_stream.refit import Publisher, Subscriber, codec, hashing
from zephon_stream.refit import subscriber as subscriber_mod

WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
LENGTHS = [0, 1, 3, 15, 16, 17, 31, 33, 1001, 65_537, 200_003]
BASES = [0, 6, 2**64 - 5, 2**63 + 3, 12_345_678_901_234_567]


@pytest.fixture(params=[True, False], ids=["avx2", "portable"])
def compiled(request):
    """The compiled module with its AVX2 loops on (where the CPU has them) or off."""
    kernel = hashing._compiled
    if kernel is None:
        pytest.fail(f"the compiled kernels did not import ({hashing._MISSING}): see test_the_kernels_are_built")
    was = kernel.set_simd(request.param)
    yield kernel
    kernel.set_simd(was)


def reference(fn, *args):
    """What the numpy reference returns for hashing.fn(*args)."""
    saved, hashing._kernel = hashing._kernel, None
    try:
        return getattr(hashing, fn)(*args)
    finally:
        hashing._kernel = saved


def words(itemsize: int, n: int, seed: int) -> np.ndarray:
    dt = WORDS[itemsize]
    return np.random.default_rng(seed).integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)


def planes_of(values: np.ndarray) -> list[bytes]:
    w = values.dtype.itemsize
    return [values.view(np.uint8).reshape(len(values), w)[:, b].tobytes() for b in range(w)]


def test_the_kernels_are_built_in_this_checkout() -> None:
    """Fails (never skips) when the extension did not build: digests would silently run ~4x slower."""
    if hashing._compiled is None:
        pytest.fail(f"zephon_stream.refit._digest did not import ({hashing._MISSING}): the C extension was not "
                    "built. Build it with `pip install --no-deps --no-build-isolation -e .` or `python setup.py "
                    "build_ext --inplace` (needs gcc and the Python headers) and read the compiler's error there.")
    assert Path(hashing._compiled.__file__).parent == Path(hashing.__file__).parent
    assert hashing._compiled.simd() in (True, False)
    forced = os.environ.get("ZEPHON_DIGEST", "")
    assert hashing.implementation() == ("numpy" if forced == "numpy" else "c")
    if " avx2 " in f" {Path('/proc/cpuinfo').read_text().split(chr(10) + chr(10))[0]} ".replace("\t", " "):
        was = hashing._compiled.set_simd(True)
        assert was and hashing._compiled.set_simd(True), "the CPU has AVX2 but the AVX2 loops are not in use"


@pytest.mark.parametrize("itemsize", WORDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_contiguous_and_weave_equal_the_reference(compiled, itemsize: int, n: int) -> None:
    values = words(itemsize, n, seed=n * 10 + itemsize)
    planes = planes_of(values)
    for base in BASES:
        want = reference("contiguous_sum", base, itemsize, values)
        assert compiled.contiguous_sum(base, itemsize, values) == want
        assert hashing.contiguous_sum(base, itemsize, values) == want
        out = np.zeros(n + 2, WORDS[itemsize])  # a word either side shows a write out of bounds
        assert compiled.weave_sum(base, tuple(planes), out[1 : n + 1]) == want
        assert out[1 : n + 1].tobytes() == values.tobytes() and out[0] == 0 and out[-1] == 0


@pytest.mark.parametrize("itemsize", WORDS)
@pytest.mark.parametrize("n", [0, 1, 17, 4099])
def test_element_sums_equal_the_reference(compiled, itemsize: int, n: int) -> None:
    rng = np.random.default_rng(n + itemsize)
    a, b = words(itemsize, n, seed=1), words(itemsize, n, seed=2)
    for pos in (rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True),
                rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),  # bits read as uint64, as numpy casts
                rng.integers(0, 2**31, n, dtype=np.int32)):
        want = reference("element_sums", pos, a, b)
        assert hashing.element_sums(pos, a, b) == want
        assert hashing.element_sum(pos, a) == want[0]
        u = pos.astype(np.uint64)
        assert compiled.element_sum(u, itemsize, a) == want[0]


def test_views_the_kernels_cannot_read_give_the_reference_value(compiled) -> None:
    values = words(2, 1001, seed=5)
    strided = values[::3]  # not contiguous: copied for the kernel
    assert hashing.contiguous_sum(7, 2, strided) == reference("contiguous_sum", 7, 2, strided)
    signed = values.view(np.int16)  # numpy sign-extends a signed view: the reference's value, kept
    assert hashing.contiguous_sum(7, 2, signed) == reference("contiguous_sum", 7, 2, signed)
    pos = np.arange(0, 6 * len(strided), 2, dtype=np.uint64)[::-3]  # strided positions
    assert len(pos) == len(strided)
    assert hashing.element_sum(pos, strided) == reference("element_sum", pos, strided)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), itemsize=st.sampled_from([1, 2, 4, 8]),
       base=st.integers(0, 2**64 - 1), simd=st.booleans())
def test_any_bytes_give_the_reference_digest(data: bytes, itemsize: int, base: int, simd: bool) -> None:
    kernel = hashing._compiled
    assert kernel is not None, "the compiled kernels did not import: see test_the_kernels_are_built_in_this_checkout"
    was = kernel.set_simd(simd)
    try:
        values = np.frombuffer(data[: len(data) // itemsize * itemsize], dtype=WORDS[itemsize])
        want = reference("contiguous_sum", base, itemsize, values)
        assert kernel.contiguous_sum(base, itemsize, values) == want
        out = np.empty(len(values), WORDS[itemsize])
        assert kernel.weave_sum(base, tuple(planes_of(values)), out) == want
        assert out.tobytes() == values.tobytes()
        pos = (base + np.arange(len(values), dtype=np.uint64) * np.uint64(itemsize)) if len(values) else \
            np.zeros(0, np.uint64)
        assert kernel.element_sum(pos, itemsize, values) == want  # the same words at explicit positions
    finally:
        kernel.set_simd(was)


def test_weave_refuses_planes_that_do_not_fit() -> None:
    out = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="planes"):
        hashing.weave_sum(0, [b"\0" * 8, b"\0" * 7], out)
    with pytest.raises(ValueError, match="planes"):
        hashing.weave_sum(0, [b"\0" * 8], out)
    with pytest.raises(ValueError, match="contiguous"):
        hashing.weave_sum(0, [b"\0" * 4, b"\0" * 4], out[::2])


# -- the codec's plane reader ---------------------------------------------------------------

def full_object(n: int = 4096) -> tuple[bytes, np.ndarray]:
    values = words(2, n, seed=9) & np.uint16(0x3FFF)  # a compressible high plane
    return codec.encode_dense(codec.FULL, values), values


def test_full_planes_round_trip() -> None:
    obj, values = full_object()
    planes = codec.full_planes(obj, itemsize=2, words=len(values), key="k")
    assert isinstance(planes[0], tuple) and isinstance(planes[1], memoryview)  # raw low plane: read in place
    assert [b"".join(p) if isinstance(p, tuple) else bytes(p) for p in planes] == planes_of(values)


def test_keyframe_planes_keep_long_repeats_and_entropy() -> None:
    """Keyframes at level 1 are encoded with few, long matches (fast to decode): a tiled or
    constant tensor must still shrink to almost nothing, and weights by their byte entropy."""
    row = np.random.default_rng(3).integers(0, 2**16, 4096, dtype=np.uint16)
    tiled = np.tile(row, 256)
    weights = (np.random.default_rng(4).normal(0, 0.02, len(tiled)).astype(np.float32).view(np.uint32) >> 16)
    for values, most in ((tiled, 0.01), (np.full(len(tiled), 0x3F80, np.uint16), 0.001),
                         (weights.astype(np.uint16), 0.7)):
        obj = codec.encode_dense(codec.FULL, values)
        assert len(obj) < most * values.nbytes, (len(obj), values.nbytes)
        out = np.empty_like(values)
        assert hashing.weave_sum(0, codec.full_planes(obj, itemsize=2, words=len(values), key="k"), out) == \
            hashing.contiguous_sum(0, 2, values)
        assert out.tobytes() == values.tobytes()


RAW_DAMAGE = {  # to a frame of raw blocks (the low plane): each must fall back to zstd, which refuses it
    "wrong checksum": lambda f: f[:4] + bytes([f[4] | 0x04]) + f[5:] + b"\0\0\0\0",  # zstd checks it
    "dictionary flag": lambda f: f[:4] + bytes([f[4] | 0x01]) + f[5:],
    "reserved bit": lambda f: f[:4] + bytes([f[4] | 0x08]) + f[5:],
    "block past the end": lambda f: f[:BLOCK] + bytes([f[BLOCK] | 0x08]) + f[BLOCK + 1 :],
    "zero magic": lambda f: b"\0" + f[1:],
}
BLOCK = 7  # magic 4, descriptor 1 (single segment: no window byte), content size 2: the first block header


@pytest.mark.parametrize(("plane", "damage"), [(p, d) for p in (0, 1) for d in
                                               ("trailing", "second frame", "truncated", "flipped header")] +
                         [(0, d) for d in RAW_DAMAGE])
def test_full_planes_refuse_a_damaged_section(plane: int, damage: str) -> None:
    """Each plane must be exactly one zstd frame of exactly the chunk's words, whether it is
    decompressed (plane 1) or read in place as raw blocks (plane 0)."""
    obj, values = full_object()
    _, _, sec, bounds = codec._sections(obj, (codec.FULL,), 2, len(values), "k")
    head, frames = bytes(obj[: bounds[0]]), [bytes(s) for s in sec]
    f = frames[plane]
    assert plane == 1 or (f[4] == 0x60 and f[BLOCK] & 0b111 == 0b001)  # one raw block, the last, as BLOCK says
    frames[plane] = RAW_DAMAGE[damage](f) if damage in RAW_DAMAGE else {
        "trailing": f + b"\x01\x02\x03", "second frame": f + f, "truncated": f[:-3],
        "flipped header": f[:4] + bytes([f[4] ^ 0x40]) + f[5:]}[damage]
    sizes = np.array([len(f) for f in frames], "<u4").tobytes()
    bad = head[: codec._HEAD.size] + sizes + b"".join(frames)
    with pytest.raises(DataError, match=f"k: plane {plane}"):
        codec.full_planes(bad, itemsize=2, words=len(values), key="k")


def test_raw_planes_in_pieces_weave_as_one() -> None:
    """A raw plane of several zstd blocks (128 KiB each) comes back as pieces of the object;
    woven and hashed with its partner plane, cut at any word, they give the reference's words
    and digest."""
    values = words(2, 300_000, seed=5) & np.uint16(0x3FFF)
    obj = codec.encode_dense(codec.FULL, values)
    planes = codec.full_planes(obj, itemsize=2, words=len(values), key="k")
    assert isinstance(planes[0], tuple) and len(planes[0]) == 3
    for lo, hi in ((0, len(values)), (1, 131_073), (131_072, 262_144), (5, 299_999), (7, 7)):
        out = np.empty(hi - lo, np.uint16)
        got = hashing.weave_sum(2 * lo, [hashing.cut(p, lo, hi) for p in planes], out)
        assert out.tobytes() == values[lo:hi].tobytes()
        assert got == hashing.contiguous_sum(2 * lo, 2, values[lo:hi])
        ref = np.empty_like(out)
        hashing.weave([hashing.cut(p, lo, hi) for p in planes], ref)  # the numpy reference reads pieces too
        assert ref.tobytes() == values[lo:hi].tobytes()


# -- the joiner's pull ----------------------------------------------------------------------

async def publish(store, versions: int = 1, *, keyframe_every: int = 10) -> list[dict]:
    states = [model(1)]
    async with Publisher("p/", store=store, chunk_bytes=256, keyframe_every=keyframe_every) as pub:
        for v in range(1, versions + 1):
            if v > 1:
                states.append(step(states[-1], seed=v, frac=0.3))
            await pub.publish(states[-1])
    return states


def key_objects(store) -> list[str]:
    return sorted(k for k in store.objects if "/key-" in k)


@pytest.mark.parametrize("where", ["middle", "header", "end"])
def test_a_corrupt_keyframe_object_is_named_and_the_next_pull_repairs(store, tmp_path, where: str) -> None:
    """The fresh path skips the keyframe object's blake2b while the load verifies; when the load
    fails (a wrong digest, or an undecodable frame), the blake2b names the corrupt object."""
    async def main() -> None:
        states = await publish(store, 3)  # keyframe 1, deltas 2 and 3
        key = max(key_objects(store), key=lambda k: len(store.objects[k]))
        good = store.objects[key]
        bad = bytearray(good)
        bad[{"middle": len(bad) // 2 + 5, "header": 1, "end": len(bad) - 1}[where]] ^= 0x10
        store.objects[key] = bytes(bad)
        replica = zeros_like(states[-1])
        sub = Subscriber("p/", store=store, record=tmp_path / "rec")
        with pytest.raises(DigestMismatch, match="blake2b.*corrupt object") as exc:
            await sub.pull(replica)
        assert str(exc.value).startswith(key)
        assert isinstance(exc.value.__cause__, DataError | DigestMismatch)  # what the load found first
        assert sub.version == 0 and sub.record.target == 3
        store.objects[key] = good
        assert await Subscriber("p/", store=store, record=tmp_path / "rec").pull(replica) == 3
        assert_same(states[-1], replica)

    anyio.run(main)


def test_blake2b_runs_off_the_event_loop_and_not_for_a_fresh_keyframe(store, monkeypatch) -> None:
    """Object digests are computed in worker threads; a joiner's keyframe objects not at all."""
    calls: list[tuple[int, bytes]] = []
    real = subscriber_mod.object_digest

    def spy(data: bytes) -> str:
        calls.append((threading.get_ident(), data))
        return real(data)

    monkeypatch.setattr(subscriber_mod, "object_digest", spy)

    async def main() -> None:
        loop = threading.get_ident()
        states = await publish(store, 2)
        keyframes = {store.objects[k] for k in key_objects(store)}
        joiner = zeros_like(states[-1])
        assert await Subscriber("p/", store=store).pull(joiner) == 2
        assert_same(states[-1], joiner)
        joined = list(calls)
        assert joined, "the v2 delta objects were not checked"
        assert not [d for _, d in joined if d in keyframes], "a fresh keyframe load computed the key's blake2b"
        held = zeros_like(states[0])
        sub = Subscriber("p/", store=store)
        async with Publisher("q/", store=store, chunk_bytes=256, keyframe_every=10) as pub:
            for v, s in enumerate(states, 1):
                await pub.publish(s)
                sub = sub if v > 1 else Subscriber("q/", store=store)
                assert await sub.pull(held) == v
        assert_same(states[-1], held)
        assert len(calls) > len(joined)
        assert all(ident != loop for ident, _ in calls), "an object's blake2b ran on the event loop thread"

    anyio.run(main)


def test_the_numpy_fallback_pulls_bit_exact(store, monkeypatch) -> None:
    async def main() -> None:
        states = await publish(store, 3, keyframe_every=2)
        monkeypatch.setattr(hashing, "_kernel", None)
        assert hashing.implementation() == "numpy"
        replica = zeros_like(states[-1])
        assert await Subscriber("p/", store=store).pull(replica) == 3
        assert_same(states[-1], replica)

    anyio.run(main)


def _child(env_value: str) -> subprocess.CompletedProcess:
    code = ("import numpy as np; from zephon_stream.refit import hashing; "
            "v = np.arange(1001, dtype=np.uint16) * np.uint16(77); "
            "print(hashing.implementation(), hashing.contiguous_sum(2**64 - 9, 2, v))")
    env = {**os.environ, "ZEPHON_DIGEST": env_value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_zephon_digest_chooses_the_implementation() -> None:
    v = np.arange(1001, dtype=np.uint16) * np.uint16(77)
    want = str(reference("contiguous_sum", 2**64 - 9, 2, v))
    forced = _child("numpy")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.split() == ["numpy", want]
    compiled = _child("c")
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout.split() == ["c", want]
    wrong = _child("fortran")
    assert wrong.returncode != 0 and "ZEPHON_DIGEST='fortran' is not an implementation" in wrong.stderr
