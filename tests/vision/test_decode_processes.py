"""Decoding in worker processes (`vision.decode_processes`): the same frames and refusals as on
threads, a dead worker named and replaced, workers that end with their parent.
tests/core/test_decode_processes.py runs the loader with them."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from tests.vision.test_image import GENERATED, gif_header, png_bomb
from zephon_stream import ConfigError, DecodeWorkerError
from zephon_stream.loader.config import VisionConfig
from zephon_stream.vision import ImageSpec, load_image, patch_frame
from zephon_stream.vision.image import BadImage
from zephon_stream.vision.processes import DecodePool

pytestmark = pytest.mark.skipif(os.name != "posix", reason="decode processes need POSIX")

BAD = {"bomb": png_bomb(), "gif-bomb": gif_header((1, 1), (20000, 20000)), "not-an-image": b"hello, world",
       "truncated": GENERATED["rgb-png-500x375"][:2000], "empty": b""}


def threads_way(data: bytes, spec: ImageSpec) -> tuple[np.ndarray, int, int] | str:
    try:
        image = load_image(data, spec)
    except BadImage as exc:
        return str(exc)
    return patch_frame(image, spec), image.shape[0] // spec.patch_size, image.shape[1] // spec.patch_size


@pytest.fixture(scope="module")
def pool():
    pool = DecodePool(2)
    yield pool
    pool.close()


SPECS = [ImageSpec(), ImageSpec(patch_size=16, max_pixels=50_000), ImageSpec(min_pixels=400_000, max_pixels=900_000)]


@pytest.mark.parametrize("spec", SPECS, ids=["default", "patch-16-small", "large"])
def test_frames_and_refusals_equal_the_threads_way(pool: DecodePool, spec: ImageSpec) -> None:
    """Every generated image and every bad one, in one call: the same frames, grids and BadImage
    texts, in order. The large spec grows the workers' slabs after the smaller ones."""
    images = [*GENERATED.values(), *BAD.values()]
    got = pool.decode(images, spec)
    assert len(got) == len(images)
    for data, out in zip(images, got):
        want = threads_way(data, spec)
        if isinstance(want, str):
            assert isinstance(out, BadImage) and str(out) == want
        else:
            frame, gh, gw = out
            assert (gh, gw) == want[1:] and frame.dtype == np.uint8 and frame.flags.writeable
            np.testing.assert_array_equal(frame, want[0])


def test_calls_from_many_threads_at_once(pool: DecodePool) -> None:
    """More threads than workers: each call waits for a free worker and gets its own images back."""
    from concurrent.futures import ThreadPoolExecutor

    spec, names = ImageSpec(), list(GENERATED)
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda i: pool.decode([GENERATED[names[i % len(names)]]], spec)[0], range(24)))
    for i, out in enumerate(results):
        want = threads_way(GENERATED[names[i % len(names)]], spec)
        if isinstance(want, str):
            assert str(out) == want
        else:
            np.testing.assert_array_equal(out[0], want[0])


def test_a_dead_worker_is_replaced_and_its_call_made_again() -> None:
    with closing(DecodePool(1)) as pool:
        spec, image = ImageSpec(), GENERATED["rgb-png-500x375"]
        assert len(pool.decode([image], spec)) == 1
        (worker,) = pool._all
        worker.proc.send_signal(signal.SIGKILL)  # as the kernel kills one short of memory
        worker.proc.wait()
        (out,) = pool.decode([image], spec)  # made again on a new worker
        np.testing.assert_array_equal(out[0], threads_way(image, spec)[0])
        assert len(pool._all) == 1 and pool._all[0].proc.pid != worker.proc.pid


def test_a_worker_killed_as_it_starts_is_replaced() -> None:
    with closing(DecodePool(1)) as pool:
        pool.start()
        (worker,) = pool._all
        worker.proc.kill()  # before it said it was ready
        (out,) = pool.decode([GENERATED["bmp"]], ImageSpec())
        np.testing.assert_array_equal(out[0], threads_way(GENERATED["bmp"], ImageSpec())[0])


