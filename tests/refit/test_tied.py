"""Tied weights (one Parameter under two names, as an embedding and the LM head that shares it):
a version carries them once and lists the other name as a tie; every kind of target ends
bit-identical to the trainer, whether it ties them or holds them apart."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch
from torch import nn

from tests.refit._helpers import raw
from zephon_stream.connectors import MemoryStore
from zephon_stream.errors import ConfigError, DataError
from zephon_stream.refit import Publisher, PublishLoop, Subscriber
from zephon_stream.refit.layout import Sharding
from zephon_stream.refit.manifest import decode_manifest, encode_manifest
from zephon_stream.refit.versions import read_manifest

V, D = 96, 16


class TiedLM(nn.Module):
    """An embedding, a layer, and an LM head that is the embedding (tie_word_embeddings)."""

    def __init__(self, seed: int, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.layer = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight
        self.to(torch.bfloat16)


def _train(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            hit = torch.rand(p.shape, generator=g) < 0.1
            p.add_(torch.where(hit, torch.randn(p.shape, generator=g), 0).to(p.dtype))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(raw(a[k]) == raw(b[k]) for k in a)


def run(fn, *args):
    async def main():
        with anyio.fail_after(60):
            return await fn(*args)
    return anyio.run(main)


def test_a_tied_tensor_is_carried_once_and_reaches_every_target():
    trainer = TiedLM(1)
    tied_rollout, untied_rollout = TiedLM(2), TiedLM(3, tie=False)
    apart = {k: torch.zeros_like(v) for k, v in TiedLM(4, tie=False).state_dict().items()}  # a dict, untied
    once = {k: torch.zeros_like(v) for k, v in trainer.state_dict().items() if k != "lm_head.weight"}  # HF style

    async def go():
        store = MemoryStore()
        async with Publisher("m/", store=store, keyframe_every=3) as pub, \
                Subscriber("m/", store=store, module=tied_rollout) as a, \
                Subscriber("m/", store=store, module=untied_rollout) as b, \
                Subscriber("m/", store=store) as c, Subscriber("m/", store=store) as d:
            for v in range(1, 5):
                info = await pub.publish(trainer.state_dict())
                assert info.model_bytes == (V * D + D * D + D) * 2  # the embedding once
                m, _ = await read_manifest(store, "m/", v)
                assert m.aliases == {"lm_head.weight": "embed.weight"}
                for sub, target in ((a, None), (b, None), (c, apart), (d, once)):
                    assert await sub.pull(target) == v
                want = trainer.state_dict()
                assert _same(tied_rollout.state_dict(), want) and _same(untied_rollout.state_dict(), want)
                assert _same(apart, want) and _same(once, {k: want[k] for k in once})
                assert tied_rollout.lm_head.weight is tied_rollout.embed.weight  # written in place, still one
                _train(trainer, v)

    run(go)


def test_publish_loop_snapshots_keep_the_tie():
    trainer, rollout = TiedLM(1), TiedLM(5, tie=False)

    async def go():
        store = MemoryStore()
        async with PublishLoop(Publisher("m/", store=store)) as loop, Subscriber("m/", store=store,
                                                                                 module=rollout) as sub:
            for _ in range(3):
                await loop.submit(trainer.state_dict())
                snap = loop.snapshot
                assert snap["lm_head.weight"] is snap["embed.weight"]  # one copy in the snapshot
                info = await loop.drain()
                assert info.model_bytes == (V * D + D * D + D) * 2
                await sub.pull()
                assert _same(rollout.state_dict(), trainer.state_dict())
                _train(trainer, info.version)

    run(go)


def test_tensors_a_sharding_splits_stay_apart():
    """A tie between tensors that a sharded publisher splits is not folded: both names carried."""
    trainer = TiedLM(1)
    state = trainer.state_dict()
    dims = {"embed.weight": 0, "lm_head.weight": 0}

    async def go():
        store = MemoryStore()
        async with Publisher("m/", store=store, sharding=Sharding(0, 1, dims), session="ab" * 8) as pub:
            info = await pub.publish(state)
        assert info.model_bytes == (2 * V * D + D * D + D) * 2
        assert (await read_manifest(store, "m/", 1))[0].aliases == {}

    run(go)


def test_a_target_that_ties_what_the_version_holds_apart_is_refused_unless_they_agree():
    """The rollout ties the embedding and the LM head, the trainer holds them apart: one was written
    over the other and the pull said it had the version, and so did every delta pull after it. With
    the same values in both (a trainer whose state_dict copies a tie apart), the target holds the
    version and the pull passes."""
    trainer, rollout = TiedLM(1, tie=False), TiedLM(2)
    ties = {k: torch.zeros_like(v) for k, v in trainer.state_dict().items()}
    ties["lm_head.weight"] = ties["embed.weight"]  # a plain dict with two names of one tensor

    async def go():
        store = MemoryStore()
        async with Publisher("m/", store=store) as pub, Subscriber("m/", store=store, module=rollout) as sub, \
                Subscriber("m/", store=store) as dict_sub:
            info = await pub.publish(trainer.state_dict())
            assert info.model_bytes == (2 * V * D + D * D + D) * 2
            for pull in (sub.pull, lambda: dict_sub.pull(ties)):
                with pytest.raises(ConfigError, match="version 1 holds 'embed.weight' and 'lm_head.weight' apart, "
                                                      "with other values, but they share memory in the target"):
                    await pull()
            _train(trainer, 5)
            await pub.publish(trainer.state_dict())
            with pytest.raises(ConfigError, match="version 2 holds 'embed.weight' and 'lm_head.weight' apart"):
                await sub.pull()  # a delta after it: still refused
            with torch.no_grad():
                trainer.lm_head.weight.copy_(trainer.embed.weight)
            await pub.publish(trainer.state_dict())
            assert await sub.pull() == 3
        assert raw(rollout.embed.weight) == raw(trainer.embed.weight) == raw(trainer.lm_head.weight)
        assert all(raw(v) == raw(trainer.state_dict()[k]) for k, v in rollout.state_dict().items())

    run(go)


def test_a_target_that_cannot_hold_the_tie_is_a_config_error():
    trainer = TiedLM(1)
    bad = {k: torch.zeros_like(v) for k, v in trainer.state_dict().items()}
    bad["lm_head.weight"] = torch.zeros(V, D, dtype=torch.float32)

    async def go():
        store = MemoryStore()
        async with Publisher("m/", store=store) as pub, Subscriber("m/", store=store) as sub:
            await pub.publish(trainer.state_dict())
            with pytest.raises(ConfigError, match=r"'lm_head.weight' is torch.float32 \(96, 16\), but it is published "
                                                  r"as a tie of 'embed.weight', torch.bfloat16"):
                await sub.pull(bad)

    run(go)


@pytest.mark.parametrize("aliases", [{"layer.weight": "embed.weight"}, {"x": "nothing"}, {"x": "layer.weight"}])
def test_a_manifest_whose_ties_do_not_fit_its_table_is_refused(aliases):
    trainer = TiedLM(1)

    async def go():
        store = MemoryStore()
        async with Publisher("m/", store=store) as pub:
            await pub.publish(trainer.state_dict())
        m, _ = await read_manifest(store, "m/", 1)
        if "x" in aliases and aliases["x"] == "layer.weight":
            m = msgspec.structs.replace(m, split_dims={"layer.weight": 0}, aliases=aliases)
        else:
            m = msgspec.structs.replace(m, aliases=aliases)
        with pytest.raises(DataError, match="a tie names a tensor outside the table as an unsplit tensor of it"):
            decode_manifest(encode_manifest(m), "m/1/MANIFEST")

    run(go)


def test_prefetch_into_a_tied_module_keeps_its_work_and_applies_it():
    from tests.refit.test_prefetch import CountingStore, hide_manifest

    trainer, rollout = TiedLM(1), TiedLM(2)

    async def go():
        store = CountingStore()
        async with Publisher("p/", store=store, chunk_bytes=256) as pub:
            sub = Subscriber("p/", store=store, module=rollout)
            await pub.publish(trainer.state_dict())
            await sub.pull()
            _train(trainer, 1)
            await pub.publish(trainer.state_dict())
        key, manifest = hide_manifest(store, 2)
        assert await sub.prefetch() > 0
        job = sub._ahead_job
        assert await sub.prefetch() > 0 and sub._ahead_job is job  # the same job, not rebuilt
        store.objects[key] = manifest
        store.chunk_reads.clear()
        assert await sub.pull() == 2 and store.chunk_reads == []
        assert _same(rollout.state_dict(), trainer.state_dict())

    run(go)
