"""Ctrl-C (and, for the CLI, SIGTERM) taken between engine steps, never inside one.

A KeyboardInterrupt raised in the middle of a step would leave rank 0 of a tensor-parallel
engine out of step with its workers (they wait in a collective it never joins). Inside a
``StepGuard`` the signal only sets a flag; ``check()``, called between steps, raises it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class StepGuard:
    """``with StepGuard() as guard: ... engine.step(); guard.check() ...``. Only in the main
    thread, and only for signals whose handler is Python's default Ctrl-C one (SIGINT) or that
    are named in ``signals`` and were left at the default (SIGTERM): others are left alone."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT,)) -> None:
        self.signals = signals
        self.pending = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StepGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            old = signal.getsignal(sig)
            if old in (signal.default_int_handler, signal.SIG_DFL) or getattr(
                old, "defers_to_steps", False
            ):
                self._old[sig] = old
                signal.signal(sig, self._handler)
        return self

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True

    def check(self) -> None:
        """Raise the KeyboardInterrupt a signal asked for since the last check."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        if self.pending and exc[0] is None:
            self.check()
