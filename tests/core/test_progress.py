"""Progress output: a recent rate (start-up excluded), a total, elapsed and an ETA, words for the
buffers, plain lines off a terminal, a tqdm bar on one, and a display for the first batch's wait."""

from __future__ import annotations

import io
import logging
import shutil
import threading
from collections.abc import Iterator

import pytest

from tools import corpus
from zephon_stream.cli.progress import RecentRate, StreamProgress, prefetch_text
from zephon_stream.loader.loader import LoaderStatistics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stats:
    """A loader's statistics, driven by the test: `step` batches of `per_step` tokens."""

    def __init__(self, per_step: int = 1000) -> None:
        self.step, self.per_step, self.buffered = 0, per_step, 40

    def __call__(self) -> LoaderStatistics:
        return LoaderStatistics(step=self.step, samples=self.step * 8, tokens=self.step * self.per_step,
                                skipped_records=1, skipped_by_epoch={0: 1}, skipped_shards=0,
                                buffered_batches=self.buffered,
                                peak_buffered_batches=48, buffer_capacity=48, store_requests=0, store_retries=0,
                                store_bytes_read=0)


def test_recent_rate_forgets_the_start_up() -> None:
    rate = RecentRate(window=10.0)
    rate.add(0.0, 0)
    rate.add(30.0, 1000)  # a slow start: 33 tok/s
    for t in range(31, 61):  # then 1M tok/s for 30 s
        rate.add(float(t), 1000 + (t - 30) * 1_000_000)
    assert rate.rate() == 1_000_000.0  # an average since t=0 would say ~500k


def test_recent_rate_needs_two_points_apart() -> None:
    rate = RecentRate()
    assert rate.rate() is None
    rate.add(1.0, 10)
    rate.add(1.0, 20)
    assert rate.rate() is None


def test_prefetch_in_words() -> None:
    assert prefetch_text(48, 48) == "prefetch 100% (loader ahead)"
    assert prefetch_text(1, 48) == "prefetch 2% (waiting on data)"
    assert prefetch_text(24, 48) == "prefetch 50%"
    assert prefetch_text(49, 48) == "prefetch 100% (loader ahead)"  # the batch in hand can exceed the capacity


def _batches(stats: Stats, clock: Clock, steps: int, dt: float, start: int = 0) -> Iterator[int]:
    """Batches as a loader hands them out: each takes `dt` seconds, and the statistics count it
    before the consumer sees it."""
    for i in range(start, start + steps):
        clock.now += dt
        stats.step = i + 1
        yield i


def _run(progress: StreamProgress, stats: Stats, clock: Clock, steps: int, dt: float) -> list[int]:
    out = list(progress.track(_batches(stats, clock, steps, dt)))
    progress.close()
    return out


def test_plain_lines_off_a_terminal_with_total_elapsed_and_eta() -> None:
    clock, stats, file = Clock(), Stats(), io.StringIO()
    progress = StreamProgress(stats, total=100, file=file, tty=False, every=5.0, clock=clock)
    assert _run(progress, stats, clock, 40, 0.5) == list(range(40))
    text = file.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert 3 <= len(lines) <= 6, lines  # one every 5 s of a 20 s run, and the last
    assert lines[0].startswith("step 11/100 (11%)  elapsed 00:05  eta 00:44  2.00k tok/s (last 10 s)"), lines[0]
    assert lines[-1] == ("step 40/100 (40%)  elapsed 00:20  eta 00:30  2.00k tok/s (last 10 s)  tokens 40.0k  "
                         "prefetch 83% (loader ahead)  skipped 1")


def test_without_steps_there_is_no_total_or_eta() -> None:
    clock, stats, file = Clock(), Stats(), io.StringIO()
    _run(StreamProgress(stats, file=file, tty=False, clock=clock), stats, clock, 3, 1.0)
    assert file.getvalue().startswith("step 3  elapsed 00:03  1.00k tok/s")


def test_the_last_line_after_the_data_ended_says_so_not_waiting_on_data(config, tmp_path, capsys) -> None:
    # the buffers are empty once the lanes end: the last line said "prefetch 0% (waiting on data)"
    from zephon_stream.cli.main import main

    path = tmp_path / "c.toml"
    path.write_text(config.replace(max_epochs=1).to_toml())
    assert main(["stream", str(path)]) == 0
    assert capsys.readouterr().err.splitlines()[-1].endswith("  data ended  skipped 0")
    assert main(["stream", str(path), "--steps", "2"]) == 0  # stopped at the step asked for: the buffers' state
    assert "  prefetch " in capsys.readouterr().err.splitlines()[-1]


