"""ds4.engine.interrupt: a Ctrl+C that lands in a finalizer is kept pending, not swallowed (CI once saw ds4-eval's
KeyboardInterrupt raised inside llvmlite's __del__, printed as a traceback and lost); real signals to this process."""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest

from ds4.engine import interrupt
from ds4.engine.generate import generate
from ds4.engine.sampling import Sampler


@pytest.fixture()
def installed():
    old = signal.getsignal(signal.SIGINT)
    previous = interrupt.install()
    assert previous is old
    yield
    interrupt.restore(previous)
    assert signal.getsignal(signal.SIGINT) is old
    interrupt.forget()


class SignalledInFinalizer:
    """Sends SIGINT to this process from its __del__; the handler runs there, at the next bytecode."""

    def __init__(self, log):
        self.log = log

    def __del__(self):
        self.log.append(interrupt.in_swallowing_frame(sys._getframe()))
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes for the pending signal to be handled in this frame
            pass
        self.log.append("finished")


def _signal_in_a_finalizer():
    log = []
    SignalledInFinalizer(log)
    gc.collect()
    return log


def test_a_plain_frame_is_not_a_swallowing_frame():
    assert not interrupt.in_swallowing_frame(sys._getframe())


def test_sigint_in_a_finalizer_is_kept_pending_and_raised_by_check(installed):
    log = _signal_in_a_finalizer()
    assert log == [True, "finished"]  # the finalizer ran to its end: nothing was raised into it
    with pytest.raises(KeyboardInterrupt):
        interrupt.check()
    interrupt.check()  # raised once


def test_sigint_elsewhere_raises_at_once(installed):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
    interrupt.check()  # nothing left pending


def test_generate_ends_interrupted_on_a_sigint_caught_in_a_finalizer(installed, tiny_model):
    """The Ctrl+C lands in a finalizer while the first token is handed out: the next step raises it."""
    from ds4.engine.session import Session

    gen = generate(Session(tiny_model, ctx=64), [1, 5, 6], 8, Sampler(temperature=0),
                   on_token=lambda _: _signal_in_a_finalizer())
    assert gen.finish_reason == "interrupted" and len(gen.tokens) == 1


def test_a_stale_pending_sigint_does_not_stop_the_next_generation(installed, tiny_model):
    from ds4.engine.session import Session

    _signal_in_a_finalizer()  # left pending by earlier work
    gen = generate(Session(tiny_model, ctx=64), [1, 5, 6], 8, Sampler(temperature=0))
    assert gen.finish_reason == "length" and len(gen.tokens) == 8
    interrupt.check()
