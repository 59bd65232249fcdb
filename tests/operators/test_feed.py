"""Feed: a producer reads ahead into a bounded buffer; the state is the cursor of the next document."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from zephon_stream import IncompatibleState
from zephon_stream.operators.feed import Feed, FeedState

# two splits (positions 0 and 1) of three documents each, 10 bytes a document
DOCS = [((0, p, off, 10), np.full(2, 10 * p + off, dtype=np.uint32)) for p in range(2) for off in range(0, 30, 10)]


def _feed(produced: list) -> Feed:
    async def produce(position: int, offset: int, piece: int, send) -> None:
        produced.append((position, offset))
        async with send:
            todo = [d for d in DOCS if (d[0][1], d[0][2]) >= (position, offset)]
            for i in range(0, len(todo), 2):
                await send.send(todo[i:i + 2])

    return Feed(produce, buffer=1)


async def _run(feed: Feed, take: int | None) -> list:
    out = []
    async with anyio.create_task_group() as tg:
        with feed.start(tg.start_soon):
            while take is None or len(out) < take:
                doc = await feed.next()
                if doc is None:
                    break
                out.append(doc[0])
            tg.cancel_scope.cancel()
    return out


@pytest.mark.parametrize("k", range(len(DOCS) + 1))
def test_resume_from_the_cursor_gives_the_rest(k: int) -> None:
    produced: list = []
    first = _feed(produced)
    head = anyio.run(_run, first, k)
    state = first.state()
    again = _feed(produced)
    again.restore(state, lambda r: None)
    rest = anyio.run(_run, again, None)
    assert head + rest == [d[0] for d in DOCS]
    assert produced[-1] == (state.position, state.offset)  # the producer starts at the cursor


def test_restore_refuses_a_negative_cursor() -> None:
    with pytest.raises(IncompatibleState, match=r"cursor = \(-1, 0, 0\)"):
        _feed([]).restore(FeedState(-1, 0), lambda r: None)


def test_the_read_ahead_grows_with_what_the_lane_takes() -> None:
    docs = [((0, 0, 10 * i, 10), np.full(2, i, dtype=np.uint32)) for i in range(200)]
    seen: list[tuple[int, int, int]] = []  # (documents sent, taken, the room given) at each call

    async def produce(position: int, offset: int, piece: int, send) -> None:
        async with send:
            i = 0
            while i < len(docs):
                n = await send.room(8)
                seen.append((i, feed.taken, n))
                await send.send(docs[i:i + n])
                i += n

    feed = Feed(produce, buffer=3)
    got = anyio.run(_run, feed, None)
    assert got == [d[0] for d in docs]
    assert seen[0] == (0, 0, 1)  # one document first
    for sent, taken, n in seen:  # never more than max(1, taken) ahead, nor past the buffer's 3 batches of 8
        assert 1 <= n <= 8 and sent + n - taken <= max(1, min(taken, 3 * 8))
    assert max(n for *_, n in seen) == 8


def test_room_now_is_what_room_gives_without_waiting() -> None:
    """`room_now` (the producer's look before it decodes another block) agrees with `room`, and is
    0 or less exactly when `room` would wait for the lane to take a document."""
    docs = [((0, 0, 10 * i, 10), np.full(2, i, dtype=np.uint32)) for i in range(120)]
    looks: list[tuple[int, int]] = []  # (room_now, room) at each call

    async def produce(position: int, offset: int, piece: int, send) -> None:
        async with send:
            i = 0
            while i < len(docs):
                now = send.room_now(8)
                n = await send.room(8)
                looks.append((now, n))
                await send.send(docs[i:i + n])
                i += n

    feed = Feed(produce, buffer=2)
    assert anyio.run(_run, feed, None) == [d[0] for d in docs]
    for now, n in looks:
        assert now == n if now > 0 else 1 <= n <= 8
    assert any(now <= 0 for now, _ in looks)  # the producer did catch up with the lane and wait


def test_grown_read_ahead_calls_take_whole_batches_not_top_ups() -> None:
    """Once the read-ahead has grown, a call waits until `most` documents fit: a lane that takes
    one document at a time does not get a call per document (a CPU hand-off each)."""
    docs = [((0, 0, 10 * i, 10), np.full(2, i, dtype=np.uint32)) for i in range(300)]
    sizes: list[tuple[int, int]] = []  # (taken, the room given) at each call

    async def produce(position: int, offset: int, piece: int, send) -> None:
        async with send:
            i = 0
            while i < len(docs):
                n = await send.room(min(8, len(docs) - i))
                sizes.append((feed.taken, n))
                await send.send(docs[i:i + n])
                i += n

    async def slow(feed: Feed) -> list:
        out = []
        async with anyio.create_task_group() as tg:
            with feed.start(tg.start_soon):
                while (doc := await feed.next()) is not None:
                    out.append(doc[0])
                    await anyio.sleep(0)  # the producer runs between two takes
        return out

    feed = Feed(produce, buffer=3)
    assert anyio.run(slow, feed) == [d[0] for d in docs]
    grown = [n for taken, n in sizes if taken >= 16][:-1]  # past the growth (read-ahead 16+), the last call aside
    assert grown and set(grown) == {8}, sizes
    assert [n for _, n in sizes[:2]] == [1, 1]  # the first calls stay small: the first documents come soon
