"""Start-up progress: each stage of loading an engine (tokenizer, model config, weights,
quantized-weight conversion, KV cache, warm-up, CUDA-graph capture) as one tqdm bar or line on
stderr while it runs, and one INFO line with its seconds when it ends.

    with stage("Loading weights", total=len(items), unit="tensor") as st:
        for item in st.iter(items):
            ...
        st.summary = f"loaded {len(items)} weight tensors"   # logged as "... in 3.1 s"

The bar shows only on a terminal (tqdm's ``disable=None``); the INFO line is logged either way
(``lightwell serve`` logs INFO by default, ``generate`` and ``chat`` with ``--log-level INFO``).
Only the process of rank 0 shows either: ``set_enabled`` is called once per process by the
worker. Nothing is printed per tensor: tqdm redraws the bar at most every 0.1 s.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

from tqdm import tqdm

logger = logging.getLogger("lightwell.startup")

T = TypeVar("T")

_ENABLED = [True]  # this process shows progress (rank 0; one-rank engines)


def set_enabled(on: bool) -> None:
    """Whether this process shows start-up progress: the worker sets it once (rank 0 only)."""
    _ENABLED[0] = on


def enabled() -> bool:
    return _ENABLED[0]


class Stage:
    """One stage in progress: ``update`` / ``iter`` advance its bar; ``summary`` (set by the
    caller before the stage ends) is the INFO line, followed by " in N.N s"."""

    def __init__(self, desc: str, total: int | None, unit: str, file: IO[str] | None) -> None:
        self.desc, self.summary = desc, ""
        self.seconds = 0.0
        self.t0 = time.perf_counter()
        # Other ranks make no tqdm at all: its first one creates a multiprocessing lock, which
        # a worker process (ending by os._exit) would leave to the resource tracker as leaked.
        self.bar = None
        if enabled():
            self.bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                file=file if file is not None else sys.stderr,
                disable=None,  # shown on a terminal only
                leave=True,
                bar_format=None if total else "{desc} ... {elapsed}",
            )

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def iter(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, the bar advancing once each has been handled by the caller."""
        for item in items:
            yield item
            self.update(1)

    def close(self, log: bool) -> float:
        self.seconds = time.perf_counter() - self.t0
        if self.bar is not None:
            self.bar.close()
        if log and enabled():
            logger.info("%s in %.1f s", self.summary or self.desc, self.seconds)
        return self.seconds


@contextlib.contextmanager
def stage(
    desc: str, total: int | None = None, unit: str = "it", file: IO[str] | None = None
) -> Iterator[Stage]:
    """A start-up stage: ``total`` items (a bar) or None (one line with the time spent). The
    INFO line is logged when the block ends normally; an exception only closes the bar."""
    st = Stage(desc, total, unit, file)
    try:
        yield st
    except BaseException:
        st.close(log=False)
        raise
    st.close(log=True)