def test_a_call_whose_second_worker_dies_too_fails_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from zephon_stream.vision import processes

    with closing(DecodePool(1)) as pool:
        def dies(self, *args):
            self.proc.kill()
            self.proc.wait()
            raise self._died("during a call")

        monkeypatch.setattr(processes._Worker, "call", dies)
        with pytest.raises(DecodeWorkerError, match=r"image decode worker process \(pid \d+\) ended during a call, "
                                                     r"killed by SIGKILL, and so did the worker that took its call"):
            pool.decode([GENERATED["bmp"]], ImageSpec())
        monkeypatch.undo()
        assert len(pool.decode([GENERATED["bmp"]], ImageSpec())) == 1  # its place was kept


def test_workers_end_with_the_pool_and_with_their_parent(tmp_path: Path) -> None:
    pool = DecodePool(2)
    pool.decode([GENERATED["bmp"]] * 3, ImageSpec())
    procs = [w.proc for w in pool._all]
    assert procs and all(p.poll() is None for p in procs)
    pool.close()
    assert all(p.poll() is not None for p in procs)
    for _ in range(3):  # each call fails at once, none waits for a place lost by the one before
        with pytest.raises(RuntimeError, match="shut down"):
            pool.decode([GENERATED["bmp"]], ImageSpec())
    # a parent killed outright: its workers see their input end and exit
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import signal, sys
        from zephon_stream.vision import ImageSpec
        from zephon_stream.vision.processes import DecodePool
        pool = DecodePool(2)
        pool.decode([open(sys.argv[1], "rb").read()] * 4, ImageSpec())
        print(" ".join(str(w.proc.pid) for w in pool._all), flush=True)
        signal.pause()  # until killed
    """))
    (tmp_path / "img.png").write_bytes(GENERATED["rgb-png-500x375"])
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "img.png")], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert pids
    exits = [os.pidfd_open(pid) for pid in pids]  # readable once the process has ended
    try:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        ended, _, _ = select.select(exits, [], [], 10)  # waits on the exits themselves, not on a clock
        while len(ended) < len(exits) and (more := select.select(
                [fd for fd in exits if fd not in ended], [], [], 10)[0]):
            ended += more
        assert sorted(ended) == sorted(exits)
    finally:
        for fd in exits:
            os.close(fd)


def test_decode_processes_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"vision.decode_processes = -1: must be >= 0 \(0: decode on the decode "
                                          r"threads\)"):
        VisionConfig(decode_processes=-1)


def test_pillows_truncated_images_setting_is_refused_as_on_threads(pool: DecodePool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker never has `LOAD_TRUNCATED_IMAGES` set: the calling process's setting is refused as the
    threads' decode refuses it, so the two ways decode the same images or neither does."""
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ConfigError, match="LOAD_TRUNCATED_IMAGES is True in this process"):
        pool.decode([GENERATED["bmp"]], ImageSpec())


def test_a_call_interrupted_before_its_reply_leaves_no_stale_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt between a request and its reply: the worker's reply is never read, so the
    worker is dropped, and the next call gets its own images, not the interrupted call's."""
    from zephon_stream.vision import processes

    with closing(DecodePool(1)) as pool:
        spec = ImageSpec()
        real = processes._receive
        calls = []

        def interrupted(pipe):
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(pipe)

        monkeypatch.setattr(processes, "_receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.decode([GENERATED["rgb-png-500x375"]], spec)
        (out,) = pool.decode([GENERATED["bmp"]], spec)
        np.testing.assert_array_equal(out[0], threads_way(GENERATED["bmp"], spec)[0])


def test_start_begins_the_workers_before_the_first_call() -> None:
    with closing(DecodePool(2)) as pool:
        pool.start()
        assert len(pool._all) == 2 and all(w.proc.poll() is None for w in pool._all)
        pool.start()  # started once
        assert len(pool._all) == 2
        assert len(pool.decode([GENERATED["bmp"]] * 2, ImageSpec())) == 2


def test_pillows_png_text_limits_are_the_callers(pool: DecodePool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers raise PngImagePlugin.MAX_TEXT_CHUNK for PNGs with large text chunks: a worker decodes
    under the caller's limits, so an image is bad in both ways or in neither."""
    import io

    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * (3 << 20), zip=True)  # 3 MB of text, a few KB compressed
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 20, 30)).save(buf, "PNG", pnginfo=info)
    data, spec = buf.getvalue(), ImageSpec()
    assert isinstance(threads_way(data, spec), str)  # the default limit refuses it
    assert isinstance(pool.decode([data], spec)[0], BadImage)
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_CHUNK", 8 << 20)
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", 64 << 20)
    (frame, gh, gw) = pool.decode([data], spec)[0]
    want = threads_way(data, spec)
    np.testing.assert_array_equal(frame, want[0])


