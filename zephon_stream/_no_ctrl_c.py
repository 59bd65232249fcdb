"""Imported first by the processes backend's fork server: it ignores SIGINT from here on.

Ctrl-C in a terminal signals the whole process group. The fork server ignores SIGINT once its
preloaded imports are done (`multiprocessing.forkserver.main`); one that took it while importing
them died, and the trainer's next worker start failed. Its workers inherit the setting.
Imported anywhere else (not under the fork server's `main`), it does nothing.
"""

import signal
import sys


def _in_fork_server() -> bool:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
