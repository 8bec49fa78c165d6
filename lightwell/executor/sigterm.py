"""SIGTERM in a process that drives worker processes: an orderly exit with code 143.

Python's default SIGTERM ends the process at once: its worker processes are left to notice on
their own, and multiprocessing's resource tracker reports leaked semaphores. While a
multi-process executor is alive in a process whose SIGTERM handler is the default one, the
handler below raises ``SystemExit(143)`` instead (128 + SIGTERM, what a shell reports for a
process that SIGTERM ended): the interpreter exits through the executor's shutdown, so every
worker stops first. Inside a ``StepGuard`` (``LLM.generate``) it is raised between engine
steps, never inside one. A handler the application installed itself is left alone. The worker
processes ignore SIGTERM (a SIGTERM sent to the whole process group, as systemd does, reaches
rank 0, which stops them) and end when rank 0's process ends, however it ends.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_CODE = 128 + signal.SIGTERM

_state = {"installs": 0, "terminating": False}


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Raise ``SystemExit(143)`` once; a SIGTERM during the exit it started is ignored."""
    if _state["terminating"]:
        return
    _state["terminating"] = True
    raise SystemExit(EXIT_CODE)


exit_on_sigterm.defers_to_steps = True  # type: ignore[attr-defined]  # StepGuard takes it over


def install() -> bool:
    """Take SIGTERM over for a new executor, unless another handler than the default (or this
    one) is set, or this is not the main thread. Returns whether it did (then ``uninstall``
    when the executor shuts down)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is not exit_on_sigterm and current != signal.SIG_DFL:
        return False
    if not _state["installs"]:
        _state["terminating"] = False  # (a SystemExit of an earlier one was caught)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    _state["installs"] += 1
    return True


def uninstall() -> None:
    """The default SIGTERM back once the last executor that installed the handler is gone
    (from the main thread; elsewhere the handler stays, raising only SystemExit)."""
    _state["installs"] = max(0, _state["installs"] - 1)
    if _state["installs"] or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is exit_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
