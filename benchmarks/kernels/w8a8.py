"""W8A8 linears at llama-3-8b's TP=1 shapes, bf16 activations, 1-8192 rows: cuBLAS bf16 against
fp8 (act_quant kernel + ``torch._scaled_mm`` row-wise), int8 (act_quant + the int8 GEMM with the
fused epilogue, lightwell/kernels/int8_gemm.py) and the former torch paths of both (torch
quantization ops; ``_int_mm`` or an fp32 matmul, then the scaling in torch). One device call:

    run(command="python3 -m benchmarks.kernels.w8a8 --out $OUT/w8a8.json")  # ~1 min
    [--rows 1 16 256 2048 8192] [--sweep]  (--sweep: also the int8 GEMM's tiles, ~2 min at
    128 and 256 rows) [--silu-mul-only]

Then the down projection with its activation (``silu_and_mul``, act_quant, GEMM) against
act_quant's ``silu_mul`` form (activation and quantization in one launch), int8 and fp8: the
outputs must be equal bit for bit.

Each call includes the activation quantization, as a linear runs it. Checked first: the kernel
paths' quantized activations equal the torch ones bit for bit; the int8 output equals the old
path's (exact at > 16 rows, where the old path's accumulation is exact too; within 1e-2 else),
and so does every swept tile's; the fp8 output the old fp8 path's; errors against the bf16
product are recorded. Timing: a CUDA
graph cycling through enough weight copies (>= 200 MB) that no launch finds them in L2; median
of 20 replays.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels.act_quant import act_quant, act_quant_ref
from lightwell.kernels.activation import silu_and_mul
from lightwell.kernels.int8_gemm import Int8GemmConfig, int8_gemm, pick_config
from lightwell.quant.fp8 import scaled_mm_rowwise

SHAPES = {  # name: (N, K) of the weight on one GPU
    "tp1 qkv": (6144, 4096),
    "tp1 o": (4096, 4096),
    "tp1 gate_up": (28672, 4096),
    "tp1 down": (4096, 14336),
}
MIN_BYTES = 200 << 20
FP8 = torch.float8_e4m3fn
SWEEP = [Int8GemmConfig(*c) for c in (
    (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 64, 256, 4, 4),
    (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 128, 4, 3), (64, 64, 256, 4, 4),
    (64, 64, 256, 4, 3), (64, 128, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 256, 4, 4),
    (128, 64, 128, 4, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 4, 2), (64, 128, 128, 4, 4, 2),
    (128, 64, 128, 4, 4, 2), (128, 64, 256, 4, 4, 2),
)]  # fmt: skip


def fp8_new(x, w, sw):  # [T, K] bf16, [N, K] fp8, [1, N] float32
    qx, sx = act_quant(x, FP8)
    return scaled_mm_rowwise(qx, w, sx, sw, x.dtype)


def fp8_old(x, w, sw):
    qx, sx = act_quant_ref(x, FP8)
    return scaled_mm_rowwise(qx, w, sx, sw, x.dtype)


def int8_new(x, w, sw, config=None):  # [T, K] bf16, [N, K] int8, [N] float32
    qx, sx = act_quant(x, torch.int8)
    return int8_gemm(qx, w, sx, sw, x.dtype, config=config)


def int8_old(x, w, sw):
    qx, sx = act_quant_ref(x, torch.int8)
    if qx.shape[0] <= 16:
        acc = (qx.float() @ w.float().t()).to(torch.int32)
    else:
        acc = torch._int_mm(qx, w.t())
    return (acc.float() * sx * sw[None, :]).to(x.dtype)


def weights(n: int, k: int, dev: torch.device) -> dict[str, list]:
    """Copies of random weights per path: bf16 ``w``, fp8 (``q``, [1, N] scale), int8."""
    copies = max(2, -(-MIN_BYTES // (n * k)))
    out = {"bf16": [], "fp8": [], "int8": []}
    for _ in range(copies):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64
        out["bf16"].append((w,))
        amax = w.abs().amax(dim=1).float()
        out["fp8"].append(((w.float() / (amax / 448)[:, None]).to(FP8), (amax / 448)[None, :]))
        s8 = amax / 127
        q8 = torch.round(w.float() / s8[:, None]).clamp(-127, 127).to(torch.int8)
        out["int8"].append((q8, s8))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def check(x: torch.Tensor, ws: dict[str, list], m: int) -> dict:
    """Errors of the kernel paths against the torch ones (int8 must match; fp8 differences are
    counted and reported: the fraction of activations whose fp8 bits differ, and the largest
    difference of their dequantized values relative to the row's amax)."""
    diffs = {}
    for dtype in (FP8, torch.int8):
        (q, s), (qr, sr) = act_quant(x, dtype), act_quant_ref(x, dtype)
        bits = torch.uint8 if dtype == FP8 else torch.int8
        same = q.view(bits) == qr.view(bits)
        name = "fp8" if dtype == FP8 else "int8"
        diffs[f"{name}_quant_mismatch"] = 1.0 - same.float().mean().item()
        deq = (q.float() * s - qr.float() * sr).abs().max() / x.float().abs().max()
        diffs[f"{name}_quant_max_rel"] = deq.item()
        if dtype == torch.int8 and not (same.all() and torch.equal(s, sr)):
            raise AssertionError(f"m={m}: act_quant int8 differs from the torch reference")
    dense = x @ ws["bf16"][0][0].t()
    f_new, f_old = fp8_new(x, *ws["fp8"][0]), fp8_old(x, *ws["fp8"][0])
    i_new, i_old = int8_new(x, *ws["int8"][0]), int8_old(x, *ws["int8"][0])
    exact = torch.equal(i_new, i_old)
    if (m > 16 and not exact) or rel(i_new, i_old) > 1e-2:
        raise AssertionError(f"m={m}: int8 GEMM differs from the old path: {rel(i_new, i_old)}")
    return dict(fp8_err=rel(f_new, dense), fp8_vs_old=rel(f_new, f_old), int8_err=rel(i_new, dense),
                int8_exact=exact, **diffs)  # fmt: skip


def time_path(fn, x: torch.Tensor, copies: list) -> float:
    return graph_replay_us(lambda: [fn(x, *c) for c in copies], calls=len(copies))


def measure(name: str, rows: list[int], sweep: bool, dev: torch.device) -> list[dict]:
    n, k = SHAPES[name]
    ws = weights(n, k, dev)
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        base = dict(shape=name, n=n, k=k, m=m, **check(x, ws, m))
        us = {"bf16": time_path(lambda x, w: x @ w.t(), x, ws["bf16"])}
        us["fp8"], us["fp8_old"] = (time_path(f, x, ws["fp8"]) for f in (fp8_new, fp8_old))
        us["int8"], us["int8_old"] = (time_path(f, x, ws["int8"]) for f in (int8_new, int8_old))
        print(json.dumps({**base, **{p: round(v, 2) for p, v in us.items()}}), flush=True)
        for path, v in us.items():
            out.append(record("w8a8_us", v, path=path, speedup_vs_bf16=us["bf16"] / v, **base))
        if sweep:
            out += sweep_int8(x, ws["int8"], base, us["bf16"])
    return out


def sweep_int8(x: torch.Tensor, copies: list, base: dict, bf16_us: float) -> list[dict]:
    default = pick_config(x.shape[0], *copies[0][0].shape)
    ref = int8_new(x, *copies[0])
    out = []
    for cfg in SWEEP:
        try:
            same = torch.equal(int8_new(x, *copies[0], cfg), ref)
            us = time_path(lambda x, w, s, cfg=cfg: int8_new(x, w, s, cfg), x, copies)
        except Exception as e:  # a tile that does not fit (shared memory) is reported, skipped
            print(f"{base['shape']} m={base['m']} {tuple(cfg)}: {type(e).__name__}", flush=True)
            continue
        if not same:
            raise AssertionError(f"{base['shape']} m={base['m']} {tuple(cfg)}: output differs")
        print(f"  {base['shape']} m={base['m']} {tuple(cfg)}: {us:.2f} us", flush=True)
        row = dict(base, path="int8_sweep", config=list(cfg), default=cfg == default)
        out.append(record("w8a8_us", us, speedup_vs_bf16=bf16_us / us, **row))
    return out


def measure_silu_mul(rows: list[int], dev: torch.device) -> list[dict]:
    """The down projection with its input activation: ``silu_and_mul`` then act_quant then the
    GEMM (``unfused``) against act_quant's ``silu_mul`` form then the GEMM (``fused``), for
    int8 and fp8; bf16 (the activation kernel, then cuBLAS) for scale. The fused outputs must
    equal the unfused ones bit for bit."""
    n, k = SHAPES["tp1 down"]
    ws = weights(n, k, dev)
    out = []
    for m in rows:
        gate_up = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
        paths = {
            "bf16": (lambda x, w: silu_and_mul(x) @ w.t(), ws["bf16"]),
            "int8_unfused": (lambda x, w, s: int8_new(silu_and_mul(x), w, s), ws["int8"]),
            "int8_fused": (int8_fused, ws["int8"]),
            "fp8_unfused": (lambda x, w, s: fp8_new(silu_and_mul(x), w, s), ws["fp8"]),
            "fp8_fused": (fp8_fused, ws["fp8"]),
        }
        for dtype in ("int8", "fp8"):
            fused = paths[f"{dtype}_fused"][0](gate_up, *ws[dtype][0])
            if not torch.equal(fused, paths[f"{dtype}_unfused"][0](gate_up, *ws[dtype][0])):
                raise AssertionError(f"m={m}: {dtype} fused activation quantization differs")
        us = {p: time_path(fn, gate_up, copies) for p, (fn, copies) in paths.items()}
        print(json.dumps({"silu_mul_down": m, **{p: round(v, 2) for p, v in us.items()}}))
        base = dict(shape="tp1 down with silu_mul", n=n, k=k, m=m, bit_identical=True)
        for path, v in us.items():
            out.append(record("w8a8_silu_mul_down_us", v, path=path, **base))
    return out


def int8_fused(x, w, sw):  # [T, 2K] bf16 gate_up, [N, K] int8, [N] float32
    qx, sx = act_quant(x, torch.int8, silu_mul=True)
    return int8_gemm(qx, w, sx, sw, x.dtype)


def fp8_fused(x, w, sw):  # [T, 2K] bf16 gate_up, [N, K] fp8, [1, N] float32
    qx, sx = act_quant(x, FP8, silu_mul=True)
    return scaled_mm_rowwise(qx, w, sx, sw, x.dtype)


def summarize(rows: list[dict]) -> None:
    print("\nshape           m   bf16 us   fp8 (old)          int8 (old)        x bf16 fp8 int8")
    for r in rows:
        if r["path"] != "bf16":
            continue
        got = {q["path"]: q["value"] for q in rows if (q["shape"], q["m"]) == (r["shape"], r["m"])}
        b = got["bf16"]
        print(f"{r['shape']:12} {r['m']:5} {b:9.1f} {got['fp8']:8.1f} ({got['fp8_old']:7.1f}) "
              f"{got['int8']:8.1f} ({got['int8_old']:7.1f}) "
              f"{b / got['fp8']:9.2f} {b / got['int8']:4.2f}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 2048, 8192])
    ap.add_argument("--sweep", action="store_true", help="also time the int8 GEMM's tiles")
    ap.add_argument("--silu-mul-only", action="store_true",
                    help="only the down projection with its activation, fused and not")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    rows = []
    if not args.silu_mul_only:
        rows = [r for name in SHAPES for r in measure(name, args.rows, args.sweep, dev)]
        summarize(rows)
    rows += measure_silu_mul(args.rows, dev)
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
