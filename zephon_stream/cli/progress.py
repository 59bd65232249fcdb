"""Progress of a batch stream on stderr: a tqdm bar on a terminal, plain lines anywhere else.

On a terminal tqdm draws one live bar: the step, `--steps` as the total, the elapsed time,
an ETA and the recent rate. Anywhere else (a log file, a pipe, CI) nothing is redrawn and
no `\\r` is written: one line every `every` seconds and one at the end, for example (one line,
wrapped here)

    step 120/400 (30%)  elapsed 00:12  eta 00:28  1.32M tok/s (last 10 s)  tokens 1.57M
        prefetch 94% (loader ahead)  skipped 0

`tok/s` is the rate over the last `window` seconds, not since the start: start-up (listing
the sources, filling the lanes) would hide the steady rate for minutes. `prefetch` is how full
the lanes' sample buffers are: near 100% the loader is ahead of whoever consumes the batches
(the trainer is the bottleneck, as it should be); near 0% the consumer waits for data.

The wait for the first batch has a display of its own (`waiting for the first batch`, with a
clock on a terminal), since planning the sources and filling every lane can take a while.

tqdm is an optional dependency (`pip install zephon-stream[progress]`); without it a terminal
gets the plain lines too.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

try:
    from tqdm import tqdm
except ImportError:  # the `progress` extra is not installed: plain lines everywhere
    tqdm = None

__all__ = ["RecentRate", "StreamProgress", "prefetch_text"]

T = TypeVar("T")


class RecentRate:
    """Tokens per second over the last `window` seconds of `(time, total tokens)` observations."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self.points: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, total: int) -> None:
        self.points.append((now, total))
        # keep one point at or beyond the window's start, so the rate always spans a full window
        while len(self.points) > 2 and self.points[1][0] <= now - self.window:
            self.points.popleft()

    def rate(self) -> float | None:
        """None until two observations are apart in time."""
        if len(self.points) < 2 or self.points[-1][0] <= self.points[0][0]:
            return None
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        return (n1 - n0) / (t1 - t0)


def prefetch_text(buffered: int, capacity: int) -> str:
    """How full the lanes' buffers are, in words a user can act on."""
    if capacity <= 0:
        return "prefetch -"
    share = min(buffered / capacity, 1.0)
    note = " (loader ahead)" if share >= 0.75 else " (waiting on data)" if share <= 0.1 else ""
    return f"prefetch {share:.0%}{note}"


