"""Image decoding in worker processes: `load_image` + `patch_frame` outside this process's GIL.

The loader's decode threads spend most of an image in Pillow's C code, without the GIL; but
Pillow's Python around that code, and the loader's own Python (event loop, tar parsing,
packing), take turns on one GIL. On the bench's 2 cores the decode threads kept the cores
about 90% busy, and the loader reached 0.85-0.88 of the Pillow work alone. With
`vision.decode_processes = N` each decode call goes to one of N worker processes instead:

```
decode thread ──request: spec, image bytes──▶ worker process: load_image + patch_frame
              ◀──reply: where each frame is──  writes the frames into its slab (shared memory)
copies the frames out of the slab (numpy, without the GIL); the worker is free for the next call
```

A worker takes one call at a time, and its slab is read before it gets the next one, so
nothing in the slab is ever overwritten while in use. A slab is an anonymous file (Linux's
memfd; an unlinked temporary file elsewhere) that this process creates and hands to the
worker as an open descriptor: nothing has a name to leak, and the memory goes with the last
process that maps it. Its size is `decode_batch * max_pixels * 3` bytes, the most one call's
frames can take; it only takes memory where a call wrote (the largest call so far).

Workers are started (not forked) as `python -I -c <boot> <fd> <sys.path>`: this process's
interpreter and module path exactly (not the current directory on top of it, as `python -m`
would put it; nor PYTHONPATH again), and the user's script is not imported again, so no
`if __name__ == "__main__":` guard is needed. They start when the
lanes do, in a session of their own (a Ctrl-C to the terminal is the trainer's to handle), and
say they are ready, or why they could not start, in their first message. One pool serves the
process, grown to the largest `decode_processes` asked for; each Loader's calls take at most
its own number of workers at once. A worker exits when this process closes its pipe, and so
when this process ends in any way. A worker that dies (killed, out of memory) is replaced and
its call is made again on the new one (decoding is a pure function of the bytes); a second
death fails the call. A child forked from this process makes a pool of its own.

The frames are the same bytes as on threads (the same functions, and Pillow's process-wide
PNG text limits sent with each call), so the setting changes no batch:
tests/core/test_decode_processes.py runs the loader both ways, across resumes.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import IO

import msgspec
import numpy as np

from zephon_stream.errors import DecodeWorkerError
from zephon_stream.vision.image import (
    BadImage,
    ImageSpec,
    _pil,
    check_pillow_settings,
    load_image,
    patch_frame,
    png_text_limits,
    use_png_text_limits,
)

__all__ = ["DecodePool", "close_pool", "decode_pool"]

_LEN = struct.Struct("<Q")
# The worker's first lines: the parent's module path, then this module (never the current directory: -I);
# a failed import is its first message, so that the parent can say why.
_BOOT = """# zephon_stream.vision.processes: an image decode worker
import sys, json
sys.path[:] = json.loads(sys.argv[2])
try:
    from zephon_stream.vision.processes import main
except BaseException:
    import struct, traceback
    why = traceback.format_exc().encode()
    sys.stdout.buffer.write(struct.pack("<Q", len(why)) + why)
    raise
main()
"""


class _Request(msgspec.Struct, array_like=True):
    slab_size: int  # the worker maps this many bytes of its slab (grown when a call may need more)
    spec: ImageSpec
    images: list[bytes]
    png_text: tuple[int, int]  # Pillow's PNG text limits in the calling process (MAX_TEXT_CHUNK, MAX_TEXT_MEMORY)


class _Reply(msgspec.Struct, array_like=True):
    frames: list[tuple[int, int, int, int] | str]  # (offset, rows, grid_h, grid_w), or a BadImage's text
    error: str = ""  # what went wrong in the worker outside a BadImage (a bug): the call fails with it


def _send(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(_LEN.pack(len(data)))
    pipe.write(data)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> bytes | None:
    """One message, or None where the pipe ended (before or inside a message)."""
    head = pipe.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    data = pipe.read(_LEN.unpack(head)[0])
    return data if len(data) == _LEN.unpack(head)[0] else None


def _slab_file() -> int:
    """An open descriptor (not inherited by other children) of a new, empty anonymous file for a slab."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("zephon-decode-slab", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as handle:  # unlinked at once on POSIX: no name to leak
        return os.dup(handle.fileno())  # (dup: not inheritable)


class _WorkerDied(RuntimeError):
    pass


_SHUT_DOWN = "the image decode processes were shut down (DecodePool.close)"


