"""The streaming primitives both jobs run on. Nothing here imports the loader, refit or torch.

- `ordered`: items through concurrent workers into a bounded window, committed in order
  (`run_ordered`: refit's publish and pull, the relay's copies);
- `window`: the read-ahead window of ranged reads (`ReadWindow`: a loader lane's split, an S3 read);
- `cpu`: where CPU steps run (`CpuPolicy`: inline, or threads under one limiter);
- `operator`: the protocol of a lane's stateful stages (`Operator`: next / state / refs / restore);
- `rng`: counter-based randomness (`mix64`, `permutation`), so no RNG object is ever checkpointed;
- `threads`: blocking calls in worker threads that the event loop never waits to start (`run_sync`);
- `memory`: glibc arenas trimmed on a timer, off the loop (`managed_memory`, `ZEPHON_MALLOC`);
- `files`: files written whole or not at all (`atomic_write`: checkpoints, shards, version records).

Error groups from task groups are unwrapped by one function, `zephon_stream.errors.unwrap_groups`.
"""

__all__: list[str] = []
