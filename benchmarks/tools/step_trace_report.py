"""Summarise a server's step trace (``lightwell serve --step-trace``; workloads/w3.sh keeps it
as steps.jsonl.gz): how many steps ran each way (a CUDA graph and its size, eager, eager
split), their durations, and the longest steps with what they held. On any machine, in a
second:

    python3 -m benchmarks.tools.step_trace_report OUT/steps.jsonl.gz [--top 15]

``ms`` is the time since the previous step's end, idle time included: a long step after an
idle spell shows as long here, with ``new_requests`` > 0 and few ``running``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def kind(path: str) -> str:  # "graph mixed 1280" -> "graph mixed"
    return " ".join(path.split()[:2]) if path.startswith("graph") else (path or "-")


def report(rows: list[dict], top: int) -> str:
    out = [f"{len(rows)} steps, {sum(r['tokens'] for r in rows)} tokens"]
    by = collections.defaultdict(list)
    for r in rows:
        by[kind(r["path"])].append(r)
    out.append(
        f"{'how':16s} {'steps':>7s} {'tokens/step':>12s} {'ms p50':>8s} {'p99':>8s} {'max':>8s}"
    )
    for name, group in sorted(by.items(), key=lambda kv: -len(kv[1])):
        ms = sorted(r["ms"] for r in group)
        p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        tok = statistics.mean(r["tokens"] for r in group)
        out.append(
            f"{name:16s} {len(group):7d} {tok:12.1f} {statistics.median(ms):8.2f} {p99:8.2f} "
            f"{ms[-1]:8.2f}"
        )
    out.append(f"longest {top} steps:")
    for r in sorted(rows, key=lambda r: -r["ms"])[:top]:
        out.append(
            f"  step {r['step']:>7} {r['ms']:9.2f} ms  {r['path']:18s} tokens {r['tokens']:5d} "
            f"requests {r['requests']:4d} one-token {r['one_token_rows']:4d} new "
            f"{r['new_requests']:3d} running {r['running']:4d} waiting {r['waiting']:4d}"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    print(report(load(args.trace), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