def test_eta_of_a_resumed_run_counts_the_steps_to_go_at_the_rate_after_start_up() -> None:
    clock, stats, file = Clock(), Stats(), io.StringIO()
    progress = StreamProgress(stats, total=520, start=500, file=file, tty=False, every=1e9, clock=clock)
    clock.now = 99.0  # a slow start: the first batch comes at t=100
    for batch in progress.track(_batches(stats, clock, 20, 1.0, start=500)):
        if batch == 509:
            break
    # 9 steps in the 9 s since the first batch, 10 to go; elapsed counts the start-up
    assert progress.line(stats(), clock.now).split("  ")[:3] == ["step 510/520 (98%)", "elapsed 01:49", "eta 00:10"]


class _Notify(io.StringIO):
    """A file that sets an event when some text is written to it."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle, self.seen = needle, threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.needle in self.getvalue():
            self.seen.set()
        return n


def _slow_first(seen: threading.Event, stats: Stats, clock: Clock) -> Iterator[int]:
    """The first batch comes only once the waiting display has been shown."""
    assert seen.wait(30), "the wait for the first batch was never shown"
    yield from _batches(stats, clock, 2, 1.0)


def test_the_first_batch_wait_is_shown_off_a_terminal() -> None:
    clock, stats = Clock(), Stats()
    file = _Notify("waiting for the first batch")
    progress = StreamProgress(stats, total=2, file=file, tty=False, clock=clock, wait_delay=0.0)
    assert list(progress.track(_slow_first(file.seen, stats, clock))) == [0, 1]
    lines = file.getvalue().splitlines()
    assert lines[0] == "waiting for the first batch (listing the sources, filling the lanes) ..."
    assert lines[1].startswith("first batch after ")


def test_a_quick_first_batch_prints_nothing_about_waiting() -> None:
    clock, stats, file = Clock(), Stats(), io.StringIO()
    progress = StreamProgress(stats, total=2, file=file, tty=False, clock=clock, wait_delay=60.0)
    list(progress.track(_batches(stats, clock, 2, 1.0)))
    assert "waiting" not in file.getvalue() and "first batch" not in file.getvalue()


def test_on_a_terminal_a_tqdm_bar_with_total_eta_and_the_recent_rate() -> None:
    clock, stats = Clock(), Stats()
    file = _Notify("waiting for the first batch")
    progress = StreamProgress(stats, total=50, file=file, tty=True, clock=clock, wait_delay=0.0)
    assert list(progress.track(_slow_first(file.seen, stats, clock))) == [0, 1]
    progress.close()
    text = file.getvalue()
    assert "waiting for the first batch (listing the sources, filling the lanes): 00:0" in text
    assert "stream:   4%|" in text and "2/50 [" in text  # tqdm's bar: the total, elapsed<eta
    assert "tok/s (last 10 s), prefetch 83% (loader ahead)  skipped 1" in text


def test_without_tqdm_a_terminal_gets_the_plain_lines(monkeypatch) -> None:
    from zephon_stream.cli import progress as module

    monkeypatch.setattr(module, "tqdm", None)
    clock, stats, file = Clock(), Stats(), io.StringIO()
    _run(StreamProgress(stats, total=4, file=file, tty=True, clock=clock), stats, clock, 4, 1.0)
    assert file.getvalue() == ("step 4/4 (100%)  elapsed 00:04  1.00k tok/s (last 10 s)  tokens 4.00k  "
                               "prefetch 83% (loader ahead)  skipped 1\n")


def test_the_demo_build_reports_its_steps_as_plain_log_lines_off_a_terminal(tmp_path, caplog, capfd) -> None:
    with caplog.at_level(logging.INFO, logger="zephon_stream.datasets"):
        corpus.build_demo(tmp_path / "demo", min_bytes=200_000, debian_docs=False)
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("demo dataset: ")]
    assert [m.split(": ", 2)[1] for m in steps] == ["prose", "code", "prose", "code", "tokenizer trained"], steps
    assert "\r" not in capfd.readouterr().err


def test_the_debian_download_is_announced_with_its_size_before_it_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZEPHON_DATA_CACHE", str(tmp_path / "cache"))
    if shutil.which("apt-get") is None or not corpus.debian_download_bytes():
        pytest.skip("apt-get cannot see the Debian documentation packages here")
    notice = corpus.debian_fetch_notice()
    assert notice is not None and " MB from the Debian mirrors" in notice and str(tmp_path / "cache") in notice
    monkeypatch.setattr(corpus, "have_debian_docs", lambda: True)
    assert corpus.debian_fetch_notice() is None  # nothing to fetch, nothing to say
