"""The C allocator under a long stream: glibc malloc's figures and settings, through ctypes.

A loader process allocates from many threads at once: the event loop, the CPU-step workers
(decode, tokenize, collate) and the tokenizer's own Rayon pool. glibc gives such threads arenas
of their own (up to 8 per core), and an arena keeps the pages it has freed unless they sit at
its very top. Over a long run each arena's free space grows towards its own peak, so resident
memory climbs for many minutes with no leak: `mallinfo2` shows the bytes in use flat while the
free bytes inside the arenas grow by as much as RSS does. Capping the arenas
(`MALLOC_ARENA_MAX=2`) holds RSS flat but makes the threads queue for two arena locks, which
cost 26% of the throughput on the many-core machine where the growth was reported.
The tokenizer's pool has one thread per core, so the arenas, and the free space they keep, grow
with the machine (emulated on 2 cores with 32 tokenizer threads and glibc's limit of a 32-core
machine: 950 MB in the first 1.5 minutes against 538 MB; see the README). Part of that was
`tokenizers`' word cache, one per pool thread, which `operators.tokenize.Tokenize` now bounds
(20,000 words among the pool's threads, at least 2,500 each; `ZEPHON_WORD_CACHE`).

`managed_memory()`, entered by every loader stream and lane worker process, keeps the arenas
and gives their free pages back instead: every `trim_interval` seconds (60) a worker thread
calls `malloc_trim(0)`, which releases the whole free pages of every arena (a few ms; the event
loop never waits on it), so a burst (an oversized document, a restore) does not stay resident
for the rest of the run.

What a trim can and cannot do (bench/soak.py, which splits RSS by kind of mapping; 30 min at
the defaults on a shared 2-core machine): pymalloc's blocks and gc's objects are flat, the bytes
in use rise slowly (+15 MB over the last 25 min, in every variant: tracemalloc shows the live
token arrays from Tokenize growing in number, +1061 in 5 min; sampled over an endless stream
they are the lanes' read-ahead, 900-1,500 documents under its bound of `doc_buffer` x
`tokenize_batch` a lane, and the shuffle windows: bounded, not the allocator's doing), and the rest of the growth
is in the thread arenas: at the end 46-60 MB of their ~110 MB free sits in chunks under 4 KiB,
between live ones, which `malloc_trim` cannot return. So no trim schedule makes RSS flat: the
slope was 2.0 MB/min with no trim, 2.2 trimming every 60 s and 3.4 every 10 s (peak 474, 472
and 456 MB). And each trim costs a refill, whatever the interval: it releases the 30-50 MB of
whole free pages the threads are cycling through, and they fault them back within seconds
(5.0k page faults per million tokens untrimmed, 7.2k every 60 s, 15k every 10 s: about 3% of
the tokens per CPU-second at 10 s). Trimming only once RSS has grown by a margin does not hold
it either: the refill raises the level the margin is taken from. Fewer arenas cut the growth
but serialize the threads (`arena_max=4`: -12% tokens per CPU-second on 2 cores;
`MALLOC_ARENA_MAX=2`: -26% on a many-core machine), and a fixed 1 MiB mmap threshold doubles
the page faults without lowering the slope.

    ZEPHON_MALLOC=off                          # leave malloc as the process found it
    ZEPHON_MALLOC=trim_interval=10             # trim more often: ~15-30 MB lower, ~3% of the CPU
    ZEPHON_MALLOC=trim_interval=0,arena_max=4  # no trim; at most 4 arenas (mallopt M_ARENA_MAX)

`arena_max`, `mmap_threshold` and `trim_threshold` are glibc's `mallopt` settings, set once
per process and never over the same setting given to glibc in the environment
(`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`). Elsewhere than
glibc (musl, macOS), or where another allocator answers malloc (`malloc_interposed`: jemalloc or
mimalloc under `LD_PRELOAD`), nothing is done. `allocator_stats()` reads the figures, as bench/soak.py
prints them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import anyio
import msgspec

from zephon_stream.engine import threads
from zephon_stream.engine.forks import ForkLock
from zephon_stream.errors import ConfigError

__all__ = ["MEMORY_ENV", "AllocatorPolicy", "AllocatorStats", "allocator_stats", "configure_allocator", "malloc_info",
           "malloc_interposed", "mallopt", "managed_memory", "policy_from_env", "trim"]

#: Set to "off" to leave the C allocator as the process found it.
MEMORY_ENV = "ZEPHON_MALLOC"

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class AllocatorStats(msgspec.Struct, frozen=True):
    """glibc malloc's figures for the whole process, in bytes (`mallinfo2`, `malloc_info`)."""

    arenas: int  # malloc arenas (the main one and one per thread that found the others locked)
    heap: int  # bytes the arenas hold from the system (sbrk and arena heaps), free or not
    mmapped: int  # bytes in chunks mapped on their own (the large allocations)
    in_use: int  # bytes allocated and not freed, in the arenas
    free: int  # bytes free inside the arenas: held from the system, not used (fragmentation shows here)
    releasable: int  # free bytes at the top of the main arena, that a trim gives back at once


