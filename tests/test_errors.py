"""The one error-group unwrapper that the loader, refit, the relay and the S3 connector share."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from zephon_stream.errors import ConfigError, DataError, root_error, unwrap_groups


def test_the_first_zephon_error_wins_and_names_the_others() -> None:
    other = ValueError("boom")
    ours = DataError("bad record")
    group = BaseExceptionGroup("lanes", [asyncio.CancelledError(), other, ExceptionGroup("inner", [ours])])
    assert root_error(group) is ours
    root_error(group)  # a second look adds no second note
    assert ours.__notes__ == ["another task failed too: ValueError: boom"]


def test_the_same_failure_twice_is_raised_once_without_a_note() -> None:
    # two lane workers that stopped for the same reason (the processes backend without a main
    # guard): the user reads the message once, and it stays the last line of the traceback
    first, again = ConfigError("put it under a main guard"), ConfigError("put it under a main guard")
    other = ConfigError("something else")
    assert root_error(ExceptionGroup("workers", [first, again])) is first
    assert not getattr(first, "__notes__", None)
    assert root_error(ExceptionGroup("workers", [first, again, other])) is first
    assert first.__notes__ == ["another task failed too: ConfigError: something else"]


def test_a_stream_closed_by_the_failure_adds_no_note() -> None:
    # a lane worker fails and the backend closes the streams the consumer waits on: the consumer's
    # ClosedResourceError is the failure's consequence, not another one (it was the last line the
    # user read after the main-guard message, with `async with loader.open()`)
    ours, closed, broken = ConfigError("put it under a main guard"), anyio.ClosedResourceError(), \
        anyio.BrokenResourceError()
    assert root_error(ExceptionGroup("g", [closed, ours, broken])) is ours
    assert not getattr(ours, "__notes__", None)
    first = KeyError("k")
    assert root_error(ExceptionGroup("g", [closed, first])) is first  # not the first of the list: the cause
    assert root_error(ExceptionGroup("g", [closed])) is closed  # alone it is the failure


def test_without_a_zephon_error_the_first_real_error_wins() -> None:
    first, second = KeyError("k"), ValueError("v")
    assert root_error(ExceptionGroup("g", [first, second])) is first
    assert root_error(second) is second  # not a group: as it is


def test_cancellations_alone_stay_a_group() -> None:
    group = BaseExceptionGroup("g", [asyncio.CancelledError(), asyncio.CancelledError()])
    assert root_error(group) is group


def test_unwrap_raises_the_root_and_never_swallows_an_interrupt() -> None:
    with pytest.raises(DataError, match="bad"):
        with unwrap_groups():
            raise ExceptionGroup("g", [DataError("bad")])
    with pytest.raises(BaseExceptionGroup):
        with unwrap_groups():
            raise BaseExceptionGroup("g", [KeyboardInterrupt()])
