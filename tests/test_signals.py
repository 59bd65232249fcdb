"""engine.signals.ctrl_c_after: a Ctrl-C held over a block that must run whole."""

from __future__ import annotations

import signal

import pytest

from zephon_stream.engine.signals import ctrl_c_after


def test_a_ctrl_c_in_the_block_comes_after_it() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_after():
            signal.raise_signal(signal.SIGINT)
            done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_set_outside_python_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`signal.signal` returns None for a handler that an embedding host set: putting None back
    raised TypeError and left the holding handler in place, which dropped every later Ctrl-C."""
    calls = []
    monkeypatch.setattr(signal, "getsignal", lambda signum: None)
    monkeypatch.setattr(signal, "signal", lambda *args: calls.append(args))
    with ctrl_c_after():
        pass
    assert calls == []
