"""Write benchmark results as JSON with date, machine, commit and command (PERFORMANCE.md)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightwell.bench.results import git_commit  # noqa: E402  ($LIGHTWELL_COMMIT aware)


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def record(metric: str, value: float, **fields) -> dict:
    return {
        "metric": metric,
        "value": round(value, 4),
        "gpu": machine(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        **fields,
    }


def write_results(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {len(rows)} results to {path}")
