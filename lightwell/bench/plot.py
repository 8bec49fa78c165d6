"""PNG plots of `bench serve` runs: latency CDFs per rate, and latency vs achieved request rate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def plot_serve(runs: Sequence[Any], path: str, title: str = "") -> None:
    """Row 1: the CDF of each latency, one line per rate. Row 2 (several rates): P50 / P99 of
    each latency against the achieved request throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if len(runs) > 1 else 1
    fig, axes = plt.subplots(
        rows, len(PANELS), figsize=(4.2 * len(PANELS), 3.6 * rows), squeeze=False
    )
    for col, (key, name) in enumerate(PANELS):
        _cdf_panel(axes[0][col], runs, key, name)
        if rows == 2:
            _rate_panel(axes[1][col], runs, key, name)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(rate: float) -> str:
    return "all at once" if rate == float("inf") else f"{rate:g} req/s"


def _cdf_panel(ax: Any, runs: Sequence[Any], key: str, name: str) -> None:
    for run in runs:
        ms = np.sort(np.asarray(run.metrics.raw.get(key, []), dtype=float) * 1000.0)
        if ms.size:
            ax.step(
                ms,
                np.arange(1, ms.size + 1) / ms.size,
                where="post",
                label=_label(run.request_rate),
            )
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("fraction of " + ("gaps" if key == "itl" else "requests"))
    ax.set_title(f"{name} distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _rate_panel(ax: Any, runs: Sequence[Any], key: str, name: str) -> None:
    xs = [run.metrics.request_throughput for run in runs]
    for label, pick in (("P50", lambda d: d.median), ("P99", lambda d: d.percentiles.get(99.0))):
        ys = [pick(getattr(run.metrics, key)) for run in runs]
        if all(y is not None for y in ys):
            ax.plot(xs, ys, marker="o", label=label)
    ax.plot(xs, [getattr(run.metrics, key).mean for run in runs], marker="x", ls="--", label="mean")
    ax.set_xlabel("achieved request rate (req/s)")
    ax.set_ylabel(f"{name} (ms)")
    ax.set_title(f"{name} vs request rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
