"""A lane hands its samples to the sequencer in batches of `sample_batch`, or sooner once they hold
`lane.HANDOFF_BYTES`: a sample with images (megabytes) goes at once instead of waiting, complete,
for the lane's next samples. What the lanes yield does not depend on it."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import numpy as np
import pytest

from zephon_stream.loader import lane as lane_module
from zephon_stream.loader.backends import run_lanes
from zephon_stream.loader.plan import open_stores, plan_data
from zephon_stream.loader.state import LaneState
from zephon_stream.operators.tokenize import Tokenize


async def _handoffs(cfg) -> dict[int, list[list]]:
    """Every hand-off of every lane, to the end of the data."""
    async with AsyncExitStack() as stack:
        stores = await open_stores(cfg, stack)
        plan = await plan_data(cfg, stores)
        states = {lane: LaneState.initial(lane, len(cfg.sources)) for lane in range(cfg.lanes)}
        out: dict[int, list[list]] = {lane: [] for lane in states}
        async with run_lanes(cfg, Tokenize.for_config(cfg), plan, stores, states) as (streams, *_):

            async def drain(lane: int) -> None:
                async for batch in streams[lane]:
                    out[lane].append(batch)

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for lane in states:
                        tg.start_soon(drain, lane)
        return out


def _flat(handoffs: dict[int, list[list]]) -> list[tuple]:
    return [(s.lane, s.index, s.input_ids.tobytes(), b"".join(np.ascontiguousarray(im).tobytes() for im in s.images))
            for lane in sorted(handoffs) for batch in handoffs[lane] for s in batch]


@pytest.fixture()
def two_lanes(vision_config):
    return vision_config.replace(lanes=2, global_batch_size=2, sample_batch=4, max_epochs=1, backend="threads")


def test_image_samples_go_once_they_hold_handoff_bytes_and_yield_the_same(two_lanes, monkeypatch) -> None:
    batched = anyio.run(_handoffs, two_lanes)
    sizes = [len(b) for lane in batched.values() for b in lane[1:-1]]  # the first step's and the last are shorter
    assert sizes and set(sizes) == {4}, sizes  # small samples (64 tokens, images <= 16 patches): sample_batch

    images = [s for lane in batched.values() for b in lane for s in b if s.images]
    limit = sorted(s.nbytes for s in images)[len(images) // 2]  # about every other image sample reaches it alone
    monkeypatch.setattr(lane_module, "HANDOFF_BYTES", limit)
    eager = anyio.run(_handoffs, two_lanes)
    for batches in eager.values():
        for batch in batches[:-1]:
            held = [s.nbytes for s in batch]
            # sent as soon as one of the rules holds, not later: the batch without its last sample held neither
            assert len(batch) <= 4 and sum(held[:-1]) < limit
            assert len(batch) == 4 or sum(held) >= limit or batch[-1].index == batches[0][-1].index, held
    assert len([b for lane in eager.values() for b in lane]) > len([b for lane in batched.values() for b in lane])
    assert _flat(eager) == _flat(batched)  # the same samples, images included, in the same order


def test_in_the_first_step_text_feeds_make_one_document_a_call_and_image_feeds_read_ahead(vision_config,
                                                                                          monkeypatch) -> None:
    """Text feeds go lean until every lane has made its part of the first batch; image feeds do
    not (a decode call per image cost the image bench 8-12% of its images/s)."""
    from zephon_stream.loader.lane import Lanes

    sizes: dict[bool, list[int]] = {True: [], False: []}  # image source? -> documents a call, in the first step
    tokenize = Lanes.tokenize

    def counted(lanes, source, docs, key, *args):
        if lanes.first_step.pending():
            sizes[lanes.images[source]].append(len(docs))
        return tokenize(lanes, source, docs, key, *args)

    monkeypatch.setattr(Lanes, "tokenize", counted)
    cfg = vision_config.replace(lanes=2, global_batch_size=16, sample_batch=4, max_epochs=1, backend="threads")
    anyio.run(_handoffs, cfg)
    assert sizes[False] and set(sizes[False]) == {1}, sizes
    assert sizes[True] and max(sizes[True]) > 1, sizes
