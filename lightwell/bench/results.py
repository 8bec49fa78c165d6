"""Result records in PERFORMANCE.md's format: one JSON object per figure, with provenance."""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from typing import Any

from lightwell import envs


def git_commit() -> str:
    """The short commit of the Lightwell checkout that is running: ``envs.commit_override()``
    when set (a tree copied without .git, e.g. to the GPU machine), else git's, else
    ``unknown``."""
    from_env = envs.commit_override()
    if from_env:
        return from_env
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {name} x{os.cpu_count()}"


def machine(device: str | None = None) -> str:
    """The accelerator's name (torch when ``device`` is cuda, else nvidia-smi), or the CPU's."""
    if device is not None and device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    if device is None and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            if out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return cpu_name()


def command_line() -> str:
    """The `lightwell ...` command that is running (however the CLI was launched)."""
    return shlex.join(["lightwell", *sys.argv[1:]])


def script_command() -> str:
    """The command that is running, as typed: ``python3 -m benchmarks.workloads.engine ...``
    for a module run with ``-m``, else ``python3 SCRIPT ...``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else [sys.argv[0]]
    return shlex.join(["python3", *head, *sys.argv[1:]])


@functools.lru_cache(maxsize=1)
def _script_provenance() -> tuple[str, str]:
    return machine(), git_commit()


def record(metric: str, value: float, **fields: Any) -> dict:
    """One result record of a benchmark script: metric and value, then gpu (the accelerator
    that nvidia-smi lists, else the CPU), commit, date and command (``script_command()``),
    then ``fields``, which may override any of them (a child process passes its driver's
    command)."""
    gpu, commit = _script_provenance()
    return {
        "metric": metric,
        "value": _round(value),
        "gpu": gpu,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "command": script_command(),
        **fields,
    }


def provenance(device: str | None = None) -> dict[str, Any]:
    return {
        "gpu": machine(device),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "command": command_line(),
    }


def make_record(metric: str, value: float, common: dict[str, Any], **extra: Any) -> dict:
    return {**common, "metric": metric, "value": _round(value), **extra}


def _round(v: float | None) -> float | None:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return float(f"{float(v):.6g}")  # 6 significant digits: an MFU of 3e-5 stays non-zero


def parse_metadata(items: list[str] | None) -> dict[str, Any]:
    """``["dtype=bfloat16", "tp=2"]`` -> {"dtype": "bfloat16", "tp": 2} (JSON values if valid)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --metadata item {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def write_json(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    print(f"wrote {len(rows)} results to {path}")
