"""The allocator policy a stream runs under (engine.memory), and the loader's buffers in bytes."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import time
from xml.etree import ElementTree

import anyio
import pytest

from zephon_stream import Loader
from zephon_stream.engine import memory
from zephon_stream.engine.memory import AllocatorPolicy, allocator_stats, policy_from_env
from zephon_stream.errors import ConfigError
from zephon_stream.loader.backends import worker_environ
from zephon_stream.operators.tokenize import Tokenize, word_cache_size

GLIBC = memory._glibc() is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="the C library is not glibc: the policy does nothing here")


def test_policy_from_the_environment() -> None:
    assert policy_from_env({}) == AllocatorPolicy() == policy_from_env({"ZEPHON_MALLOC": "on"})
    assert policy_from_env({"ZEPHON_MALLOC": "off"}) is None
    assert policy_from_env({"ZEPHON_MALLOC": "trim_interval=2.5,arena_max=4"}) == AllocatorPolicy(
        trim_interval=2.5, arena_max=4)
    for bad in ("trim_every=3", "arena_max=many", "yes"):
        with pytest.raises(ConfigError, match=f"ZEPHON_MALLOC='{bad}'.*trim_interval"):
            policy_from_env({"ZEPHON_MALLOC": bad})


@needs_glibc
def test_allocator_stats_see_the_arenas_and_the_large_chunks() -> None:
    """In a fresh process: glibc serves a large request from free heap where it has room (a
    worker that ran the loader's tests held 900 MB free, and the 64 MiB block landed there)."""
    out = _in_a_fresh_process("""
        import ctypes, json
        from zephon_stream.engine import memory
        from zephon_stream.engine.memory import allocator_stats

        libc = memory._glibc()
        libc.malloc.restype = ctypes.c_void_p
        before = allocator_stats()
        block = libc.malloc(64 << 20)  # above any mmap threshold glibc adjusts to (32 MiB at most)
        after = allocator_stats()
        libc.free(ctypes.c_void_p(block))
        print(json.dumps([before.arenas, before.in_use, before.mmapped, after.mmapped]))
    """)
    arenas, in_use, mmapped_before, mmapped_after = json.loads(out)
    assert arenas >= 1 and in_use > 0
    assert mmapped_after >= mmapped_before + (64 << 20)


def _in_a_fresh_process(code: str, **env: str) -> str:
    """Run `code` in a new interpreter (the allocator's settings are per process); its stdout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


FRAGMENT = """
    import ctypes, anyio
    from zephon_stream.engine import memory
    libc = memory._glibc()
    libc.malloc.restype = ctypes.c_void_p
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
    blocks = [libc.malloc(8192) for _ in range(40_000)]  # 320 MB in the heap, below the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 8192)
    for i, b in enumerate(blocks):
        if i % 16:  # every 16th block stays: the heap cannot shrink from its top, only a trim helps
            libc.free(ctypes.c_void_p(b))
    before = rss()
    async def main():
        with anyio.fail_after(30):
            async with memory.managed_memory():
                if memory.policy_from_env() is None:
                    await anyio.sleep(0.5)  # ten trim intervals of the other case: time to do nothing
                while memory.trims == 0 and memory.policy_from_env():  # the trimmer's first round, in its worker thread
                    await anyio.sleep(0.01)
    anyio.run(main)
    print(before, rss(), memory.trims)
"""


@needs_glibc
def test_the_periodic_trim_gives_the_free_heap_back() -> None:
    before, after, trims = map(int, _in_a_fresh_process(FRAGMENT, ZEPHON_MALLOC="trim_interval=0.05").split())
    assert trims >= 1 and before > 250 and after < before - 200, (before, after)


@needs_glibc
def test_switched_off_nothing_is_trimmed() -> None:
    before, after, trims = map(int, _in_a_fresh_process(FRAGMENT, ZEPHON_MALLOC="off").split())
    assert trims == 0 and after > 250 and abs(after - before) < 20, (before, after)


SETTINGS = """
    from zephon_stream.engine import memory
    print(",".join(memory.configure_allocator(memory.AllocatorPolicy(arena_max=2, mmap_threshold=1 << 20))))
"""


@needs_glibc
def test_mallopt_settings_once_and_never_over_the_users_own() -> None:
    assert _in_a_fresh_process(SETTINGS) == "arena_max,mmap_threshold"
    assert _in_a_fresh_process(SETTINGS, MALLOC_ARENA_MAX="8") == "mmap_threshold"


@needs_glibc
def test_a_streaming_loader_trims_and_not_when_switched_off(config, monkeypatch) -> None:
    started: list[float] = []  # the trim interval of each trimmer a stream started
    real = memory._trim_every

    async def spy(seconds: float) -> None:
        started.append(seconds)
        await real(seconds)

    monkeypatch.setattr(memory, "_trim_every", spy)

    def trims_while_streaming(spec: str, batches: int, until_a_trim: bool) -> int:
        """Trims made while streaming `batches` batches, and then until the first trim if asked."""
        monkeypatch.setenv("ZEPHON_MALLOC", spec)
        before, deadline = memory.trims, time.monotonic() + 60
        with Loader(config) as loader:
            for i, _ in enumerate(loader):
                if i >= batches and (not until_a_trim or memory.trims > before or time.monotonic() > deadline):
                    break
        return memory.trims - before

    assert trims_while_streaming("trim_interval=0.01", 3, until_a_trim=True) >= 1 and started == [0.01]
    # off: no trimmer at all, so no trim however long the stream
    assert trims_while_streaming("off", 3, until_a_trim=False) == 0 and started == [0.01]

    async def unset() -> None:  # and with ZEPHON_MALLOC unset, the default schedule
        monkeypatch.delenv("ZEPHON_MALLOC")
        async with memory.managed_memory():
            await anyio.wait_all_tasks_blocked()

    anyio.run(unset)
    assert started == [0.01, AllocatorPolicy().trim_interval]


def test_buffered_bytes_while_streaming(config) -> None:
    cfg = config.replace(backend="inline", max_epochs=0, sample_batch=3)
    per_sample = 12 * cfg.seq_len
    # lane buffers full, the batch in hand, and up to sample_batch samples each lane's sequencer holds
    bound = cfg.lanes * (cfg.sample_buffer + 2) * cfg.sample_batch * per_sample

    async def main() -> tuple[list[tuple[int, int]], int]:
        loader = Loader(cfg)
        assert loader.statistics().buffered_bytes == 0
        seen = []
        with anyio.fail_after(60):
            async with loader.open() as stream:
                for _ in range(3):
                    await stream.__anext__()
                    await anyio.wait_all_tasks_blocked()  # inline lanes run until their buffers are full
                    st = loader.statistics()
                    seen.append((st.buffered_bytes, st.buffered_batches))
        return seen, loader.statistics().buffered_bytes

    seen, after = anyio.run(main)
    for held, batches in seen:
        assert batches == cfg.sample_buffer * cfg.lanes
        assert batches * per_sample <= held <= bound, (held, bound)  # a hand-off holds 1..sample_batch samples
    assert after == 0  # the stream closed: nothing is held


@pytest.mark.parametrize("backend", ["inline", "threads", "processes"])
def test_buffered_bytes_are_exact_and_count_the_pixels(vision_config, backend) -> None:
    """Image samples: buffered_bytes is the bytes of the samples in the lane buffers (or waiting
    for room in them) and in the sequencer's hands, their pixels included. What the buffers hold
    is taken out of them here, so the count is checked against the samples themselves."""
    cfg = vision_config.replace(backend=backend)

    async def main() -> tuple[int, int, int]:
        loader = Loader(cfg)
        with anyio.fail_after(60):
            async with loader.open() as stream:
                await stream.__anext__()
                while loader.statistics().buffered_batches < cfg.lanes:  # worker lanes fill their buffers
                    await anyio.sleep(0.01)
                await anyio.wait_all_tasks_blocked()
                # no await from here on: nothing moves between the count and the samples counted
                counted = loader.statistics().buffered_bytes
                held = [s for st in loader._batch_streams for q in st.pending.values() for s in q]
                buffered = []
                for recv in loader._streams.values():  # what each lane buffer holds (or waits to), taken out
                    while True:
                        try:
                            buffered += recv.receive_nowait()
                        except anyio.WouldBlock:
                            break
                samples = held + buffered
                return counted, sum(s.nbytes for s in samples), sum(im.nbytes for s in samples for im in s.images)

    counted, want, pixels = anyio.run(main)
    assert pixels > 0
    assert counted == want, (counted, want)


@needs_glibc
def test_malloc_info_shows_every_arena_and_a_freed_chunk() -> None:
    libc = memory._glibc()
    libc.malloc.restype = ctypes.c_void_p

    def free_in_bins() -> int:
        """Bytes free in every arena's bins, the unsorted one too (not the fast bins or the top).

        Summed over the arenas, since the block may come from any one (the thread's), and not by
        chunk size: the unsorted bin is one entry whose `from` is its smallest chunk."""
        heaps = ElementTree.fromstring(memory.malloc_info()).findall("heap")
        return sum(int(heap.find("total[@type='rest']").get("size")) for heap in heaps)

    # three blocks under the mmap threshold: the middle one, freed, cannot merge into the arena's top
    blocks = [libc.malloc(100_000) for _ in range(3)]
    try:
        before = free_in_bins()
        libc.free(ctypes.c_void_p(blocks.pop(1)))
        # the 100,016-byte chunk, less what the interpreter took from the bins in between (a few KiB)
        assert free_in_bins() >= before + 90_000
        assert len(ElementTree.fromstring(memory.malloc_info()).findall("heap")) == allocator_stats().arenas
    finally:
        for block in blocks:
            libc.free(ctypes.c_void_p(block))


# A malloc of its own, as jemalloc or mimalloc under LD_PRELOAD: here it forwards to glibc's, so the
# child stays sound whatever the code under test does, while the process's malloc is not glibc's
INTERPOSER = r"""
#include <stddef.h>
void *__libc_malloc(size_t); void __libc_free(void *); void *__libc_calloc(size_t, size_t);
void *__libc_realloc(void *, size_t);
void *malloc(size_t n) { return __libc_malloc(n); }
void free(void *p) { __libc_free(p); }
void *calloc(size_t n, size_t m) { return __libc_calloc(n, m); }
void *realloc(void *p, size_t n) { return __libc_realloc(p, n); }
"""


@needs_glibc
def test_another_allocator_preloaded_is_left_alone(tmp_path) -> None:
    # With jemalloc preloaded, malloc_info's buffer (allocated by jemalloc) went to glibc's free:
    # "free(): invalid pointer" and an abort. Now glibc's settings, trims and figures stand down.
    if not any(os.access(os.path.join(d, "cc"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("no C compiler (cc) to build the test allocator")
    (tmp_path / "interpose.c").write_text(INTERPOSER)
    lib = tmp_path / "libinterpose.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(tmp_path / "interpose.c")], check=True)
    probe = textwrap.dedent("""
        import json
        from zephon_stream.engine import memory
        print(json.dumps([memory._glibc() is None, memory.allocator_stats(), memory.malloc_info(), memory.trim(),
                          memory.mallopt(memory.M_TRIM_THRESHOLD, 1 << 20)]))
    """)
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "LD_PRELOAD": str(lib)})
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == [True, None, None, False, False]
    assert not memory.malloc_interposed(memory._glibc())  # this process: glibc's own malloc


def test_worker_processes_share_the_cores_in_the_tokenizer_pool(monkeypatch) -> None:
    """Each worker's `tokenizers` pool gets its share of the cores, shared with the other ranks on
    the machine, not one thread per core each (and an arena per thread); a RAYON_NUM_THREADS the
    user set is passed on as it is."""
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert worker_environ(4)["RAYON_NUM_THREADS"] == "4"
    assert worker_environ(3)["RAYON_NUM_THREADS"] == "5"
    assert worker_environ(32)["RAYON_NUM_THREADS"] == "1"
    assert "RAYON_NUM_THREADS" not in os.environ  # only the workers' environment has it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 ranks on this machine (torchrun), each with its workers
    assert worker_environ(2)["RAYON_NUM_THREADS"] == "2"
    assert worker_environ(8)["RAYON_NUM_THREADS"] == "1"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert worker_environ(4)["RAYON_NUM_THREADS"] == "4"
    monkeypatch.setenv("RAYON_NUM_THREADS", "7")
    assert worker_environ(4)["RAYON_NUM_THREADS"] == "7"


_WORD_CACHE_CHILD = textwrap.dedent("""
    import json, random, sys
    from zephon_stream.engine.memory import allocator_stats
    from zephon_stream.operators.tokenize import Tokenize

    size = json.loads(sys.argv[2])
    tok = Tokenize(sys.argv[1], "<|endoftext|>", word_cache=size)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    # 160,000 distinct words: with 8 threads each meets about 20,000, more than a 10,000-word cache holds
    words = list({"".join(rng.choices(letters, k=10)) for _ in range(170_000)})[:160_000]
    docs = [" ".join(words[i:i + 500]) for i in range(0, len(words), 500)]
    tok(docs[:8])  # the pool's threads and their arenas exist before the first figure
    before = allocator_stats().in_use
    for i in range(8, len(docs), 16):
        tok(docs[i:i + 16])
    print(allocator_stats().in_use - before)
""")


@needs_glibc
def test_the_tokenizer_threads_word_caches_are_bounded(dataset) -> None:
    """`tokenizers` keeps a BPE word cache per thread of its pool (one per core), 10,000 words each,
    and never empties it: Tokenize bounds what all the threads keep (2,500 words each on 8 threads),
    so what the caches hold grows a quarter as much with the cores. The ids do not depend on it."""
    root, docs = dataset
    env = {**os.environ, "RAYON_NUM_THREADS": "8", "ZEPHON_WORD_CACHE": ""}

    def grown(size: int | None) -> int:
        out = subprocess.run([sys.executable, "-c", _WORD_CACHE_CHILD, str(root / "tokenizer.json"), json.dumps(size)],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    words = word_cache_size(env)
    assert words == 2_500
    library, bounded, none = grown(None), grown(words), grown(0)
    per_word = (library - none) / (8 * 10_000)  # bytes a cached word holds
    assert per_word > 100, (library, bounded, none)
    assert bounded - none < 8 * words * per_word * 1.5, (library, bounded, none)
    assert library - none > 3 * (bounded - none), (library, bounded, none)

    texts = docs["a"][:200]
    ids = [Tokenize(str(root / "tokenizer.json"), "<|endoftext|>", word_cache=n)(texts) for n in (None, words, 0)]
    assert all(len(a) == len(b) and all((x == y).all() for x, y in zip(a, b)) for a, b in zip(ids, ids[1:]))


def test_word_cache_from_the_environment(monkeypatch) -> None:
    """The threads share 20,000 words (10,000 each on 2 cores, the library's size; at least 2,500
    each), unless ZEPHON_WORD_CACHE says otherwise."""
    for threads, words in (("1", 10_000), ("2", 10_000), ("4", 5_000), ("8", 2_500), ("64", 2_500)):
        assert word_cache_size({"RAYON_NUM_THREADS": threads}) == words
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert word_cache_size({}) == 2_500 == word_cache_size({"ZEPHON_WORD_CACHE": " "})
    assert word_cache_size({"RAYON_NUM_THREADS": "8", "ZEPHON_WORD_CACHE": "0"}) == 0
    assert word_cache_size({"ZEPHON_WORD_CACHE": "tokenizers"}) is None
    with pytest.raises(ConfigError, match="ZEPHON_WORD_CACHE='-1'.*number of words"):
        word_cache_size({"ZEPHON_WORD_CACHE": "-1"})


_SHARED_CHILD = textwrap.dedent("""
    import random, sys
    from zephon_stream.engine.memory import allocator_stats
    from zephon_stream.operators.tokenize import Tokenize

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = list({"".join(rng.choices(letters, k=10)) for _ in range(45_000)})[:40_000]
    docs = [" ".join(words[i:i + 500]) for i in range(0, len(words), 500)]
    grown = []
    for round in range(4):  # as a new Loader each time would: a tokenizer for the config, all the words through it
        tok = (Tokenize.shared(sys.argv[1], "<|endoftext|>") if sys.argv[2] == "shared"
               else Tokenize(sys.argv[1], "<|endoftext|>"))
        before = allocator_stats().in_use
        for i in range(0, len(docs), 8):
            tok(docs[i:i + 8])
        del tok
        grown.append(allocator_stats().in_use - before)
    print(*grown)
""")


@needs_glibc
def test_loaders_in_one_process_share_the_tokenizer_and_its_word_caches(dataset) -> None:
    """`tokenizers` keeps each model instance's word caches in its threads' thread-local maps and
    leaves them there when the instance goes: a new Tokenize for every Loader of a process would
    add a full set of caches each time. `Tokenize.shared` (what a Loader uses) keeps one instance a
    file, so the second and later rounds add nothing."""
    root, _ = dataset
    path = str(root / "tokenizer.json")
    env = {**os.environ, "RAYON_NUM_THREADS": "4", "ZEPHON_WORD_CACHE": ""}

    def rounds(mode: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", _SHARED_CHILD, path, mode], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [int(x) for x in out.stdout.split()]

    new, shared = rounds("new"), rounds("shared")
    leaked = min(new[1:])  # each new instance's caches: 4 threads x 5,000 words
    assert leaked > 4 * 5_000 * 100, (new, shared)
    assert max(shared[1:]) < leaked / 5, (new, shared)


def test_shared_tokenizer_is_one_instance_a_file_and_setting(dataset, tmp_path, monkeypatch) -> None:
    root, _ = dataset
    path = str(root / "tokenizer.json")
    a = Tokenize.shared(path, "<|endoftext|>")
    assert Tokenize.shared(path, "<|endoftext|>") is a
    ids = a(["shared words"])[0][:-1]  # without the EOS
    assert a.tokenizer.encode("shared words", add_special_tokens=False).ids == ids.tolist()
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes((root / "tokenizer.json").read_bytes())
    assert Tokenize.shared(str(copy), "<|endoftext|>") is not a  # another file, even with the same bytes
    assert Tokenize.shared(path, "<|endoftext|>", "<|endoftext|>") is not a  # other special tokens
    monkeypatch.setenv("ZEPHON_WORD_CACHE", "7")
    assert Tokenize.shared(path, "<|endoftext|>") is not a  # another word cache size
    monkeypatch.delenv("ZEPHON_WORD_CACHE")
    copy.write_bytes(copy.read_bytes().replace(b'"<|endoftext|>"', b'"<|endoftext|>"', 1) + b" ")
    b = Tokenize.shared(str(copy), "<|endoftext|>")
    assert Tokenize.shared(str(copy), "<|endoftext|>") is b
    copy.write_bytes(copy.read_bytes() + b"\n")  # the file changed: a new tokenizer, not the old one
    assert Tokenize.shared(str(copy), "<|endoftext|>") is not b
    with pytest.raises(ConfigError, match="cannot be read"):
        Tokenize.shared(str(tmp_path / "missing" / "tokenizer.json"), "<|endoftext|>")


def test_a_ray_actor_sizes_its_tokenizer_pool_to_its_cpus() -> None:
    """A lane actor reserves `ray_num_cpus`: its tokenizer pool gets that many threads (at least
    one), not one per core of the node, unless RAYON_NUM_THREADS is already set."""
    from zephon_stream.loader.ray_backend import size_tokenizer_pool

    for cpus, threads in ((1.0, "1"), (2.5, "2"), (0.25, "1"), (8, "8")):
        env: dict[str, str] = {}
        size_tokenizer_pool(cpus, env)
        assert env == {"RAYON_NUM_THREADS": threads}
    env = {"RAYON_NUM_THREADS": "7"}
    size_tokenizer_pool(1.0, env)
    assert env["RAYON_NUM_THREADS"] == "7"
    env = {"RAYON_NUM_THREADS": " "}
    size_tokenizer_pool(3.0, env)
    assert env["RAYON_NUM_THREADS"] == "3" and word_cache_size(env) == 6_666


@pytest.mark.parametrize(("value", "threads"), [("4", 4), ("+4", 4), ("1", 1), ("", None), (" ", None), ("0", None),
                                                ("00", None), (" 4", None), ("4 ", None), ("-2", None), ("four", None),
                                                ("\u0664", None), ("2.5", None)])
def test_the_places_that_read_rayon_num_threads_agree_with_rayon(monkeypatch, value: str, threads: int | None) -> None:
    """RAYON_NUM_THREADS sizes Rayon's pool only where Rayon parses it as a positive integer
    (`usize::from_str`: digits, a leading "+", no spaces); otherwise the pool gets a thread per
    core. The worker processes' environment, a Ray actor's pool and the word caches all read it
    that way: a value Rayon ignores is replaced with the share of the cores, not passed on."""
    from zephon_stream.engine.cpu import rayon_threads
    from zephon_stream.loader.ray_backend import size_tokenizer_pool

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert rayon_threads({"RAYON_NUM_THREADS": value}) == threads
    legacy = {"RAYON_NUM_THREADS": value, "RAYON_RS_NUM_CPUS": "3"}  # Rayon's deprecated name, read after it
    zero = value in ("0", "00")  # a number: Rayon takes the cores and does not read the old name
    assert rayon_threads(legacy) == (threads or (None if zero else 3))
    assert rayon_threads({"RAYON_RS_NUM_CPUS": "3"}) == 3 and rayon_threads({"RAYON_RS_NUM_CPUS": "0"}) is None
    monkeypatch.delenv("RAYON_RS_NUM_CPUS", raising=False)
    monkeypatch.setenv("RAYON_NUM_THREADS", value)
    actor = {"RAYON_NUM_THREADS": value}
    size_tokenizer_pool(2.0, actor)
    if threads is None:
        assert worker_environ(4)["RAYON_NUM_THREADS"] == "4" and actor["RAYON_NUM_THREADS"] == "2"
        assert word_cache_size({"RAYON_NUM_THREADS": value}) == 2_500  # 16 cores: 20,000 // 16, at least 2,500
    else:
        assert worker_environ(4)["RAYON_NUM_THREADS"] == value == actor["RAYON_NUM_THREADS"]
        assert word_cache_size({"RAYON_NUM_THREADS": value}) == min(10_000, max(2_500, 20_000 // threads))
