"""Decode-shaped matmuls with few rows: our Triton GEMV (lightwell/kernels/gemv.py) against
cuBLAS, on llama-3-8b's weight shapes per GPU at TP=1 and TP=2, bf16, 1, 2 and 4 rows. One
device call of about a minute (``--sweep``: several minutes):

    run(command="python3 -m benchmarks.kernels.gemv --out $OUT/gemv.json")

Each result is checked against an fp32 reference first (its largest error beside cuBLAS's).
Timing as in kernels/blas.py: a CUDA graph cycling through enough copies of the weight (>= 200 MB)
that no launch finds it in L2, median of 20 replays, µs a launch and weight bytes a second.
``--sweep``: every tile (BLOCK_N, BLOCK_K, warps, stages) with 32-256 bytes of W a thread per
K step, at one row; the best five are then timed at every row count too. ``--silu``: the down
projections with the SiLU-and-mul fused in, against the activation apart. ``--shapes "tp2 qkv"``
picks shapes (DeepSeek-V2-Lite's narrow ones only when named: ``--shapes "v2-lite qkv_a,v2-lite
o,v2-lite router,v2-lite router fp32"``; the last with an fp32 weight and fp32 product, as
DeepSeek's router runs). Reference result: benchmarks/results/kernels_gemv_h200.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks.kernels.blas import MIN_BYTES
from benchmarks.kernels.blas import SHAPES as BLAS_SHAPES
from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels.gemv import gemv, gemv_ref, pick_config

# name: (N, K) of the weight on one GPU: kernels/blas.py's eight, the LM head at TP=2 and TP=1,
# and DeepSeek-V2-Lite's narrow ones (fused q + kv_a, o_proj, the router)
SHAPES = {
    **BLAS_SHAPES,
    "tp2 lm_head": (64128, 4096),
    "tp1 lm_head": (128256, 4096),
    "v2-lite qkv_a": (3648, 2048),
    "v2-lite o": (2048, 2048),
    "v2-lite router": (64, 2048),
    "v2-lite router fp32": (64, 2048),
}
# shapes whose weight is fp32 (and so the product, as the MoE Router computes it: logits in
# the weight's dtype from bf16 activations); bf16 otherwise
FP32_WEIGHTS = {"v2-lite router fp32"}
DEFAULT_SHAPES = [name for name in SHAPES if not name.startswith("v2-lite")]
ROWS = (1, 2, 4)


def sweep_configs() -> list[tuple[int, int, int, int]]:
    out = []
    for bn, bk, warps, stages in itertools.product(
        (1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4, 8), (1, 3)
    ):
        per_thread = bn * bk * 2 / (warps * 32)
        if 32 <= per_thread <= 256:
            out.append((bn, bk, warps, stages))
    return out


def measure_shape(name: str, sweep: bool, dev: torch.device) -> list[dict]:
    n, k = SHAPES[name]
    wdt = torch.float32 if name in FP32_WEIGHTS else torch.bfloat16
    nbytes = n * k * wdt.itemsize
    copies = max(2, -(-MIN_BYTES // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=wdt) / 64 for _ in range(copies)]
    outs = [torch.empty(max(ROWS), n, device=dev, dtype=wdt) for _ in ws]

    def ours(x: torch.Tensor, w: torch.Tensor, cfg=None) -> torch.Tensor:
        return gemv(x, w, config=cfg, out_dtype=wdt)

    def ours_us(x: torch.Tensor, cfg) -> float:
        return graph_replay_us(lambda: [ours(x, w, cfg) for w in ws], calls=copies)

    def cublas_us(x: torch.Tensor) -> float:
        m = x.shape[0]
        return graph_replay_us(
            lambda: [torch.matmul(x.to(wdt), w.t(), out=o[:m]) for w, o in zip(ws, outs)],
            calls=copies,
        )

    ranked: list[tuple[float, tuple]] = []
    if sweep:
        x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        for cfg in sweep_configs():
            try:
                ranked.append((ours_us(x1, cfg), cfg))
            except Exception as e:  # a tile Triton cannot build (registers, shared memory)
                print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
        ranked.sort()
    rows = []
    for m in ROWS:
        default = pick_config(n, k, m)  # the tile gemv() takes at m rows
        candidates = [default] + [c for _, c in ranked[:5] if c != default]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = gemv_ref(x.float(), ws[0].float())
        err_cublas = float((torch.matmul(x.to(wdt), ws[0].t()).float() - ref).abs().max())
        row = dict(shape=name, n=n, k=k, m=m, cublas_us=round(cublas_us(x), 2))
        row["cublas_tbps"] = round(nbytes / row["cublas_us"] / 1e6, 2)
        row["configs"] = []
        for cfg in candidates:
            err = float((ours(x, ws[0], cfg).float() - ref).abs().max())
            us = ours_us(x, cfg)
            row["configs"].append(
                dict(
                    config=list(cfg),
                    us=round(us, 2),
                    tbps=round(nbytes / us / 1e6, 2),
                    max_err=err,
                    default=cfg == default,
                )  # fmt: skip
            )
        row["max_err_cublas"] = err_cublas
        best = min(row["configs"], key=lambda c: c["us"])
        row["best"] = best
        if m == 1 and ranked:
            row["sweep_top10"] = [(round(t, 2), list(c)) for t, c in ranked[:10]]
        rows.append(record("gemv_us", row["configs"][0]["us"], **row))
        d = row["configs"][0]
        print(
            f"{name:12} m={m} cuBLAS {row['cublas_us']:6.2f} us {row['cublas_tbps']:4.2f} TB/s"
            f" | default {d['us']:6.2f} us {d['tbps']:4.2f} TB/s err {d['max_err']:.3g}"
            f" (cuBLAS {err_cublas:.3g}) | best {best['config']} {best['us']:6.2f} us "
            f"{best['tbps']:4.2f} TB/s",
            flush=True,
        )
    return rows


SILU_CONFIGS = (
    (2, 1024, 1, 3),
    (8, 1024, 4, 1),
    (16, 512, 4, 3),
    (16, 1024, 8, 3),
    (32, 512, 8, 3),
)


def measure_silu(name: str, dev: torch.device) -> list[dict]:
    """The down projection of one row with its activation: silu_and_mul then cuBLAS or our
    gemv (two kernels), against gemv(silu_mul=True) (one) at several tiles; checked first."""
    from lightwell.kernels.activation import silu_and_mul

    n, k = SHAPES[name]
    copies = max(2, -(-MIN_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(copies)]
    gate_up = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
    act = silu_and_mul(gate_up)
    ref = gemv_ref(act.float(), ws[0].float())
    row = dict(shape=name, n=n, k=k, m=1)
    row["silu_then_cublas_us"] = graph_replay_us(
        lambda: [torch.matmul(silu_and_mul(gate_up), w.t()) for w in ws], calls=copies
    )
    row["silu_then_gemv_us"] = graph_replay_us(
        lambda: [gemv(silu_and_mul(gate_up), w) for w in ws], calls=copies
    )
    row["fused"] = []
    for cfg in (pick_config(n, k, 1, True), *SILU_CONFIGS):
        err = float((gemv(gate_up, ws[0], config=cfg, silu_mul=True).float() - ref).abs().max())
        us = graph_replay_us(
            lambda cfg=cfg: [gemv(gate_up, w, config=cfg, silu_mul=True) for w in ws],
            calls=copies,
        )
        row["fused"].append(dict(config=list(cfg), us=round(us, 2), max_err=err))
    print(
        f"{name:12} silu+cuBLAS {row['silu_then_cublas_us']:6.2f} us  silu+gemv "
        f"{row['silu_then_gemv_us']:6.2f} us  fused "
        + "  ".join(f"{c['config']} {c['us']:6.2f} (err {c['max_err']:.3g})" for c in row["fused"]),
        flush=True,
    )
    return [record("gemv_silu_us", row["fused"][0]["us"], **row)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                    help=f"comma-separated SHAPES names (of {', '.join(SHAPES)})")  # fmt: skip
    ap.add_argument("--silu", action="store_true", help="the down shapes with the activation")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows_out: list[dict] = []
    for name in args.shapes.split(","):
        rows_out += measure_silu(name, dev) if args.silu else measure_shape(name, args.sweep, dev)
        write_json(args.out, rows_out)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
