"""DeepSeek-V2-Lite's MoE decode block with its shared experts in the routed launches
(``fused_moe(..., num_shared=2)``: 2 launches) against the routed experts plus a separate shared
MLP (one token: GEMV gate/up, GEMV down with silu * up fused, add: 5 launches; more: cuBLAS,
the activation, cuBLAS, add), bf16, at 1, 2, 4 and 8 tokens (64 routed experts of 1408 + 2
shared, top-6, hidden 2048). One command:

    python3 -m benchmarks.kernels.moe_shared --out $OUT/moe_shared.json

Each path is checked first against ``fused_moe_ref`` over the routed choices plus the shared
experts (largest error over the largest value < 2e-2). Timing: CUDA graphs cycling through
enough copies of the layer's experts that no launch finds its weights in L2 (as
benchmarks/kernels/moe_decode.py), median of 20 replays (benchmarks/kernels/timing.py).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.kernels.blas import MIN_BYTES
from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import record
from lightwell.kernels.activation import silu_and_mul
from lightwell.kernels.fused_moe import fused_moe, fused_moe_ref
from lightwell.kernels.gemv import gemv

EXPERTS, TOP_K, SHARED, HIDDEN, INTER = 64, 6, 2, 2048, 1408
TOL = 2e-2
DEVICE = "cuda"


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def separate(x, copy, weights, ids) -> torch.Tensor:  # [T, H]
    """The routed experts, then the shared MLP as one [2 * S * I, H] / [H, S * I] pair (the
    model's path without the fold: GEMV kernels for one token, cuBLAS for more)."""
    w13, w2, gate_up, down = copy
    routed = fused_moe(x, w13[:EXPERTS], w2[:EXPERTS], weights, ids)
    if x.shape[0] == 1:
        return routed + gemv(gemv(x, gate_up), down, silu_mul=True)
    return routed + F.linear(silu_and_mul(F.linear(x, gate_up)), down)


def run(tokens: int, copies: list) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, EXPERTS, device=DEVICE, generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    w13, w2 = copies[0][:2]
    want = fused_moe_ref(x, w13, w2, weights, ids, num_shared=SHARED)
    folded_err = _err(fused_moe(x, w13, w2, weights, ids, num_shared=SHARED), want)
    separate_err = _err(separate(x, copies[0], weights, ids), want)
    if not (folded_err < TOL and separate_err < TOL):
        raise AssertionError(f"T={tokens}: errors {folded_err:.3g}, {separate_err:.3g}")

    def folded_calls():
        for a, b, _, _ in copies:
            fused_moe(x, a, b, weights, ids, num_shared=SHARED)

    def separate_calls():
        for copy in copies:
            separate(x, copy, weights, ids)

    folded_us = graph_replay_us(folded_calls, calls=len(copies))
    separate_us = graph_replay_us(separate_calls, calls=len(copies))
    print(f"T={tokens}: folded {folded_us:.1f} us, separate {separate_us:.1f} us", flush=True)
    return record("moe_shared_folded_us", folded_us, tokens=tokens,
                  separate_us=round(separate_us, 1), speedup=round(separate_us / folded_us, 3),
                  folded_rel_err=round(folded_err, 5),
                  separate_rel_err=round(separate_err, 5), weight_copies=len(copies),
                  shape=dict(experts=EXPERTS, top_k=TOP_K, shared=SHARED, hidden=HIDDEN,
                             inter=INTER))  # fmt: skip


def weight_copies() -> list:
    """(w13, w2, shared gate_up, shared down) copies, 200 MB of chosen weights each pass."""
    n = max(2, -(-MIN_BYTES // ((TOP_K + SHARED) * 3 * HIDDEN * INTER * 2)))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out = []
    for _ in range(n):
        w13 = torch.randn(EXPERTS + SHARED, 2 * INTER, HIDDEN, device=DEVICE, generator=gen,
                          dtype=torch.bfloat16).mul_(0.02)  # fmt: skip
        w2 = torch.randn(EXPERTS + SHARED, HIDDEN, INTER, device=DEVICE, generator=gen,
                         dtype=torch.bfloat16).mul_(0.02)  # fmt: skip
        gate_up = w13[EXPERTS:].view(SHARED, 2, INTER, HIDDEN).transpose(0, 1)
        down = w2[EXPERTS:].permute(1, 0, 2).reshape(HIDDEN, SHARED * INTER)
        out.append((w13, w2, gate_up.reshape(2 * SHARED * INTER, HIDDEN), down))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    copies = weight_copies()
    rows = [run(tokens, copies) for tokens in (1, 2, 4, 8)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
