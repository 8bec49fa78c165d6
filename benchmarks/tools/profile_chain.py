"""Where hostmem-copy-int8's all-reduces spend their time, from a kernel timeline that
workloads/tp.py's ``profile`` stage wrote (one 2,048-token prefill on rank 0; the files,
profile_<mode>_<engine>.json, are in tp.py's parts.tgz). On any machine, in a second:

    python3 -m benchmarks.tools.profile_chain OUT/profile_pcie-emulated_tp2-hostmem-copy-int8-*.json

Pairs the i-th quantize with the i-th group of D2H copies, H2D copies and sum (each kind runs
in call order), and prints medians (p10, p90) in µs: the quantize, from its end to the first
D2H, the D2H span and the gaps inside it, from the first D2H's end to the first H2D, the H2D
span and gaps, from the last H2D to the sum, the sum, and the whole call.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys


def chains(kernels: list[dict]) -> list[dict]:
    k = sorted(kernels, key=lambda e: e["ts"])
    quant = [e for e in k if "quantize_pack" in e["name"]]
    sums = [e for e in k if "dequant_sum" in e["name"]]
    d2h = [e for e in k if "DtoH" in e["name"] and e["dur"] > 3]  # not the small scalar ones
    h2d = [e for e in k if "HtoD" in e["name"] and e["dur"] > 3]
    per = len(d2h) // max(1, len(quant))  # copies a call (every call alike: the prefill's)
    out: list[dict] = []
    if per == 0:
        return out

    def end(e: dict) -> float:
        return e["ts"] + e["dur"]

    for i in range(min(len(quant), len(sums), len(d2h) // per, len(h2d) // per)):
        d, h, q, s = d2h[i * per : (i + 1) * per], h2d[i * per : (i + 1) * per], quant[i], sums[i]
        out.append(
            {
                "quantize": q["dur"],
                "to_first_d2h": d[0]["ts"] - end(q),
                "d2h_span": end(d[-1]) - d[0]["ts"],
                "d2h_gaps": sum(b["ts"] - end(a) for a, b in zip(d, d[1:])),
                "first_d2h_to_h2d": h[0]["ts"] - end(d[0]),
                "h2d_span": end(h[-1]) - h[0]["ts"],
                "h2d_gaps": sum(b["ts"] - end(a) for a, b in zip(h, h[1:])),
                "to_sum": s["ts"] - end(h[-1]),
                "sum": s["dur"],
                "call": end(s) - q["ts"],
            }
        )
    return out


def main() -> int:
    for path in sys.argv[1:]:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
        rows = chains(data["kernels"])
        print(f"{path}: span {data['span_us']:.0f} us, {len(rows)} all-reduces")
        for key in rows[0] if rows else []:
            vals = sorted(r[key] for r in rows)
            p10, p90 = vals[len(vals) // 10], vals[9 * len(vals) // 10]
            print(f"  {key:18s} {statistics.median(vals):7.1f}  ({p10:.1f}, {p90:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
