"""Subscriber(module=...): an nn.Module's own tensors updated in place, bit-exact, with name maps."""

from __future__ import annotations

import anyio
import pytest
import torch
from torch import nn

from tests.refit._helpers import raw, step
from zephon_stream.connectors import MemoryStore
from zephon_stream.errors import ConfigError
from zephon_stream.refit import Fuse, Publisher, Subscriber

D, Q, KV = 16, 16, 8  # model width; query rows; key and value rows (grouped-query attention)


class Trainer(nn.Module):
    """The trainer's layout: separate q/k/v projections, a norm, a buffer."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(D, Q), nn.Linear(D, KV), nn.Linear(D, KV)
        self.up = nn.Linear(D, 2 * D)
        self.gate = nn.Linear(D, 2 * D)
        self.norm = nn.LayerNorm(D)
        self.register_buffer("scale", torch.randn(D))
        self.to(dtype)


class Rollout(nn.Module):
    """The rollout engine's layout: q/k/v fused along dim 0, gate and up fused along dim 1."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(D, Q + 2 * KV)
        self.gate_up = nn.Parameter(torch.zeros(2 * D, 2 * D))  # [gate | up] side by side: interleaved rows
        self.gate_up_bias = nn.Parameter(torch.zeros(4 * D))
        self.norm = nn.LayerNorm(D)
        self.register_buffer("scale", torch.zeros(D))
        self.to(dtype)


NAME_MAP = {
    "qkv_proj.weight": Fuse(("q_proj.weight", "k_proj.weight", "v_proj.weight")),
    "qkv_proj.bias": Fuse(("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "gate_up": Fuse(("gate.weight", "up.weight"), dim=1),
    "gate_up_bias": Fuse(("gate.bias", "up.bias")),
}


def expected_rollout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rollout layout of a trainer state_dict, built independently of the subscriber's maps."""
    return {
        "qkv_proj.weight": torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]),
        "qkv_proj.bias": torch.cat([sd["q_proj.bias"], sd["k_proj.bias"], sd["v_proj.bias"]]),
        "gate_up": torch.cat([sd["gate.weight"], sd["up.weight"]], dim=1),
        "gate_up_bias": torch.cat([sd["gate.bias"], sd["up.bias"]]),
        "norm.weight": sd["norm.weight"], "norm.bias": sd["norm.bias"], "scale": sd["scale"],
    }


def identities(module: nn.Module) -> dict[str, tuple[int, int]]:
    return {k: (id(t), t.data_ptr()) for k, t in module.state_dict(keep_vars=True).items()}


def assert_module_equals(module: nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = module.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert raw(got[k]) == raw(want[k]), f"{k} differs"


def run_versions(module: nn.Module, name_map, versions: int, *, keyframe_every: int = 3, chunk_bytes: int = 256,
                 expect=lambda sd: sd, workers: int = 2) -> None:
    store_sd = Trainer(1).state_dict()

    async def main() -> None:
        store = MemoryStore()
        sub = Subscriber("p/", store=store, module=module, name_map=name_map, workers=workers)
        before = identities(module)
        sd = store_sd
        with anyio.fail_after(60):
            async with Publisher("p/", store=store, chunk_bytes=chunk_bytes, keyframe_every=keyframe_every) as pub:
                for v in range(1, versions + 1):
                    info = await pub.publish(sd)
                    assert await sub.pull() == v
                    assert_module_equals(module, {k: t.cpu() for k, t in expect(sd).items()})
                    assert identities(module) == before, "the module's tensors were replaced, not written in place"
                    assert sub.record.model_digest == info.model_digest
                    sd = step(sd, seed=100 + v, frac=0.3)

    anyio.run(main)


def test_same_layout_module_updated_in_place_bit_exact() -> None:
    module = Trainer(seed=7)  # different weights, same layout
    run_versions(module, None, versions=5)


def test_fused_layout_through_the_name_map() -> None:
    run_versions(Rollout(), NAME_MAP, versions=6, expect=expected_rollout)


def test_fused_layout_joiner_starts_from_a_keyframe_in_place() -> None:
    """A module that joins at a delta version: keyframe + deltas written through the maps."""
    async def main() -> None:
        store = MemoryStore()
        sd = Trainer(1).state_dict()
        async with Publisher("p/", store=store, chunk_bytes=128, keyframe_every=4) as pub:
            for v in range(1, 7):
                await pub.publish(sd)
                if v < 6:
                    sd = step(sd, seed=v, frac=0.2)
        module = Rollout()
        before = identities(module)
        assert await Subscriber("p/", store=store, module=module, name_map=NAME_MAP).pull() == 6
        assert_module_equals(module, expected_rollout(sd))
        assert identities(module) == before

    anyio.run(main)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the CPU path is tested above")
def test_cuda_module_updated_in_place_bit_exact() -> None:
    module = Rollout().cuda()
    run_versions(module, NAME_MAP, versions=5, expect=expected_rollout)
    assert all(t.is_cuda for t in module.state_dict().values())


def test_state_and_module_are_exclusive_and_maps_are_checked() -> None:
    async def main() -> None:
        store = MemoryStore()
        sd = Trainer(1).state_dict()
        async with Publisher("p/", store=store) as pub:
            await pub.publish(sd)
        with pytest.raises(ConfigError, match="without a state"):
            await Subscriber("p/", store=store, module=Trainer(2)).pull(sd)
        with pytest.raises(ConfigError, match="needs the state_dict"):
            await Subscriber("p/", store=store).pull()
        with pytest.raises(ConfigError, match="no module tensor receives"):
            await Subscriber("p/", store=store, module=Rollout()).pull()
        bad = {**NAME_MAP, "qkv_proj.weight": Fuse(("q_proj.weight", "k_proj.weight"))}
        with pytest.raises(ConfigError, match="add up to 24"):
            await Subscriber("p/", store=store, module=Rollout(), name_map=bad).pull()
        twice = {**NAME_MAP, "gate_up_bias": Fuse(("gate.bias", "q_proj.bias"))}
        with pytest.raises(ConfigError, match="mapped to two module tensors|add up"):
            await Subscriber("p/", store=store, module=Rollout(), name_map=twice).pull()
        with pytest.raises(ConfigError, match="not in the published version"):
            await Subscriber("p/", store=store, module=Rollout(), name_map={**NAME_MAP, "norm.weight": "nope"}).pull()
        with pytest.raises(ConfigError, match="give module= too"):
            Subscriber("p/", store=store, name_map=NAME_MAP)
        with pytest.raises(ConfigError, match="distinct"):
            Fuse(("a", "a"))

    anyio.run(main)
