"""`workers` is the concurrency of refit and the relay; `lanes=` still works, with a DeprecationWarning."""

from __future__ import annotations

import anyio
import pytest

from zephon_stream import ConfigError
from zephon_stream.engine.ordered import run_ordered
from zephon_stream.refit import Publisher, Subscriber
from zephon_stream.relay import Relay


def test_lanes_keyword_still_works_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"Publisher\(lanes=...\) is deprecated: use workers="):
        assert Publisher("memory://w/p/", lanes=3).workers == 3
    with pytest.warns(DeprecationWarning, match=r"Subscriber\(lanes=...\) is deprecated"):
        assert Subscriber("memory://w/p/", lanes=2).workers == 2
    with pytest.warns(DeprecationWarning, match=r"Relay\(lanes=...\) is deprecated"):
        assert Relay("memory://w/p/", ["memory://w/c/"], lanes=5).workers == 5
    committed: list[int] = []

    async def stage(i: int) -> int:
        return i

    async def commit(i: int, r: int) -> None:
        committed.append(r)

    with pytest.warns(DeprecationWarning, match=r"run_ordered\(lanes=...\) is deprecated"):
        anyio.run(lambda: run_ordered(range(5), stage, commit, lanes=2, window=2))
    assert committed == list(range(5))


def test_workers_and_lanes_together_refused() -> None:
    with pytest.raises(ConfigError, match="pass workers=2 alone"):
        Publisher("memory://w/p/", workers=2, lanes=3)
    assert Publisher("memory://w/p/").workers == 4 and Relay("memory://w/p/", ["memory://w/c/"]).workers == 8
