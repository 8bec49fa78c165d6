"""SIGTERM while a multi-process executor lives (`lightwell.executor.sigterm`): SystemExit(143),
deferred by a StepGuard to the end of the step; the default handler back afterwards; an
application's own handler left alone. A real signal to this process, handled in the main thread.
"""

from __future__ import annotations

import signal

import pytest

from lightwell.engine.interrupts import StepGuard
from lightwell.executor import sigterm


@pytest.fixture(autouse=True)
def _default_sigterm():
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, old)


def test_sigterm_exits_143_between_steps_and_the_default_comes_back():
    assert sigterm.install()
    try:
        with StepGuard((signal.SIGINT, signal.SIGTERM)) as guard:
            signal.raise_signal(signal.SIGTERM)  # "inside a step": only noted
            signal.raise_signal(signal.SIGTERM)  # a second one changes nothing
            assert guard.pending is not None
            with pytest.raises(SystemExit) as e:
                guard.check()  # between steps
        assert e.value.code == 143 == sigterm.EXIT_CODE
        assert signal.getsignal(signal.SIGTERM) is sigterm.exit_on_sigterm  # guard restored it
        sigterm.exit_on_sigterm(signal.SIGTERM, None)  # during the exit it started: ignored
    finally:
        sigterm.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_two_executors_share_the_handler_until_the_last_is_gone():
    assert sigterm.install() and sigterm.install()
    sigterm.uninstall()
    assert signal.getsignal(signal.SIGTERM) is sigterm.exit_on_sigterm
    sigterm.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert sigterm.install()  # a fresh one raises again
    try:
        with pytest.raises(SystemExit):
            sigterm.exit_on_sigterm(signal.SIGTERM, None)
    finally:
        sigterm.uninstall()


def test_an_application_handler_is_left_alone():
    seen = []
    signal.signal(signal.SIGTERM, lambda *a: seen.append(a[0]))
    assert not sigterm.install()
    with StepGuard((signal.SIGINT, signal.SIGTERM)) as guard:
        signal.raise_signal(signal.SIGTERM)  # not deferred: the application's handler runs
    assert seen == [signal.SIGTERM] and guard.pending is None


def test_default_sigterm_is_not_taken_over_by_a_step_guard():
    with StepGuard((signal.SIGINT, signal.SIGTERM)):
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_ctrl_c_is_still_a_keyboard_interrupt_between_steps():
    with pytest.raises(KeyboardInterrupt):
        with StepGuard() as guard:
            signal.raise_signal(signal.SIGINT)
            assert guard.pending is not None
            guard.check()
