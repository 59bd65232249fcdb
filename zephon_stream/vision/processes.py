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

Workers run `python -m zephon_stream.vision.processes`, started on first use and shared by
every Loader of the process (one pool per size): nothing is forked from a process that holds
threads, and the user's script is not imported again, so no `if __name__ == "__main__":`
guard is needed. A worker exits when this process closes its pipe, and so when this process
ends in any way. It ignores SIGINT: a Ctrl-C is the trainer's to handle. A worker that dies
(killed, out of memory) fails the call it had with a RuntimeError; the next call starts a
new one. The frames are the same bytes as on threads (the same functions), so the setting
changes no batch: tests/core/test_determinism.py runs image configs both ways.
"""

from __future__ import annotations

import atexit
import mmap
import os
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

import msgspec
import numpy as np

from zephon_stream.vision.image import BadImage, ImageSpec, _pil, check_pillow_settings, load_image, patch_frame

__all__ = ["DecodePool", "decode_pool"]

_LEN = struct.Struct("<Q")


class _Request(msgspec.Struct, array_like=True):
    slab_size: int  # the worker maps this many bytes of its slab (grown when a call may need more)
    spec: ImageSpec
    images: list[bytes]


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
    """An open descriptor of a new, empty anonymous file for a slab."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("zephon-decode-slab", os.MFD_CLOEXEC)
    handle = tempfile.TemporaryFile()  # unlinked at once on POSIX: no name to leak
    fd = os.dup(handle.fileno())
    handle.close()
    return fd


class _Worker:
    """One worker process, its pipes and its slab (this process's end of it)."""

    def __init__(self) -> None:
        self.fd = _slab_file()
        os.set_inheritable(self.fd, True)
        package = str(Path(__file__).resolve().parents[2])  # where `zephon_stream` is, for a path set at run time
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zephon_stream.vision.processes", str(self.fd)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, pass_fds=(self.fd,), env=env, close_fds=True)
        self.size, self.map = 0, None
        self.in_step = True  # False from a request's send until its whole reply is read

    def call(self, spec: ImageSpec, images: list[bytes], need: int) -> list[tuple[np.ndarray, int, int] | BadImage]:
        if need > self.size:  # the file grows first; the worker maps the new size with this request
            os.ftruncate(self.fd, need)
            if self.map is not None:
                self.map.close()
            self.map, self.size = mmap.mmap(self.fd, need, prot=mmap.PROT_READ), need
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.in_step = False  # an interruption from here on (a KeyboardInterrupt) leaves a reply unread
        try:
            _send(self.proc.stdin, msgspec.msgpack.encode(_Request(self.size, spec, images)))
            raw = _receive(self.proc.stdout)
        except (BrokenPipeError, OSError):
            raw = None
        self.in_step = raw is not None
        if raw is None:
            code = self.proc.poll()
            raise RuntimeError(f"an image decode worker process (pid {self.proc.pid}) ended during a call"
                               + (f", exit code {code}" if code is not None else "")
                               + ": see its output above; a new one starts with the next call")
        reply = msgspec.msgpack.decode(raw, type=_Reply)
        if reply.error:
            raise RuntimeError(f"an image decode worker process failed: {reply.error}")
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

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the worker's end of input: it exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.map is not None:
            self.map.close()
        os.close(self.fd)


class DecodePool:
    """`workers` decode processes; `decode` runs one call on an idle one (threads wait for one)."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # a worker starts when a call first takes its place
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"DecodePool(workers={self.workers})"

    def decode(self, images: list[bytes], spec: ImageSpec) -> list[tuple[np.ndarray, int, int] | BadImage]:
        """Each image as `(patch_frame(load_image(data)), grid_h, grid_w)`, or the BadImage it raised."""
        if not images:
            return []
        check_pillow_settings()  # refused here as on threads (a worker never has the setting)
        worker = self._idle.get()
        try:
            if worker is None:
                worker = self._start()
            out = worker.call(spec, images, len(images) * spec.max_pixels * 3)
        except BaseException:
            if worker is not None and (not worker.in_step or worker.proc.poll() is not None):
                self._forget(worker)  # dead, or a reply left unread: its place takes a new one
                worker = None
            self._idle.put(worker)
            raise
        self._idle.put(worker)
        return out

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
            taken = [w if w is not None else self._start() for w in taken]
        finally:
            for w in taken:
                self._idle.put(w)

    def _start(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the image decode processes were shut down (the interpreter is exiting)")
            worker = _Worker()
            self._all.append(worker)
            return worker

    def _forget(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        worker.close()

    def close(self) -> None:
        """End every worker (they also end when this process does)."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            worker.close()


_POOLS: dict[int, DecodePool] = {}
_POOLS_LOCK = threading.Lock()


def decode_pool(workers: int) -> DecodePool:
    """The process's pool of `workers` decode processes, shared by every Loader that asks for as many."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = DecodePool(workers)
        return pool


@atexit.register
def _close_pools() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


# ------------------------------------------------------------------------------- the worker


def _serve(fd: int, requests: IO[bytes], replies: IO[bytes]) -> None:
    slab, size = None, 0
    decode = msgspec.msgpack.Decoder(_Request)
    while (raw := _receive(requests)) is not None:
        try:
            req = decode.decode(raw)
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
    _pil()  # Pillow and its plugins, before the first call
    _serve(int(sys.argv[1]), sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
