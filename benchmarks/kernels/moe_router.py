"""The fused MoE router kernel (lightwell/kernels/moe_router.py) against the torch routing it
replaces (lightwell/layers/moe.py's ``select_experts_ref``: 6-10 small launches), at 1 and 64
tokens, on the routers of Mixtral-8x7B (8 experts, top-2, renormalised, bf16 logits),
Qwen3-30B-A3B (128, top-8, renormalised, bf16), DeepSeek-V2-Lite (64, top-6, greedy, fp32),
DeepSeek-V2 (160, top-6, 8 groups, best 3 by their max, fp32) and DeepSeek-V3 (256, top-8,
sigmoid + correction bias, 8 groups, best 4 by their top-2 sum, fp32). One device call of well
under a minute:

    run(command="python3 -m benchmarks.kernels.moe_router --out $OUT/moe_router.json")

Each kernel result is checked against the torch routing first (the same ids in the same order,
weights within 1e-5). Times: both replayed from a CUDA graph that calls the router 32 times (as
a decode step's layers do), µs per call, median of 20 replays (benchmarks/kernels/timing.py).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.kernels.moe_router import moe_router
from lightwell.layers.moe import RouterConfig, select_experts_ref

V2 = RouterConfig(6, False, "softmax", 8, 3, "max", 16.0)  # group_limited_greedy
V3 = RouterConfig(8, True, "sigmoid", 8, 4, "top2", 2.5)  # noaux_tc
# name: (experts, RouterConfig, correction bias, logits dtype)
ROUTERS = {
    "mixtral-8x7b": (8, RouterConfig(2, renormalize=True), False, torch.bfloat16),
    "qwen3-30b-a3b": (128, RouterConfig(8, renormalize=True), False, torch.bfloat16),
    "deepseek-v2-lite": (64, RouterConfig(6), False, torch.float32),
    "deepseek-v2": (160, V2, False, torch.float32),
    "deepseek-v3": (256, V3, True, torch.float32),
}
TOKENS = (1, 64)
CALLS = 32  # router calls per graph replay


def _kernel(logits: torch.Tensor, router: RouterConfig, bias: torch.Tensor | None):
    return moe_router(
        logits, router.top_k, bias, renormalize=router.renormalize, scoring=router.scoring,
        num_groups=router.num_groups, topk_groups=router.topk_groups,
        group_score=router.group_score, scaling=router.scaling,
    )  # fmt: skip


def bench(name: str, tokens: int, common: dict) -> dict:
    experts, router, with_bias, dtype = ROUTERS[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    perm = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(-1)  # [T, E]
    logits = ((perm - experts // 2) * (8 / experts)).to(dtype)  # distinct, exact in bf16: no ties
    bias = 0.1 * torch.randn(experts, device="cuda", generator=gen) if with_bias else None
    want_w, want_ids = select_experts_ref(logits, router, bias)
    got_w, got_ids = _kernel(logits, router, bias)
    ids_equal = torch.equal(got_ids, want_ids)
    max_err = (got_w - want_w).abs().max().item()
    if not ids_equal or max_err > 1e-5:
        raise SystemExit(f"{name} T={tokens}: ids equal {ids_equal}, weight error {max_err:.2e}")

    def run(fn):
        return lambda: [fn(logits, router, bias) for _ in range(CALLS)]

    kernel_us = graph_replay_us(run(_kernel), calls=CALLS)
    torch_us = graph_replay_us(run(select_experts_ref), calls=CALLS)
    row = dict(router=name, tokens=tokens, experts=experts, top_k=router.top_k)
    row.update(weight_err=max_err, kernel_graph_us=round(kernel_us, 2))
    row.update(torch_graph_us=round(torch_us, 2), speedup=round(torch_us / kernel_us, 2))
    print(row, flush=True)
    return make_record("moe_router_graph_us", kernel_us, common, **row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated names")
    args = parser.parse_args()
    common = {**provenance("cuda"), "command": script_command()}
    rows = [bench(name, t, common) for name in args.routers.split(",") for t in TOKENS]
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
