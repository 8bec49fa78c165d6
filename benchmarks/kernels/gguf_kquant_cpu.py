"""One GGUF K-quant linear on the CPU at 1 and 5 rows: the C kernels (``gguf_cpu.gguf_mm``) against
the per-call numpy dequantization they replace (gguf-py + ``F.linear``), with a float32
``F.linear`` and the Q4_0 C kernel of the same shape beside them. Variants run interleaved,
medians of ``--reps`` rounds; records go to ``--out`` (a JSON list). CPU, under a minute:
``python -m benchmarks.kernels.gguf_kquant_cpu --threads 2``."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from lightwell.kernels.cpu import gguf_cpu
from lightwell.kernels.gguf_blocks import Q4_0, Q4_K, Q5_K, Q6_K, gguf_dequantize_ref
from lightwell.quant.gguf import dequantize_raw
from tests.kernels.gguf_random import random_blocks


def _variants(n: int, k: int, qtype: int, x: torch.Tensor) -> dict:
    w = random_blocks(n, k, qtype, seed=qtype)
    w32 = gguf_dequantize_ref(w, qtype)
    q40 = random_blocks(n, k, Q4_0)
    return {
        "numpy_dequant_ms": lambda: F.linear(x, dequantize_raw(w, qtype)),
        "kernel_ms": lambda: gguf_cpu.gguf_mm(x, w, qtype),
        "fp32_linear_ms": lambda: F.linear(x, w32),
        "q4_0_kernel_ms": lambda: gguf_cpu.gguf_mm(x, q40, Q4_0),
    }


def measure(n: int, k: int, qtype: int, rows: int, reps: int) -> dict[str, float]:
    x = torch.randn(rows, k)
    fns = _variants(n, k, qtype, x)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps + 2):  # two warm rounds
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=576)
    p.add_argument("--k", type=int, default=1536)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--out", default="benchmarks/results/kernels_gguf_kquant_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    base = {
        "gpu": f"CPU {platform.machine()} x{args.threads}",
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.kernels.gguf_kquant_cpu", *sys.argv[1:]]),
        "n": args.n,
        "k": args.k,
    }
    records = []
    for qtype, name in ((Q4_K, "Q4_K"), (Q5_K, "Q5_K"), (Q6_K, "Q6_K")):
        for rows in (1, 5):
            for metric, value in measure(args.n, args.k, qtype, rows, args.reps).items():
                rec = {"metric": metric, "value": round(value, 4), **base}
                records.append({**rec, "qtype": name, "rows": rows})
                print(name, rows, metric, round(value, 4))
    with open(args.out, "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")


if __name__ == "__main__":
    main()
