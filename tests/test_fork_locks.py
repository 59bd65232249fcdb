"""Module locks that another thread holds at a fork are free in the child: there, no thread would
ever release them (multiprocessing's default start on Linux forks a trainer with the loader's
threads running)."""

from __future__ import annotations

import importlib
import os

import pytest


@pytest.mark.parametrize("module, name", [
    ("zephon_stream.operators.tokenize", "_SHARED_LOCK"),  # Tokenize.shared: a Loader there would wait for ever
    ("zephon_stream.vision.image", "_pillow_limit_lock"),  # Pillow's bomb limit: so would its first image
    ("zephon_stream.engine.memory", "_trimming"),  # malloc_trim: it would never trim
])
def test_a_lock_held_at_a_fork_is_free_in_the_child(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    with getattr(mod, name):  # as a thread of the parent holds it at the fork
        pid = os.fork()
        if pid == 0:
            os._exit(0 if getattr(mod, name).acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
