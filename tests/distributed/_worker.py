"""Run under torchrun by test_torchrun.py: stream STEPS global batches and write their digests.

    torchrun --nproc_per_node N _worker.py CONFIG.toml OUT_DIR STEPS [--tp T]

Without --tp every process is its own DP rank (dp_size from the default group); rank 0 writes
`world.json`, the list of global-batch digests. With --tp T the processes form a (N/T, T) device
mesh ("dp", "tp"): the T processes of one DP rank are tensor-parallel peers. The peers at tp=0
take their DP rank from the mesh, the others from the DP process group (both ways must agree),
and every process writes `mesh-rank{R}.json` with its own batches' digests and, on the first
rank of each DP group, the global-batch digests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from zephon_stream import Config, Loader
from zephon_stream.distributed import batch_digest, global_batch_digest


def stream(loader: Loader, steps: int, group: object = None) -> tuple[list[str], list[str | None]]:
    local, world = [], []
    for batch in loader:
        local.append(batch_digest(batch["input_ids"]))
        world.append(global_batch_digest(batch, group))
        if loader.step == steps:
            break
    return local, world


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--tp", type=int, default=0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    config = Config.from_toml(args.config)
    if not args.tp:
        loader = Loader(config)
        assert (loader.dp_rank, loader.dp_size) == (rank, size), (loader.dp_rank, loader.dp_size)
        _, world = stream(loader, args.steps)
        if rank == 0:
            (args.out / "world.json").write_text(json.dumps(world))
    else:
        mesh = init_device_mesh("cpu", (size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        dp_group = mesh.get_group("dp")
        if mesh.get_local_rank("tp") == 0:
            loader = Loader(config, device_mesh=mesh, mesh_dim="dp")
        else:
            loader = Loader(config, dp_group=dp_group)
        local, world = stream(loader, args.steps, dp_group)
        record = {"dp_rank": loader.dp_rank, "dp_size": loader.dp_size, "tp_rank": mesh.get_local_rank("tp"),
                  "local": local, "global": world if dist.get_rank(dp_group) == 0 else None}
        (args.out / f"mesh-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
