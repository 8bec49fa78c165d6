"""Ctrl-C (and SIGTERM, where its handler says so) taken between engine steps, never inside one.

A KeyboardInterrupt raised in the middle of a step would leave rank 0 of a tensor-parallel
engine out of step with its workers (they wait in a collective it never joins). Inside a
``StepGuard`` the signal only sets a flag; ``check()``, called between steps, raises what the
signal's own handler raises (KeyboardInterrupt for Ctrl-C; the CLI's SIGTERM handler raises
KeyboardInterrupt too, a multi-process executor's raises ``SystemExit(143)``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class StepGuard:
    """``with StepGuard() as guard: ... engine.step(); guard.check() ...``. Only in the main
    thread, and only for the signals in ``signals`` whose handler is Python's default Ctrl-C
    one or is marked ``defers_to_steps``: others (the default SIGTERM, which ends the process
    at once, or an application's own handler) are left alone."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT,)) -> None:
        self.signals = signals
        self.pending: tuple[int, Callable[..., Any]] | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StepGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            old = signal.getsignal(sig)
            if old is signal.default_int_handler or getattr(old, "defers_to_steps", False):
                self._old[sig] = old
                signal.signal(sig, self._handler)
        return self

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None:  # the first signal decides
            self.pending = (signum, self._old[signum])

    def check(self) -> None:
        """Raise what the handler of a signal received since the last check raises."""
        if self.pending is not None:
            signum, handler = self.pending
            self.pending = None
            handler(signum, None)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        if self.pending is not None and exc[0] is None:
            self.check()
