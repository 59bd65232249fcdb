"""Fixtures of the refit tests."""

from __future__ import annotations

import pytest

from zephon_stream.connectors import MemoryStore


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()
