"""Helpers shared by the refit tests: byte-level model builders and comparisons."""

from __future__ import annotations

import numpy as np
import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if dtype == torch.bool:
        t = t & 1  # only 0/1 are valid bools
    return t.view(dtype).reshape(shape).clone()


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert raw(a[k]) == raw(b[k]), f"tensor {k!r} differs"


def model(seed: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"w1": ((16, 24), torch.bfloat16), "w2": ((24, 8), torch.bfloat16),
                        "norm": ((24,), torch.float32), "emb": ((8, 12), torch.float16), "q": ((9,), torch.int8)}
    out = {}
    for name, (shape, dtype) in shapes.items():
        if dtype.is_floating_point:
            out[name] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        else:
            out[name] = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return out


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.05) -> dict[str, torch.Tensor]:
    """A sparse update: `frac` of elements nudged (floats) or replaced (ints)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        hit = torch.rand(t.shape, generator=g) < frac
        if t.dtype.is_floating_point:
            new = (t.float() * (1 + 0.05 * torch.randn(t.shape, generator=g))).to(t.dtype)
        else:
            new = torch.randint(-100, 100, t.shape, generator=g).to(t.dtype)
        out[k] = torch.where(hit, new, t)
    return out


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def words(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()