class _Worker:
    """One worker process, its pipes and its slab (this process's end of it)."""

    def __init__(self) -> None:
        if not sys.executable:
            raise DecodeWorkerError("vision.decode_processes starts Python worker processes, but this interpreter does "
                                    "not know its executable (sys.executable is empty, as when Python is embedded): "
                                    "set vision.decode_processes = 0")
        self.fd = _slab_file()
        self.command = [sys.executable, "-I", "-c", _BOOT, str(self.fd), json.dumps(sys.path)]
        try:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         pass_fds=(self.fd,), start_new_session=True)
        except BaseException:
            os.close(self.fd)
            raise
        self.size, self.map = 0, None
        self.ready = False  # its first message, "ready" or why it could not start, read with the first call
        self.in_step = True  # False from a request's send until its whole reply is read
        self.closed = False

    def call(self, spec: ImageSpec, images: list[bytes], need: int) -> list[tuple[np.ndarray, int, int] | BadImage]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self.ready:
            self._started()
        if need > self.size:  # the file grows first; the worker maps the new size with this request
            os.ftruncate(self.fd, need)
            if self.map is not None:
                self.map.close()
            self.map, self.size = mmap.mmap(self.fd, need, prot=mmap.PROT_READ), need
        self.in_step = False  # an interruption from here on (a KeyboardInterrupt) leaves a reply unread
        try:
            _send(self.proc.stdin, msgspec.msgpack.encode(_Request(self.size, spec, images, png_text_limits())))
            raw = _receive(self.proc.stdout)
        except (OSError, ValueError):  # a broken or closed pipe
            raw = None
        self.in_step = raw is not None
        if raw is None:
            raise self._died("during a call")
        reply = msgspec.msgpack.decode(raw, type=_Reply)
        if reply.error:
            raise DecodeWorkerError(f"an image decode worker process failed: {reply.error}")
        p2 = spec.patch_size ** 2
        out: list[tuple[np.ndarray, int, int] | BadImage] = []
        for frame in reply.frames:
            if isinstance(frame, str):
                out.append(BadImage(frame))
                continue
            at, rows, grid_h, grid_w = frame
            view = np.frombuffer(self.map, np.uint8, count=rows * 3 * p2, offset=at)
            out.append((view.reshape(rows, 3, p2).copy(), grid_h, grid_w))  # out of the slab before its next call
            del view  # no export of the map outlives the call (it is closed when it grows)
        return out

    def _started(self) -> None:
        assert self.proc.stdout is not None
        try:
            raw = _receive(self.proc.stdout)
        except (OSError, ValueError):
            raw = None
        if raw is None:  # ended without a word: killed, as one can be at any time
            raise self._died("as it started")
        if raw != b"ready":
            self.close()
            raise DecodeWorkerError(f"an image decode worker process could not start ({sys.executable} -I -c "
                                    f"<zephon_stream.vision.processes' worker>): {raw.decode(errors='replace')}")
        self.ready = True

    def _died(self, when: str) -> _WorkerDied:
        try:
            code = self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            try:
                how = f", killed by {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal: a number without a name
                how = f", killed by signal {-code}"
        else:
            how = f", exit code {code}" if code is not None else ""
        return _WorkerDied(f"an image decode worker process (pid {self.proc.pid}) ended {when}{how}")

    def close(self) -> None:
        """End the worker and free this process's end of it; again, nothing."""
        if self.closed:
            return
        self.closed = True
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()  # the worker's end of input: it exits
            except (OSError, ValueError):
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view still open somewhere: the mapping goes with it
                pass
        os.close(self.fd)


class DecodePool:
    """`workers` decode processes; `decode` runs one call on an idle one (threads wait for one).

    `decode(..., at_once=sem)` waits for `sem` first: a Loader's own bound on its calls at once."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = 0
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self.grow(workers)

    def __repr__(self) -> str:
        return f"DecodePool(workers={self.workers})"

    def grow(self, workers: int) -> None:
        """At least `workers` places (each starts its worker when first used, or with `start`)."""
        with self._lock:
            for _ in range(workers - self.workers):
                self._idle.put(None)
            self.workers = max(self.workers, workers)

    def decode(self, images: list[bytes], spec: ImageSpec,
               at_once: threading.Semaphore | None = None) -> list[tuple[np.ndarray, int, int] | BadImage]:
        """Each image as `(patch_frame(load_image(data)), grid_h, grid_w)`, or the BadImage it raised."""
        if os.getpid() != self._pid:  # a forked child: this process's own pool, never the parent's workers
            return decode_pool(self.workers).decode(images, spec, at_once)
        if not images:
            return []
        check_pillow_settings()  # refused here as on threads (a worker never has the setting)
        if type(spec) is not ImageSpec:  # (a VisionConfig: its sizing settings alone)
            spec = ImageSpec(**{f: getattr(spec, f) for f in ImageSpec.__struct_fields__})
        if at_once is None:
            return self._decode(images, spec)
        with at_once:
            return self._decode(images, spec)

    def _decode(self, images: list[bytes], spec: ImageSpec) -> list[tuple[np.ndarray, int, int] | BadImage]:
        for attempt in (0, 1):  # a worker that dies is replaced, and its call made again once
            worker = self._idle.get()
            try:
                if self._closed:
                    raise DecodeWorkerError(_SHUT_DOWN)
                if worker is not None and worker.proc.poll() is not None:  # died while idle: not this call's
                    self._forget(worker)
                    worker = None
                if worker is None:
                    worker = self._start()
                return worker.call(spec, images, len(images) * spec.max_pixels * 3)
            except _WorkerDied as exc:
                self._forget(worker)
                worker = None
                if attempt:
                    raise DecodeWorkerError(f"{exc}, and so did the worker that took its call again (the kernel's "
                                            "log says whether it was killed for memory)") from None
            except BaseException:
                if worker is not None and (not worker.in_step or worker.closed or worker.proc.poll() is not None):
                    self._forget(worker)  # dead, or a reply left unread: its place takes a new one
                    worker = None
                raise
            finally:
                self._idle.put(worker)
        raise AssertionError("unreachable")

    def start(self) -> None:
        """Start the workers not started yet, without waiting for them: they import Pillow while
        the caller does other work (a Loader plans its data), not in its first decode call."""
        taken = []
        try:
            while True:
                taken.append(self._idle.get_nowait())
        except queue.Empty:
            pass
        try:
            for i, worker in enumerate(taken):
                if worker is None:
                    taken[i] = self._start()
        finally:
            for worker in taken:
                self._idle.put(worker)

    def _start(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise DecodeWorkerError(_SHUT_DOWN)
            worker = _Worker()
            self._all.append(worker)
            return worker

    def _forget(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        worker.close()

    def close(self) -> None:
        """End every worker (they also end when this process does). Calls after it fail."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            worker.close()