_lock = threading.Lock()
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: not glibc


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with mallinfo2 (2.33+) and its malloc is the process's, else
    None: nothing to set or read (musl, macOS, or another allocator preloaded)."""
    global _libc
    with _lock:
        if _libc is False:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None)
            glibc = hasattr(lib, "gnu_get_libc_version") and hasattr(lib, "mallinfo2")
            _libc = lib if glibc and not malloc_interposed(lib) else None
            if _libc is not None:
                _libc.mallinfo2.restype = _Mallinfo2
                _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                _libc.open_memstream.restype = ctypes.c_void_p
                _libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
                _libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
                _libc.fclose.argtypes = [ctypes.c_void_p]
                _libc.free.argtypes = [ctypes.c_void_p]
                _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return _libc or None


def malloc_interposed(libc: ctypes.CDLL) -> bool:
    """Whether another allocator answers the process's malloc than `libc`'s own: jemalloc, mimalloc
    or tcmalloc under `LD_PRELOAD`, as ML jobs often run. glibc's settings, trims and figures
    would then be about arenas nobody allocates from, and `malloc_info`'s buffer, allocated by
    that allocator, must not go to glibc's `free` (an abort: "free(): invalid pointer")."""
    process = ctypes.CDLL(None)  # the symbols as the process resolves them, a preloaded library first
    return ctypes.cast(process.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value


def allocator_stats() -> AllocatorStats | None:
    """The allocator's figures now, or None where glibc's malloc is not the process's (`_glibc`)."""
    libc = _glibc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return AllocatorStats(_count_arenas(), info.arena, info.hblkhd, info.uordblks, info.fordblks, info.keepcost)


def _count_arenas() -> int:
    return len(re.findall(rb"<heap nr=", malloc_info() or b""))


def malloc_info() -> bytes | None:
    """glibc's `malloc_info` XML: per arena, its free chunks by size; None where glibc's malloc is not the
    process's (`_glibc`)."""
    libc = _glibc()
    if libc is None:
        return None
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return b""
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    try:
        return ctypes.string_at(buf, size.value)
    finally:
        libc.free(buf)


def mallopt(param: int, value: int) -> bool:
    """glibc `mallopt(param, value)`; False where it is refused or the C library is not glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(param, value))


def trim() -> bool:
    """Give the free pages of every arena back to the system (`malloc_trim(0)`); True if any were."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class AllocatorPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `managed_memory` does to glibc malloc; 0 leaves a setting as glibc has it."""

    trim_interval: float = 60.0  # seconds between two malloc_trim(0) while a stream runs; 0 = never
    arena_max: int = 0  # M_ARENA_MAX (glibc: 8 per core)
    mmap_threshold: int = 0  # M_MMAP_THRESHOLD in bytes (glibc: 128 KiB, raised by each large free)
    trim_threshold: int = 0  # M_TRIM_THRESHOLD in bytes (glibc: 128 KiB, raised with the mmap threshold)


def policy_from_env(environ: Mapping[str, str] = os.environ) -> AllocatorPolicy | None:
    """The policy that `ZEPHON_MALLOC` asks for: unset, "" or "on": the default; "off": None (leave
    malloc alone); else `key=value,...` over the default (`trim_interval=30,arena_max=4`)."""
    spec = environ.get(MEMORY_ENV, "").strip()
    if spec in ("", "on"):
        return AllocatorPolicy()
    if spec == "off":
        return None
    try:
        fields = dict(kv.split("=", 1) for kv in spec.split(","))
        return msgspec.convert(fields, AllocatorPolicy, strict=False)
    except (ValueError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{MEMORY_ENV}={spec!r}: {exc}; use on, off, or key=value pairs separated by commas "
                          f"from {', '.join(AllocatorPolicy.__struct_fields__)}") from None


_SETTINGS = (("arena_max", M_ARENA_MAX, "MALLOC_ARENA_MAX"), ("mmap_threshold", M_MMAP_THRESHOLD,
             "MALLOC_MMAP_THRESHOLD_"), ("trim_threshold", M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"))
_applied: set[str] = set()


def configure_allocator(policy: AllocatorPolicy) -> list[str]:
    """Set `policy`'s mallopt settings, once per process; the names of those set now. A setting that
    the environment gives glibc itself (`MALLOC_ARENA_MAX`, ...) is left as the user chose it."""
    done = []
    for field, param, env in _SETTINGS:
        value = getattr(policy, field)
        if value and field not in _applied and env not in os.environ and mallopt(param, value):
            _applied.add(field)
            done.append(field)
    return done


@asynccontextmanager
async def managed_memory(policy: AllocatorPolicy | None | bool = True) -> AsyncIterator[None]:
    """While the block runs, hold glibc malloc to `policy` (True: `ZEPHON_MALLOC`'s, by default
    the default; None: nothing): its settings once per process, and a trim every `trim_interval`
    seconds in a worker thread, off the event loop."""
    chosen = policy_from_env() if policy is True else policy or None
    if chosen is None or _glibc() is None:
        yield
        return
    configure_allocator(chosen)
    if not chosen.trim_interval:
        yield
        return
    async with anyio.create_task_group() as tg:
        tg.start_soon(_trim_every, chosen.trim_interval)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()


_trimming = ForkLock()  # one held at the fork (a trim in another thread) stayed held: no trims there
trims = 0  # malloc_trim calls made by managed_memory in this process (for tests and benchmarks)
trim_seconds = 0.0  # the CPU time they took, in all


async def _trim_every(seconds: float) -> None:
    while True:
        await anyio.sleep(seconds)
        await threads.run_sync(_trim_once)


def _trim_once() -> None:
    """One trim, unless another stream's trimmer is at it now (once is enough for the process)."""
    global trims, trim_seconds
    if _trimming.acquire(blocking=False):
        try:
            start = time.thread_time()
            trim()
            trims, trim_seconds = trims + 1, trim_seconds + time.thread_time() - start
        finally:
            _trimming.release()
