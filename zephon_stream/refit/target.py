"""A model as a refit target: an nn.Module's own parameters and buffers, named as the trainer names them.

A rollout engine often lays out weights differently from the trainer. The name map says how,
module tensor name -> what the trainer publishes for it:

* a trainer name (a rename), or
* `Fuse(sources, dim)`: the trainer's tensors laid end to end along `dim`. A fused
  ``qkv_proj.weight`` of shape [q+k+v, d] is ``Fuse(("q_proj.weight", "k_proj.weight",
  "v_proj.weight"))``; each source is then the slice [lo, lo+rows) of the host along dim 0.

Each trainer tensor becomes a view of the module's memory: the tensor itself, or a `Placed`
map into its host, which is the same affine map a shard uses (`layout.Piece`: the host viewed
as [A, S, B] around `dim`, the source holding s in [lo, lo+step)). A pull writes through it
into the parameters' storage in place, so the module's tensors stay the same objects and no
second copy of the model is made.

    sub = Subscriber(prefix, store=store, module=model, name_map={
        f"layers.{i}.attn.qkv_proj.weight": Fuse(tuple(f"layers.{i}.attn.{p}_proj.weight" for p in "qkv"))
        for i in range(n_layers)})
    await sub.pull()
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec
import torch
from torch import nn

from zephon_stream.errors import ConfigError
from zephon_stream.refit.layout import Piece, Sharding, TensorTable
from zephon_stream.refit.local import Placed

__all__ = ["Fuse", "NameMap", "module_state"]


class Fuse(msgspec.Struct, frozen=True):
    """A module tensor made of the trainer's `sources`, concatenated in order along `dim`."""

    sources: tuple[str, ...]
    dim: int = 0

    def __post_init__(self) -> None:
        if not self.sources or len(set(self.sources)) != len(self.sources):
            raise ConfigError(f"Fuse sources={self.sources!r}: give one or more distinct trainer tensor names")
        if self.dim < 0:
            raise ConfigError(f"Fuse dim={self.dim}: give a dimension >= 0")


NameMap = Mapping[str, "str | Fuse"]


def module_state(module: nn.Module, table: TensorTable, name_map: NameMap | None = None,
                 sharding: Sharding | None = None, aliases: Mapping[str, str] | None = None
                 ) -> dict[str, torch.Tensor | Placed]:
    """The trainer-named tensors of `table` (this rank's shards of them, under `sharding`) as
    views of `module`'s parameters and buffers; and of `aliases` (tied names, each the shape of
    the table tensor it names) where the module has them.

    Raises ConfigError naming the tensor when a map entry does not fit the module or the table
    (a missing name, a source used twice, shapes that do not add up along `dim`).
    """
    own = module.state_dict(keep_vars=True)  # parameters and persistent buffers, the objects themselves
    name_map = dict(name_map or {})
    unknown = sorted(set(name_map) - set(own))
    if unknown:
        raise ConfigError(f"name_map names {unknown[:5]} which the module does not have: use names of "
                          "module.state_dict()")
    sharding = sharding or Sharding()
    specs = {s.name: sharding.local_shape(s) for s in table.specs}
    ties = {a: specs[src] for a, src in (aliases or {}).items() if src in specs}
    specs.update(ties)
    out: dict[str, torch.Tensor | Placed] = {}
    for name, tensor in own.items():
        entry = name_map.get(name, name)
        pieces = _placements(name, tensor, entry, specs)
        for source, placed in pieces.items():
            if source in out:
                raise ConfigError(f"trainer tensor {source!r} is mapped to two module tensors: map each once")
            out[source] = placed
    missing = sorted(set(specs) - set(out) - set(ties))  # a module may store a tied tensor once
    if missing:
        raise ConfigError(f"the published version has tensors {missing[:5]} that no module tensor receives: add them "
                          "to name_map (a rename or a Fuse)")
    # the module may hold more (e.g. rotary caches): those stay as they are
    return {k: out[k] for k in specs if k in out}


def _placements(name: str, tensor: torch.Tensor, entry: str | Fuse, specs: dict[str, tuple[int, ...]]
                ) -> dict[str, torch.Tensor | Placed]:
    """{trainer name: its view} for one module tensor (empty: a module tensor nobody publishes)."""
    if isinstance(entry, str):
        if entry != name and entry not in specs:
            raise ConfigError(f"name_map maps {name!r} to {entry!r}, which is not in the published version")
        return {entry: tensor.detach()} if entry in specs else {}
    host = tensor.detach()
    shape = tuple(host.shape)
    if entry.dim >= len(shape):
        raise ConfigError(f"{name!r}: Fuse dim={entry.dim} but the module tensor has shape {shape}")
    lo, out = 0, {}
    for source in entry.sources:
        got = specs.get(source)
        if got is None:
            raise ConfigError(f"{name!r}: Fuse source {source!r} is not in the published version")
        want = shape[: entry.dim] + shape[entry.dim + 1 :]
        if len(got) != len(shape) or got[: entry.dim] + got[entry.dim + 1 :] != want:
            raise ConfigError(f"{name!r} {shape}: Fuse source {source!r} has shape {got}, which does not fit "
                              f"along dim {entry.dim}")
        step = got[entry.dim]
        piece = Piece(math.prod(shape[: entry.dim]), shape[entry.dim], math.prod(shape[entry.dim + 1 :]), lo, step)
        out[source] = Placed(host, piece, got)
        lo += step
    if lo != shape[entry.dim]:
        raise ConfigError(f"{name!r} has {shape[entry.dim]} along dim {entry.dim}, its Fuse sources {entry.sources} "
                          f"add up to {lo}")
    return out
