"""Ctrl-C held over a few statements that must run whole in the main thread."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ctrl_c_after"]


@contextmanager
def ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block has run, then deliver it as it would have come.

    Python raises KeyboardInterrupt between any two bytecodes of the main thread: inside a write
    whose bytes had gone out, between a batch handed out and the step noted, or in the middle of
    handing a call to the loader's event-loop thread. The main thread's handler only; in another
    thread (where no signal handler runs), or under a handler set outside Python, the block runs
    as it is.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # None: a handler set outside Python (an embedding host), which this could not put back
        return
    held: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if not held or previous == signal.SIG_IGN:
        return
    if previous is signal.default_int_handler:
        raise KeyboardInterrupt
    if callable(previous):
        previous(signal.SIGINT, held[0])
    else:  # SIG_DFL: the signal as it would have come
        signal.raise_signal(signal.SIGINT)
