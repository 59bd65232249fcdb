"""A lock that a forked child finds free.

A lock that another thread holds at a fork stays held in the child, where no thread will release
it: multiprocessing's default start on Linux forks a trainer with the loader's threads running.
Module-level locks are `ForkLock`s, renewed in every forked child. Imports only os and threading:
image decode workers import it.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["ForkLock"]


class ForkLock:
    """A `threading.Lock` (acquire, release, `with`) that is new, and so free, in a forked child."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _ALL.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> ForkLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


_ALL: weakref.WeakSet[ForkLock] = weakref.WeakSet()


def _renew_in_child() -> None:
    for lock in list(_ALL):
        lock._lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_in_child)
