"""Dense deltas (every word changes, as fp32 weights under Adam): the publisher hashes such a
chunk whole instead of summing the change at each position; followers and joiners stay bit-exact."""

from __future__ import annotations

import anyio
import torch

from tests.refit._helpers import assert_same, zeros_like
from zephon_stream.refit import Publisher, Subscriber


def test_dense_deltas_followed_and_joined_bit_exact(store) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g).to(torch.bfloat16),
             "s": torch.randn(300, generator=g).to(torch.float16)}

    async def main() -> None:
        nonlocal state
        follower = zeros_like(state)
        sub = Subscriber("p/", store=store)
        async with Publisher("p/", store=store, chunk_bytes=1024, keyframe_every=3) as pub:
            for v in range(1, 8):  # keyframes 1, 4, 7: a dense keyframe delta keeps the shadow check
                if v > 1:
                    dense = v % 2 == 0
                    state = {k: (t.float() + (1e-2 if dense else 0) * torch.randn(t.shape, generator=g)
                                 ).to(t.dtype) if dense else _sparse(t, g) for k, t in state.items()}
                info = await pub.publish(state)
                assert info.version == v
                if v > 1 and v % 2 == 0:
                    assert info.changes > info.model_bytes // 8  # most words changed
                assert await sub.pull(follower) == v
                assert_same(state, follower)
                assert sub.record.model_digest == info.model_digest
        joiner = zeros_like(state)
        assert await Subscriber("p/", store=store).pull(joiner) == 7
        assert_same(state, joiner)

    anyio.run(main)


def _sparse(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    hit = torch.rand(t.shape, generator=g) < 0.05
    return torch.where(hit, (t.float() * 1.01).to(t.dtype), t)
