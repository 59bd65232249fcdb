"""A second Python process for the independent runs of one test, so that they use both cores.

A test that makes several runs which do not depend on one another (the epochs-to-the-end case of
the determinism matrix makes seven, about ten CPU-seconds) submits some of them here and makes
the others itself meanwhile; its assertions stay where they were, on the results. The process
is spawned once per session (the `offload` fixture of tests/conftest.py), imports the package
once, and turns warnings into errors as pytest does. A job is a module-level function of
picklable arguments (configs, states, records), so nothing in it can depend on a monkeypatch.
"""

from __future__ import annotations

import multiprocessing
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable

#: A job waits at most this long for its result: below pytest's 300 s per-test timeout, so a
#: stuck child fails the test with a clear TimeoutError instead of a killed session.
JOB_TIMEOUT_S = 240


def _start() -> None:
    warnings.simplefilter("error")  # pyproject's filterwarnings = ["error"], in the child too
    import zephon_stream.testing.determinism  # noqa: F401  (the package's import, paid once, at start)


class Offload:
    """`submit(fn, *args)` runs `fn(*args)` in the session's second process; `result(future)`
    waits for it (JOB_TIMEOUT_S at most) and re-raises what the job raised."""

    def __init__(self) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._pool.submit(fn, *args)

    @staticmethod
    def result(future: Future[Any]) -> Any:
        return future.result(timeout=JOB_TIMEOUT_S)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