def test_workers_import_nothing_from_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` would put the current directory first on the worker's path: a numpy.py there
    would be the worker's numpy. The worker gets this process's path, nothing else."""
    (tmp_path / "numpy.py").write_text("raise ImportError('the numpy.py of the current directory')\n")
    monkeypatch.chdir(tmp_path)
    with closing(DecodePool(1)) as pool:
        (out,) = pool.decode([GENERATED["bmp"]], ImageSpec())
        np.testing.assert_array_equal(out[0], threads_way(GENERATED["bmp"], ImageSpec())[0])
        assert not os.get_inheritable(pool._all[0].fd)  # the slab goes to the worker alone, not to other children


def test_a_worker_that_cannot_start_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    repo = str(Path(__file__).resolve().parents[2])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p and p not in ("", repo)])
    with closing(DecodePool(1)) as pool:
        with pytest.raises(DecodeWorkerError, match=r"(?s)image decode worker process could not start .*"
                                                r"ModuleNotFoundError: No module named"):
            pool.decode([GENERATED["bmp"]], ImageSpec())


def test_a_forked_child_decodes_in_a_pool_of_its_own(pool: DecodePool) -> None:
    spec, image = ImageSpec(), GENERATED["rgba-png"]
    pool.decode([image], spec)  # the parent's workers are running
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool object, its own workers
        ok = False
        try:
            (out,) = pool.decode([image], spec)
            ok = bool(np.array_equal(out[0], threads_way(image, spec)[0]))
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read)
    (out,) = pool.decode([image], spec)  # the parent's pool is as it was
    np.testing.assert_array_equal(out[0], threads_way(image, spec)[0])


def test_a_vision_config_is_taken_as_its_image_spec(pool: DecodePool) -> None:
    (out,) = pool.decode([GENERATED["bmp"]], VisionConfig(patch_size=16))
    np.testing.assert_array_equal(out[0], threads_way(GENERATED["bmp"], ImageSpec(patch_size=16))[0])


def test_a_worker_imports_neither_torch_nor_the_event_loop() -> None:
    """What a worker imports before its first call is paid at every start (a fresh training job's
    first seconds): numpy, msgspec and Pillow, not torch, asyncio or anyio (asyncio was 40 ms)."""
    code = ("import sys, zephon_stream.vision.processes as p; p._pil(); "
            "print(sorted(m for m in ('torch', 'asyncio', 'anyio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"


def test_workers_that_died_while_idle_are_replaced_not_blamed_on_the_call() -> None:
    with closing(DecodePool(2)) as pool:
        pool.start()
        for worker in list(pool._all):
            worker.proc.kill()
            worker.proc.wait()
        (out,) = pool.decode([GENERATED["bmp"]], ImageSpec())  # both places: new workers, no failure
        np.testing.assert_array_equal(out[0], threads_way(GENERATED["bmp"], ImageSpec())[0])


def test_a_worker_killed_by_a_real_time_signal_is_named() -> None:
    with closing(DecodePool(1)) as pool:
        pool.start()
        (worker,) = pool._all
        worker.proc.send_signal(signal.SIGRTMIN + 1)  # no name: Signals() refuses the number
        worker.proc.wait()
        assert f"killed by signal {int(signal.SIGRTMIN) + 1}" in str(worker._died("during a call"))


def test_a_forked_child_lets_go_of_the_parents_workers() -> None:
    """A child holding copies of the workers' pipes kept them from ending: the parent's close waited
    5 s a worker (and a parent that died left them running while the child lived)."""
    pool = DecodePool(2)
    pool.decode([GENERATED["bmp"]] * 2, ImageSpec())
    from zephon_stream.vision import processes

    processes._POOL, before = pool, processes._POOL  # as the loader's pool
    try:
        pid = os.fork()
        if pid == 0:
            signal.pause()  # alive, as a DataLoader worker would be, while the parent closes (until killed)
            os._exit(0)
        start = time.monotonic()
        pool.close()
        assert time.monotonic() - start < 3
    finally:
        processes._POOL = before
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
