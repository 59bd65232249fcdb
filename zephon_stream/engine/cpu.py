"""The CPU policy: where the CPU steps of a pipeline run, and how many at once.

Both jobs have CPU steps between their I/O: the loader decodes and tokenizes, refit and the relay
hash, diff, compress and decompress. They run them through one `CpuPolicy`:

- `inline`: on the caller's event loop (the order of work is the same, nothing overlaps);
- `threads` (the default): in worker threads, at most `threads` at once under one
  `anyio.CapacityLimiter`, so the event loop stays free for I/O and for the trainer.

A process-level policy (the loader's `processes` backend) runs lanes, each with a threads policy,
in other processes; it is a backend, not a CPU policy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio

from zephon_stream.engine import threads

__all__ = ["CpuPolicy", "default_threads", "rayon_threads", "usable_cores"]

T = TypeVar("T")


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one), as Rayon counts them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rayon_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """The threads the environment gives the tokenizer's Rayon pool, read as Rayon reads it, or
    None where it gives none and Rayon starts a thread per core. `RAYON_NUM_THREADS` is a number
    when it is decimal digits (a leading "+" allowed, no spaces), and 0 means a thread per core;
    unset or not a number, Rayon reads the deprecated `RAYON_RS_NUM_CPUS` the same way. Every place
    that asks "did the user size the pool?" asks this, so they agree with Rayon and each other."""
    threads = _number(environ.get("RAYON_NUM_THREADS", ""))
    if threads is None:
        threads = _number(environ.get("RAYON_RS_NUM_CPUS", ""))
    return threads or None


def _number(text: str) -> int | None:
    """`usize::from_str`: ASCII digits after an optional "+", else None."""
    digits = text[1:] if text.startswith("+") else text
    return int(digits) if digits.isascii() and digits.isdigit() else None


def default_threads(workers: int) -> int:
    """Threads for CPU steps when the caller gives none: one per worker, at most one per core."""
    return max(1, min(workers, os.cpu_count() or 1))


class CpuPolicy:
    """Runs CPU steps inline or in at most `threads` worker threads: `await cpu(fn, *args)`."""

    def __init__(self, threads: int, *, inline: bool = False) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads, self.inline = threads, inline
        self.limiter = anyio.CapacityLimiter(threads)

    def __repr__(self) -> str:
        return "CpuPolicy(inline)" if self.inline else f"CpuPolicy(threads={self.threads})"

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline:
            return fn(*args)
        return await threads.run_sync(fn, *args, limiter=self.limiter)
