"""GGUF block kernels (lightwell/kernels/gguf_dequant.py) on the GPU at llama-3-8b's shapes:
every type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) checked on random blocks (random bytes, sane
fp16 scales), then timed: the GEMV at 1, 4 and 8 rows beside cuBLAS on the bf16 weight, the
dequantize kernel's bandwidth, and the >8-token path (dequantize + cuBLAS) at 16, 32 and 64
rows beside the GEMV run on each 8 rows (where the two cross).

    run(command="python3 -m benchmarks.workloads.gguf_gpu --out $OUT/gguf_gpu.json")  # ~5 min
    [--rows 1 4 8] [--types Q4_K Q6_K]
    [--sweep: the GEMV's tiles at one row on 4096x4096, 4 min more]

Checks: the dequantize kernel in fp32 bit-exact against the torch reference (gguf-py's
arithmetic, run on the GPU) and, where the ``gguf`` package imports, against gguf-py itself on
the first 512 rows (the GPU image has no ``gguf``: carry scripts/fetch_gpu_wheels.sh's .whl and
install it first, see its header); the GEMV in bf16 within 1e-2 of the fp32 matmul.

Timing: a CUDA graph cycling through enough copies of the weights (>= 200 MB) that no launch
finds them in L2; median of 20 replays; µs a call and the blocks' bytes a second (dequantize:
the blocks read plus the bf16 weight written).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels import gguf_dequant as gd
from lightwell.quant.gguf_cuda import gguf_linear

SHAPES = {"o 4096x4096": (4096, 4096), "gate 14336x4096": (14336, 4096),
          "down 4096x14336": (4096, 14336)}  # fmt: skip
NAMES = {gd.Q4_0: "Q4_0", gd.Q4_1: "Q4_1", gd.Q8_0: "Q8_0", gd.Q4_K: "Q4_K", gd.Q5_K: "Q5_K",
         gd.Q6_K: "Q6_K"}  # fmt: skip
# where each type keeps its fp16 scales (d, and m / dmin where it has one)
SCALES = {gd.Q4_0: (0,), gd.Q4_1: (0, 2), gd.Q8_0: (0,), gd.Q4_K: (0, 2), gd.Q5_K: (0, 2),
          gd.Q6_K: (208,)}  # fmt: skip
MIN_BYTES = 200 << 20


def random_blocks(n: int, k: int, qtype: int, dev: torch.device) -> torch.Tensor:  # [N, B]
    values, nbytes = gd.BLOCKS[qtype]
    blocks = torch.randint(0, 256, (n, k // values, nbytes), dtype=torch.uint8, device=dev)
    for off in SCALES[qtype]:
        scale = torch.rand(n, k // values, device=dev) * 3e-3 + 1e-3
        scale = torch.where(torch.rand_like(scale) < 0.5, -scale, scale).half()
        blocks[:, :, off : off + 2] = scale.view(torch.uint8).view(n, k // values, 2)
    return blocks.view(n, -1)


def gguf_py_rows(w: torch.Tensor, qtype: int, rows: int = 512) -> torch.Tensor | None:
    """gguf-py's dequantize of the first rows (fp32, on the GPU), or None without ``gguf``."""
    try:
        import numpy as np
        from gguf import GGMLQuantizationType, dequantize
    except ImportError:
        return None
    out = dequantize(w[:rows].cpu().numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(w.device)


def check(w: torch.Tensor, qtype: int) -> dict:
    """Fail unless the kernels agree with the references; the checks' figures."""
    ref = gd.gguf_dequantize_ref(w, qtype)
    out = gd.gguf_dequantize(w, qtype, torch.float32)
    if not torch.equal(out, ref):
        bad = (out != ref).sum().item()
        raise AssertionError(f"{NAMES[qtype]}: dequantize differs from the reference at {bad}")
    py = gguf_py_rows(w, qtype)
    if py is not None and not torch.equal(out[: py.shape[0]], py):
        raise AssertionError(f"{NAMES[qtype]}: dequantize differs from gguf-py")
    x = torch.randn(8, w.shape[1] // gd.BLOCKS[qtype][1] * gd.BLOCKS[qtype][0], device=w.device)
    err = rel_err(gd.gguf_gemv(x.bfloat16(), w, qtype), x.bfloat16().float() @ ref.T)
    if err > 1e-2:
        raise AssertionError(f"{NAMES[qtype]}: GEMV relative error {err:.3g}")
    return {"exact_vs_ref": True, "exact_vs_gguf_py": None if py is None else True,
            "gemv_rel_err": err}  # fmt: skip


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def block_bytes(n: int, k: int, qtype: int) -> int:
    values, nbytes = gd.BLOCKS[qtype]
    return n * k // values * nbytes


def copies(nbytes: int) -> int:
    return max(2, -(-MIN_BYTES // nbytes))


def cublas_us(x: torch.Tensor, n: int, k: int) -> float:
    dense = [torch.randn(n, k, device=x.device, dtype=torch.bfloat16) / 64
             for _ in range(copies(n * k * 2))]  # fmt: skip
    return graph_replay_us(lambda: [x @ w.t() for w in dense], calls=len(dense))


def measure(qtype: int, shape: str, rows: list[int], dev: torch.device) -> list[dict]:
    n, k = SHAPES[shape]
    ws = [random_blocks(n, k, qtype, dev) for _ in range(copies(block_bytes(n, k, qtype)))]
    nbytes = ws[0].numel()
    base = dict(qtype=NAMES[qtype], shape=shape, n=n, k=k, bytes=nbytes, **check(ws[0], qtype))
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        us = graph_replay_us(lambda x=x: [gd.gguf_gemv(x, w, qtype) for w in ws], calls=len(ws))
        row = dict(base, m=m, gb_s=nbytes / us / 1e3, cublas_bf16_us=cublas_us(x, n, k))
        out.append(_emit("gguf_gemv_us", us, row))
    buf = torch.empty(n, k, device=dev, dtype=torch.bfloat16)
    us = graph_replay_us(lambda: [gd.gguf_dequantize(w, qtype, out=buf) for w in ws], len(ws))
    out.append(_emit("gguf_dequant_us", us, dict(base, gb_s=(nbytes + 2 * n * k) / us / 1e3)))
    return out + crossover(qtype, ws, base, dev)


def crossover(qtype: int, ws: list[torch.Tensor], base: dict, dev: torch.device) -> list[dict]:
    """Past 8 tokens: the product's path (dequantize + cuBLAS) beside the GEMV run on each 8
    rows in turn (which reads the blocks once per 8 rows), at 16, 32 and 64 rows."""
    out = []
    for m in (16, 32, 64):
        x = torch.randn(m, base["k"], device=dev, dtype=torch.bfloat16)
        us = graph_replay_us(lambda x=x: [gguf_linear([(qtype, w)], x, None) for w in ws], len(ws))
        chunks = graph_replay_us(
            lambda x=x: [
                gd.gguf_gemv(x[i : i + 8], w, qtype) for w in ws for i in range(0, len(x), 8)
            ],
            calls=len(ws),
        )
        row = dict(
            base, m=m, gemv_by_8_us=chunks, cublas_bf16_us=cublas_us(x, base["n"], base["k"])
        )
        out.append(_emit("gguf_linear_us", us, row))
    return out


def _emit(metric: str, us: float, row: dict) -> dict:
    print(json.dumps({"metric": metric, "us": round(us, 2), **row}), flush=True)
    return record(metric, us, **row)


# (BLOCK_N, sub-blocks a K step, warps): 8 to 64 weights (and accumulators) a thread
TILES = [(bn, s, wp) for bn in (1, 2, 4, 8, 16) for s in (2, 4, 8, 16) for wp in (1, 2, 4)
         if 8 <= bn * s * 32 // (32 * wp) <= 64]  # fmt: skip


def sweep(types: list[int], dev: torch.device, budget_s: float) -> list[dict]:
    """The GEMV's tiles (BLOCK_N, sub-blocks a step, warps) at one row on 4096x4096, each type
    a share of the budget."""
    out = []
    for qtype in types:
        out += sweep_type(qtype, dev, time.time() + budget_s / len(types))
    return out


def sweep_type(qtype: int, dev: torch.device, deadline: float) -> list[dict]:
    n, k = SHAPES["o 4096x4096"]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ws = [random_blocks(n, k, qtype, dev) for _ in range(copies(block_bytes(n, k, qtype)))]
    ref = x.float() @ gd.gguf_dequantize_ref(ws[0], qtype).T
    out = []
    for cfg in TILES:
        if time.time() > deadline:
            break
        err = rel_err(gd.gguf_gemv(x, ws[0], qtype, config=cfg), ref)
        us = graph_replay_us(
            lambda c=cfg: [gd.gguf_gemv(x, w, qtype, config=c) for w in ws], calls=len(ws)
        )
        row = dict(qtype=NAMES[qtype], n=n, k=k, m=1, config=list(cfg), rel_err=err)
        out.append(_emit("gguf_gemv_sweep_us", us, dict(row, gb_s=ws[0].numel() / us / 1e3)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--types", nargs="+", default=list(NAMES.values()), help="e.g. Q4_K Q6_K")
    ap.add_argument("--sweep", action="store_true", help="also sweep the GEMV's tiles")
    ap.add_argument("--budget-s", type=float, default=240.0, help="the sweep's time budget")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    types = [q for q, name in NAMES.items() if name in args.types]
    rows = [r for q in types for shape in SHAPES for r in measure(q, shape, args.rows, dev)]
    if args.sweep:
        rows += sweep(types, dev, args.budget_s)
    summarize(rows)
    if args.out:
        write_json(args.out, rows)
    return 0


def summarize(rows: list[dict]) -> None:
    print("\ntype  shape             m  GEMV us  GB/s  cuBLAS bf16 us | dequant us  GB/s")
    for r in rows:
        if r["metric"] == "gguf_gemv_us":
            print(f"{r['qtype']:5} {r['shape']:16} {r['m']:2} {r['value']:8.2f} "
                  f"{r['gb_s']:5.0f} {r['cublas_bf16_us']:14.2f}")  # fmt: skip
        elif r["metric"] == "gguf_dequant_us":
            print(f"{r['qtype']:5} {r['shape']:16}{'':44} {r['value']:9.2f} {r['gb_s']:5.0f}")
        elif r["metric"] == "gguf_linear_us":
            print(
                f"{r['qtype']:5} {r['shape']:16} {r['m']:2} dequant+cuBLAS {r['value']:8.2f}, "
                f"GEMV by 8 rows {r['gemv_by_8_us']:8.2f}, cuBLAS bf16 {r['cublas_bf16_us']:8.2f}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
