"""The short tables workloads/tp.py prints last: all-reduce times, engine figures, goals. A
helper of tp.py; on its own, from a merged result file (any machine, in a second):

    python3 -m benchmarks.tools.tp_report OUT/tp/tp.json
"""

from __future__ import annotations

from collections import defaultdict


def _allreduce(rows: list[dict]) -> None:
    table: dict[tuple, dict[int, float]] = defaultdict(dict)
    bad = []
    for r in rows:
        if r.get("workload") == "allreduce":
            table[(r["mode"], r["strategy"], r["launch"])][r["tokens"]] = r["value"]
            if not r.get("correct", True):
                bad.append(
                    f"{r['mode']} {r['strategy']} {r['tokens']} (rel err {r['rel_err']:.1e})"
                )
    sizes = sorted({t for v in table.values() for t in v})
    print("\nall-reduce, us per call (tokens x 4096 bf16, 2 GPUs)")
    print(f"{'mode':14s} {'strategy':14s} {'launch':6s}" + "".join(f"{t:>9d}" for t in sizes))
    for (mode, name, how), cells in sorted(table.items()):
        line = "".join(f"{cells[t]:9.1f}" if t in cells else f"{'-':>9s}" for t in sizes)
        print(f"{mode:14s} {name:14s} {how:6s}{line}")
    checks = [r for r in rows if r.get("workload") == "check"]
    for r in checks:
        print(
            f"check {r['mode']:14s} {r['strategy']:10s} logits rel err {r['value']:.2e} "
            f"argmax equal {r['argmax_equal']}"
        )
    print("INCORRECT: " + "; ".join(bad) if bad else "all-reduce results: all within tolerance")


def _engines(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    cells: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        key = (r.get("mode"), r.get("config"))
        if r.get("workload") == "W1" and r["metric"] == "decode_tok_s":
            cells[key]["w1_tok_s"] = r["value"]
            cells[key]["tokens"] = r.get("tokens")
        elif r.get("workload") == "TTFT-2048":
            cells[key]["ttft2048_ms"] = r["value"]
        elif r.get("workload") == "decode-batch64":
            cells[key]["decode64_ms"] = r["value"]
        elif r.get("workload") == "startup":
            cells[key]["start_s"] = r["value"]
    return cells


def _goals(cells: dict[tuple, dict[str, float]]) -> None:
    def get(mode: str, cfg: str, k: str) -> float | None:
        return cells.get((mode, cfg), {}).get(k)

    tp1, tp2 = (
        get("nvlink", "tp1", "w1_tok_s"),
        [get("nvlink", c, "w1_tok_s") for c in ("tp2-nccl", "tp2-auto", "tp2-auto-dual")],
    )
    tp2 = [v for v in tp2 if v]
    if tp1 and tp2:
        print(f"goal nvlink W1 TP2/TP1 >= 1.8: {max(tp2) / tp1:.2f}x")
    for k, goal in (("ttft2048_ms", 0.5), ("decode64_ms", 0.75)):
        base = get("pcie-emulated", "tp2-nccl", k)
        best = [
            (v[k], cfg)
            for (m, cfg), v in cells.items()
            if m == "pcie-emulated" and k in v and cfg != "tp2-nccl"
        ]
        if base and best:
            value, cfg = min(best)
            print(f"goal pcie {k} best/nccl <= {goal}: {value / base:.2f}x ({cfg})")


def print_tables(rows: list[dict]) -> None:
    _allreduce(rows)
    cells = _engines(rows)
    print("\nengine (llama-3-8b dummy, bf16)")
    print(
        f"{'mode':14s} {'config':14s} {'W1 tok/s':>9s} {'TTFT2048 ms':>12s} "
        f"{'decode64 ms':>12s} {'start s':>8s} {'tokens=nccl':>11s}"
    )
    for (mode, cfg), v in sorted(cells.items()):
        ref = cells.get((mode, "tp2-nccl"), {}).get("tokens")
        same = "-" if not ref or not v.get("tokens") or cfg == "tp1" else str(v["tokens"] == ref)
        nan = float("nan")
        w1, ttft, dec = (v.get(k, nan) for k in ("w1_tok_s", "ttft2048_ms", "decode64_ms"))
        print(
            f"{mode:14s} {cfg:14s} {w1:9.1f} {ttft:12.1f} {dec:12.2f} "
            f"{v.get('start_s', nan):8.1f} {same:>11s}"
        )
    _goals(cells)


def main() -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="tp.json, the rows workloads/tp.py merged")
    with open(ap.parse_args().path) as f:
        print_tables(json.load(f))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
