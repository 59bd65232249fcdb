"""engine.window.ReadWindow: a request cancelled under the reader never reads as empty data."""

from __future__ import annotations

import anyio
import pytest

from zephon_stream.engine.window import ReadWindow
from zephon_stream.errors import ConnectorError


def test_a_cancelled_request_is_not_taken_for_empty_bytes():
    """The requests run in a task group of their own (as a lane's read-ahead does), cancelled while
    the reader waits: the reader gets an error, never b"" (which it would take for a cut object)."""
    async def main() -> None:
        started, ready = anyio.Event(), anyio.Event()
        requests: dict[str, object] = {}

        async def fetch(start: int, end: int) -> bytes:
            started.set()
            await anyio.sleep_forever()
            return b"x" * (end - start)

        async def host() -> None:  # the requests' task group, in a task apart from the reader
            async with anyio.create_task_group() as group:
                requests.update(spawn=group.start_soon, scope=group.cancel_scope)
                ready.set()
                await anyio.sleep_forever()

        async def cancel_requests() -> None:
            await started.wait()
            requests["scope"].cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(host)
            await ready.wait()
            window = ReadWindow(fetch, [(0, 10), (10, 20)], 2, requests["spawn"])
            tg.start_soon(cancel_requests)
            with pytest.raises(ConnectorError, match=r"the read of bytes \[0, 10\) was cancelled"):
                await window.__anext__()
            tg.cancel_scope.cancel()

    anyio.run(main)


def test_parts_come_back_in_order():
    async def main() -> list[bytes]:
        async def fetch(start: int, end: int) -> bytes:
            await anyio.sleep((20 - start) / 1000)  # later ranges finish first
            return bytes([start]) * (end - start)

        async with anyio.create_task_group() as tg:
            return [part async for part in ReadWindow(fetch, [(0, 5), (5, 10), (10, 20)], 3, tg.start_soon)]

    assert anyio.run(main) == [b"\0" * 5, b"\5" * 5, b"\n" * 10]