class StreamProgress:
    """Progress of a stream of batches (`statistics()` gives the loader's `LoaderStatistics`).

    ```
    progress = StreamProgress(loader.statistics, total=steps, start=loader.step)
    for batch in progress.track(loader):
        ...
    progress.close()
    ```
    `total` is the global step the run stops at (None: until the data ends); `start` the step it
    starts from (a resumed run), so the ETA counts only the steps still to go.
    """

    def __init__(self, statistics: Callable[[], Any], *, total: int | None = None, start: int = 0,
                 file: TextIO | None = None, tty: bool | None = None, every: float = 5.0, window: float = 10.0,
                 wait_delay: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.statistics, self.total, self.start = statistics, total, start
        self.file = file if file is not None else sys.stderr
        self.tty = (self.file.isatty() if tty is None else tty) and tqdm is not None  # a live bar needs tqdm
        self.every, self.wait_delay, self.clock = every, wait_delay, clock
        self.recent = RecentRate(window)
        self.started = self.t0 = self.last_line = clock()
        self.first_step: int | None = None  # the step after the first batch, when it came (at t0)
        self.bar: Any = None  # the tqdm bar, once drawn
        self.last: Any = None  # the statistics at the last batch
        self.closed = False
        self.ended = False  # the data ended (max_epochs): the last line waits on no prefetch

    def track(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield `batches`, showing the wait for the first one, then updating after each."""
        it = iter(batches)
        try:
            first = self.wait_first(it)
        except StopIteration:
            return
        self.update()
        yield first
        for batch in it:
            self.update()
            yield batch

    def wait_first(self, it: Iterator[T]) -> T:
        """`next(it)`; if that takes over `wait_delay` seconds, a display says what it waits for
        (the loader lists its sources and fills its lanes) and then how long it took."""
        t0 = self.clock()
        waiting = _Waiting(self.file, self.tty, "waiting for the first batch (listing the sources, filling the lanes)")
        try:
            first = _next_ticking(it, waiting.tick, self.wait_delay)
        finally:
            waiting.close()
        if waiting.shown:
            self._write(f"first batch after {self.clock() - t0:.1f} s")
        self.t0 = self.last_line = self.clock()
        self.first_step = self.statistics().step
        return first

    def update(self) -> None:
        """Record the batch just received; redraw the bar, or write a line every `every` seconds."""
        st = self.last = self.statistics()
        now = self.clock()
        self.recent.add(now, st.tokens)
        if self.tty:
            self._draw(st)
        elif now - self.last_line >= self.every:
            self.last_line = now
            self._write(self.line(st, now))

    def close(self, data_ended: bool = False) -> None:
        """The final line (or the bar's final state), after the last batch of the data when
        `data_ended` (it then says so, where the buffers' state would say it waits on data).
        Safe to call twice."""
        if self.closed:
            return
        self.closed, self.ended = True, data_ended
        st = self.last if self.last is not None else self.statistics()  # as of the last batch: the stream may be shut
        if self.bar is not None:
            self._draw(st)
            self.bar.close()
        else:
            self._write(self.line(st, self.clock()))

    def line(self, st: Any, now: float) -> str:
        """One plain progress line for the statistics `st` at time `now`."""
        parts = [f"step {st.step}"]
        if self.total is not None:
            parts = [f"step {st.step}/{self.total} ({st.step / max(self.total, 1):.0%})"]
        parts.append(f"elapsed {_interval(now - self.started)}")
        eta = self._eta(st.step, now)
        if eta is not None:
            parts.append(f"eta {_interval(eta)}")
        parts += [self._rate_text(), f"tokens {_amount(st.tokens)}", self._tail(st)]
        return "  ".join(parts)

    def _eta(self, step: int, now: float) -> float | None:
        """Seconds to `total` at the step rate since the first batch (start-up excluded)."""
        if self.total is None or self.first_step is None or step >= self.total:
            return None
        done = step - self.first_step
        return (self.total - step) * (now - self.t0) / done if done > 0 else None

    def _rate_text(self) -> str:
        rate = self.recent.rate()
        span = f"last {self.recent.window:g} s"
        return f"{_amount(rate)} tok/s ({span})" if rate is not None else f"- tok/s ({span})"

    def _tail(self, st: Any) -> str:
        return (f"{'data ended' if self.ended else prefetch_text(st.buffered_batches, st.buffer_capacity)}  "
                f"skipped {st.skipped_records + st.skipped_shards}"
                + (f"  restarts {st.worker_restarts}" if st.worker_restarts else ""))  # lane workers that died

    def _draw(self, st: Any) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total, initial=self.start, desc="stream", unit="step", file=self.file,
                            dynamic_ncols=True, mininterval=0.2)
        self.bar.set_postfix_str(f"{self._rate_text()}, {self._tail(st)}", refresh=False)
        self.bar.update(st.step - self.bar.n)

    def _write(self, text: str) -> None:
        if self.tty:
            tqdm.write(text, file=self.file)
        else:
            self.file.write(text + "\n")
            self.file.flush()


def _amount(n: float) -> str:
    """1.32M, 14.6k, 29: three significant digits, and a small count stays a whole number."""
    if n < 1000:
        return f"{n:.0f}"
    units = iter("kMGT")
    unit = next(units)
    n /= 1000
    while n >= 999.5 and unit != "T":
        n, unit = n / 1000, next(units)
    digits = 0 if n >= 99.95 else 1 if n >= 9.995 else 2
    return f"{n:.{digits}f}{unit}"


def _interval(seconds: float) -> str:
    """00:05, 12:34, 1:02:03 (as tqdm writes times)."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class _Waiting:
    """The display of a wait: a tqdm clock on a terminal, one plain line elsewhere."""

    def __init__(self, file: TextIO, tty: bool, what: str) -> None:
        self.file, self.tty, self.what = file, tty, what
        self.bar: Any = None
        self.shown = False

    def tick(self) -> None:
        if self.tty and self.bar is None:
            self.bar = tqdm(desc=self.what, bar_format="{desc}: {elapsed}", file=self.file, leave=False)
        elif self.tty:
            self.bar.refresh()
        elif not self.shown:
            self.file.write(f"{self.what} ...\n")
            self.file.flush()
        self.shown = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _next_ticking(it: Iterator[T], tick: Callable[[], object], delay: float, interval: float = 0.2) -> T:
    """`next(it)` on this thread (so Ctrl-C still stops it), while a helper thread calls `tick`
    after `delay` seconds and then every `interval` seconds, until it returns."""
    done = threading.Event()

    def ticker() -> None:
        wait = delay
        while not done.wait(wait):
            tick()
            wait = interval

    thread = threading.Thread(target=ticker, name="zephon-progress-clock", daemon=True)
    thread.start()
    try:
        return next(it)
    finally:
        done.set()
        thread.join()
