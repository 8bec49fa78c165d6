"""W8A8 input quantization fused into RMSNorm and SiLU-and-mul (lightwell/kernels/
act_quant_fused.py) against the separate launches it replaces (the op in bf16, then
``act_quant``), at llama-3-8b's sizes: the norm (plain and with its residual add) over 4,096
hidden, SiLU-and-mul over 14,336 intermediate, 1 / 64 / 8,192 tokens, fp8 and int8, dynamic
per-token scales (static checked too). One device call of about a minute:

    run(command="python3 -m benchmarks.kernels.act_quant_fused --out $OUT/act_quant_fused.json")

Checked first, for every case: the fused kernel's 8-bit values, scales (and new residual) equal
the separate launches' bit for bit, and so do the layers' outputs (``RMSNorm`` / ``SiluAndMul``
with an ``InputQuant``, as the decoder layers call them); a mismatch stops the script. Timing:
µs a call, a CUDA graph of the calls (cycling through enough input copies, >= 200 MB, that no
call finds its input in L2), median of 20 replays; ``bf16_op_us`` is the op alone (no
quantization), for scale.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record, write_json
from lightwell.kernels.act_quant import act_quant
from lightwell.kernels.act_quant_fused import rmsnorm_quant, silu_and_mul_quant
from lightwell.kernels.activation import silu_and_mul
from lightwell.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from lightwell.layers.activation import SiluAndMul
from lightwell.layers.norm import RMSNorm
from lightwell.quant.input_quant import InputQuant

FP8 = torch.float8_e4m3fn
HIDDEN, INTER = 4096, 14336
MIN_BYTES = 200 << 20
EPS = 1e-5


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view(torch.uint8) if t.dtype == FP8 else t


def same(name: str, got: tuple, ref: tuple) -> None:
    for a, b in zip(got, ref):
        if not (a is None and b is None) and not torch.equal(bits(a), bits(b)):
            raise AssertionError(f"{name}: the fused kernel differs from the separate launches")


def norm_paths(residual: bool, out: torch.dtype, static: torch.Tensor | None):
    """(fused, separate, bf16 op alone) for one (x, res, w) input."""

    def fused(x, res, w):
        return rmsnorm_quant(x, res if residual else None, w, EPS, out, static)

    def separate(x, res, w):
        if residual:
            normed, new_res = fused_add_rmsnorm(x, res, w, EPS)
        else:
            normed, new_res = rmsnorm(x, w, EPS), None
        return (*act_quant(normed, out, static), new_res)

    def op(x, res, w):
        return fused_add_rmsnorm(x, res, w, EPS) if residual else rmsnorm(x, w, EPS)

    return fused, separate, op


def silu_paths(out: torch.dtype, static: torch.Tensor | None):
    def fused(x):
        return silu_and_mul_quant(x, out, static)

    def separate(x):
        return act_quant(silu_and_mul(x), out, static)

    return fused, separate, silu_and_mul


def check_layers(x, res, w, gate_up, out: torch.dtype, static) -> None:
    """The layers as the decoder layers call them against their unfused calls."""
    norm = RMSNorm(HIDDEN, EPS).to(x.device, w.dtype)
    norm.weight.data.copy_(w)
    quant = InputQuant(out, static)
    qi, new_res = norm(x, res, quant)
    normed, ref_res = norm(x, res)
    same("RMSNorm layer", (qi.q, qi.scale, new_res), (*act_quant(normed, out, static), ref_res))
    qi = SiluAndMul()(gate_up, quant)
    same("SiluAndMul layer", (qi.q, qi.scale), act_quant(SiluAndMul()(gate_up), out, static))


def inputs(t: int, width: int, n: int, dev) -> list[torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(t + width)
    return [torch.randn(t, width, device=dev, dtype=torch.bfloat16, generator=gen) * 2
            for _ in range(n)]  # fmt: skip


def copies(t: int, width: int) -> int:
    return max(1, min(64, -(-MIN_BYTES // (t * width * 2))))


def measure(t: int, dev) -> list[dict]:
    rows = []
    n = copies(t, HIDDEN)
    xs, rs = inputs(t, HIDDEN, n, dev), inputs(t + 1, HIDDEN, n, dev)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).to(torch.bfloat16)
    gus = inputs(t, 2 * INTER, copies(t, 2 * INTER), dev)
    for out in (FP8, torch.int8):
        for static in (None, torch.tensor(0.05, device=dev)):
            check_layers(xs[0], rs[0], w, gus[0], out, static)
            for residual in (False, True):
                f, s, _ = norm_paths(residual, out, static)
                same(f"norm t={t}", f(xs[0], rs[0], w), s(xs[0], rs[0], w))
            f, s, _ = silu_paths(out, static)
            same(f"silu t={t}", f(gus[0]), s(gus[0]))
        for residual in (False, True):
            paths = norm_paths(residual, out, None)
            us = [graph_replay_us(lambda p=p: [p(x, r, w) for x, r in zip(xs, rs)], calls=n)
                  for p in paths]  # fmt: skip
            op = "fused_add_rmsnorm" if residual else "rmsnorm"
            rows.append(row(op, out, t, HIDDEN, *us))
        paths = silu_paths(out, None)
        us = [graph_replay_us(lambda p=p: [p(x) for x in gus], calls=len(gus)) for p in paths]
        rows.append(row("silu_and_mul", out, t, INTER, *us))
    return rows


def row(op: str, out: torch.dtype, t: int, width: int, fused: float, sep: float, bf16: float):
    name = "fp8" if out == FP8 else "int8"
    fields = dict(
        op=op, quant=name, tokens=t, width=width, separate_us=round(sep, 2),
        bf16_op_us=round(bf16, 2), speedup=sep / fused, checked="bit-identical",
    )  # fmt: skip
    print(json.dumps({"fused_us": round(fused, 2), **fields}), flush=True)
    return record("act_quant_fused_us", fused, **fields)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as a JSON results file")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    rows = [r for t in args.tokens for r in measure(t, dev)]
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
