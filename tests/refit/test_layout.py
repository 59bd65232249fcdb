"""The layout's dtype table is torch's, without importing torch to build it."""

from __future__ import annotations

import pytest
import torch

from zephon_stream import ConfigError
from zephon_stream.refit.layout import ITEMSIZE, dtype_of, itemsize_of


@pytest.mark.parametrize("name", sorted(ITEMSIZE))
def test_itemsize_table_matches_torch(name: str) -> None:
    dtype = getattr(torch, name)
    assert str(dtype) == f"torch.{name}" and dtype.itemsize == ITEMSIZE[name] == itemsize_of(name)
    assert dtype_of(name) is dtype


def test_unsupported_dtype_refused() -> None:
    for name in ("complex64", "float", "torch.float32", "quint8"):
        with pytest.raises(ConfigError, match="not supported by the refit codec"):
            itemsize_of(name)
