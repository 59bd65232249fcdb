"""The Ray side of tests/core/test_transforms.py's ray test, run in a loopback-only network namespace.

    unshare --net -- python -m tests.core._ray_transforms_child CONFIG.toml STEPS|all OUT.json

Runs the config (a source with transforms) on the ray backend, dp 2 on one actor, and writes its
per-sample records and the loader's filtered counts to OUT, or `{"skip": why}` when Ray cannot
start here. The actor imports the transforms by name (tests.core.transform_fns).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio.from_thread

from tests.distributed._launch import loopback_up
from zephon_stream import Config, ConfigError, Loader
from zephon_stream.loader.ray_backend import ray_session
from zephon_stream.testing.determinism import rank_records


def run(cfg: Config, steps: int | None) -> dict:
    records, filtered = [], {}
    for rank in range(2):
        loader = Loader(cfg, dp_rank=rank, dp_size=2, backend="ray")
        records += rank_records(loader, steps)
        for name, n in loader.statistics().filtered_records.items():
            filtered[name] = filtered.get(name, 0) + n
    return {"records": sorted(records, key=lambda r: r[1]), "filtered": filtered}


def main(config_path: str, steps: str, out_path: str) -> None:
    loopback_up()
    cfg = Config.from_toml(config_path).replace(ray_actors=1)
    with anyio.from_thread.start_blocking_portal() as portal:
        try:
            session = portal.wrap_async_context_manager(ray_session(cfg, 1))
            session.__enter__()
        except ConfigError as exc:
            result = {"skip": str(exc)}
        else:
            try:
                result = run(cfg, None if steps == "all" else int(steps))
            finally:
                session.__exit__(None, None, None)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