_POOL: DecodePool | None = None
_POOL_LOCK = threading.Lock()


def decode_pool(workers: int) -> DecodePool:
    """The process's decode pool, with at least `workers` workers (shared by every Loader)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._pid != os.getpid() or _POOL._closed:
            _POOL = DecodePool(workers)  # (a forked child's own: the parent's is left as it is, unused)
        else:
            _POOL.grow(workers)
        return _POOL


def _after_fork_in_child() -> None:
    """A forked child holds copies of the parent's pipes to its workers and of their slabs: a worker
    would see no end of input until the child ended too (the parent's close waited 5 s a worker,
    and a parent that died left its workers running). The child lets go of them, without a word to
    the workers (its copies of the pipes go to /dev/null, so nothing it flushes reaches them), and
    makes a pool of its own when it needs one."""
    global _POOL, _POOL_LOCK
    pool, _POOL, _POOL_LOCK = _POOL, None, threading.Lock()
    if pool is None:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for worker in pool._all:
            worker.closed = True  # nothing in the child closes or waits for it
            for pipe in (worker.proc.stdin, worker.proc.stdout):
                if pipe is not None and not pipe.closed:
                    os.dup2(null, pipe.fileno())
            os.dup2(null, worker.fd)
            if worker.map is not None:
                try:
                    worker.map.close()
                except BufferError:
                    pass
                worker.map = None
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_after_fork_in_child)


def close_pool() -> None:
    """End the process's decode pool, if it has one (the Loader's exit handler calls it once the
    iterations still open are closed; the workers would end with this process anyway)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None and pool._pid == os.getpid():
        pool.close()


# ------------------------------------------------------------------------------- the worker


def _serve(fd: int, requests: IO[bytes], replies: IO[bytes]) -> None:
    slab, size = None, 0
    decode = msgspec.msgpack.Decoder(_Request)
    while (raw := _receive(requests)) is not None:
        try:
            req = decode.decode(raw)
            use_png_text_limits(req.png_text)  # as in the caller
            if req.slab_size != size:
                if slab is not None:
                    slab.close()
                slab, size = mmap.mmap(fd, req.slab_size), req.slab_size
            assert slab is not None
            frames: list[tuple[int, int, int, int] | str] = []
            at = 0
            for data in req.images:
                try:
                    image = load_image(data, req.spec)
                except BadImage as exc:
                    frames.append(str(exc))
                    continue
                p = req.spec.patch_size
                grid_h, grid_w = image.shape[0] // p, image.shape[1] // p
                rows = grid_h * grid_w
                out = np.frombuffer(slab, np.uint8, count=rows * 3 * p * p, offset=at).reshape(rows, 3, p * p)
                patch_frame(image, req.spec, out)  # gathered into the slab: no copy of its own
                del out  # (the slab is closed when it grows: no view may outlive the call)
                frames.append((at, rows, grid_h, grid_w))
                at += rows * 3 * p * p
            reply = _Reply(frames)
        except Exception as exc:  # a bug, not bad data: the call fails with it
            reply = _Reply([], f"{type(exc).__name__}: {exc}")
        _send(replies, msgspec.msgpack.encode(reply))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's
    replies = sys.stdout.buffer
    try:
        fd = int(sys.argv[1])
        _pil()  # Pillow and its plugins, before the first call
    except BaseException:
        _send(replies, traceback.format_exc().encode())
        raise SystemExit(1) from None
    _send(replies, b"ready")
    _serve(fd, sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
