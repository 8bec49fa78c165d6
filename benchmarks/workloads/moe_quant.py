"""Quantized MoE experts on the GPU: the fused Triton kernels (lightwell/kernels/fused_moe.py's
grouped GEMMs, and the few-token GEMV path of kernels/moe_gemv_quant.py) over block-FP8 experts
(DeepSeek-V3/R1: H 7168, I 2048, 256 experts top-8, [128, 128] blocks; fp8 activations per
128 inputs on the grouped path, as ``Fp8BlockExperts`` runs them), GPTQ int4 experts
(Mixtral-8x7B: H 4096, I 14336, 8 experts top-2, group 128, symmetric) and Mixtral's experts in
fp8 with one scale a row (compressed-tensors' channel strategy and ``--quantization fp8``, run
as quant/experts.py's ``ScaledExperts`` runs them: ``fused_moe.ROW`` scales, weight-only on the
GEMV path, fp8 activations on the grouped path), at 1, 64 and 2048 tokens, against the bf16
kernels on the same (dequantized) weights. One device call, a few minutes:

    run(command="python3 -m benchmarks.workloads.moe_quant --out $OUT/moe_quant.json")

``--sweep`` times instead the grouped path of the fp8 shapes' experts with fp8 activations
(``w8a8``) over row blocks and tiles at 16 to 8,192 tokens (``fused_moe.w8a8_tiles``' table),
against the bf16 kernels and the weight-only fp8 path:

    run(command="python3 -m benchmarks.workloads.moe_quant --sweep --shapes mixtral-fp8,deepseek "
        "--out $OUT/moe_quant_sweep.json")

Each result is checked first against the torch reference that runs on CPU (``moe_loop_by``
dequantizing each used expert, fp32): the largest error relative to the output's largest value,
for the quantized kernels and for the bf16 ones on the dequantized weights (bf16 rounding of x,
act and the output bounds both at about 1e-2; fp8 activations, e4m3's 3-bit mantissa, at about
6e-2). Times: CUDA events, median of 20 after 3 warm-up
runs, replayed from a CUDA graph; the expert weight bytes each path reads (the chosen experts')
over its time. ``--experts N`` builds fewer DeepSeek experts (the routing stays top-8 of them).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.kernels.timing import graph_replay_us
from lightwell.bench.results import make_record, provenance, script_command, write_json
from lightwell.kernels.fused_moe import (
    ROW,
    dequantize_experts,
    dequantize_int4_experts,
    fused_moe,
)
from lightwell.layers.moe import moe_loop_by

TOKENS = (1, 64, 2048)
BLOCK = (128, 128)
DEEPSEEK = dict(hidden=7168, inter=2048, top_k=8)
MIXTRAL = dict(experts=8, hidden=4096, inter=14336, top_k=2, group=128)
DEVICE = "cuda"


def fp8_experts(e: int, n: int, k: int, gen: torch.Generator, block=BLOCK):
    """[E, N, K] fp8 (built an expert at a time) and [E, N / bn, K / bk] scales."""
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=DEVICE)
    for i in range(e):
        w = torch.randn(n, k, device=DEVICE, generator=gen) * 64
        q[i] = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(e, -(-n // block[0]), -(-k // block[1]), device=DEVICE, generator=gen) + 0.5
    return q, s * (0.02 / 64)


def channel_scales(e: int, n: int, gen: torch.Generator):
    """[E, N, 1]: one scale per row, as compressed-tensors' channel-scaled fp8 experts run
    (quant/experts.py's ``ScaledExperts``: ``fused_moe.ROW`` blocks)."""
    return (torch.rand(e, n, 1, device=DEVICE, generator=gen) + 0.5) * (0.02 / 64)


def int4_experts(e: int, n: int, k: int, group: int, gen: torch.Generator):
    """[E, N, K / 8] random words, [E, N, K / g] bf16 scales, zeros 8 (symmetric GPTQ)."""
    words = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), device=DEVICE, generator=gen,
                          dtype=torch.int32)  # fmt: skip
    scales = (torch.rand(e, n, k // group, device=DEVICE, generator=gen) + 0.5) * 0.005
    return words, scales.bfloat16(), torch.full_like(scales, 8.0).bfloat16()


def _stacked(expert, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's dequantized weights in bf16 ([E, 2I, H], [E, H, I]), an expert at a time
    (the bf16 kernels' weights)."""
    first = expert(0)
    out = [torch.empty(num_experts, *w.shape, dtype=torch.bfloat16, device=DEVICE) for w in first]
    for e in range(num_experts):
        for dst, w in zip(out, expert(e)):
            dst[e] = w
    return out[0], out[1]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return round(((got.float() - want).abs().max() / want.abs().max()).item(), 6)


def _case(name, tokens, quant, deq, ref, bytes_used, common) -> dict:
    """Check and time one (shape, tokens): quant(x) and the bf16 kernels on deq weights."""
    x, weights, ids = quant["inputs"]
    run_q = lambda: fused_moe(x, *quant["weights"], weights, ids, **quant["kwargs"])  # noqa: E731
    run_b = lambda: fused_moe(x, *deq, weights, ids)  # noqa: E731
    row = dict(shape=name, tokens=tokens, experts_used=ids.unique().numel(),
               rel_err_quant=_err(run_q(), ref), rel_err_bf16=_err(run_b(), ref))  # fmt: skip
    q_us, b_us = graph_replay_us(run_q), graph_replay_us(run_b)
    row.update(quant_graph_us=round(q_us, 1), bf16_graph_us=round(b_us, 1),
               speedup=round(b_us / q_us, 3),
               quant_weight_gbps=round(bytes_used[0] / q_us / 1e3, 1),
               bf16_weight_gbps=round(bytes_used[1] / b_us / 1e3, 1))  # fmt: skip
    print(row, flush=True)
    return make_record("moe_quant_graph_us", q_us, common, **row)


def _route(tokens, experts, top_k, hidden, gen):
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, experts, device=DEVICE, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, weights, ids


def deepseek_fp8(experts: int, common: dict) -> list[dict]:
    hidden, inter, top_k = DEEPSEEK["hidden"], DEEPSEEK["inter"], DEEPSEEK["top_k"]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13, s13 = fp8_experts(experts, 2 * inter, hidden, gen)
    w2, s2 = fp8_experts(experts, hidden, inter, gen)
    name = f"deepseek-v3-fp8-e{experts}"
    return _fp8_rows(name, (w13, s13, w2, s2), BLOCK, top_k, gen, common, dict(w8a8=True))


def mixtral_fp8_channel(common: dict) -> list[dict]:
    experts, hidden, inter, top_k, _ = MIXTRAL.values()
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    w13 = fp8_experts(experts, 2 * inter, hidden, gen)[0]
    w2 = fp8_experts(experts, hidden, inter, gen)[0]
    s13 = channel_scales(experts, 2 * inter, gen)
    s2 = channel_scales(experts, hidden, gen)
    name = "mixtral-8x7b-fp8-channel"
    return _fp8_rows(name, (w13, s13, w2, s2), ROW, top_k, gen, common, dict(w8a8=True))


def sweep_w8a8(shapes: list[str], experts_v3: int, common: dict) -> list[dict]:
    """The grouped path of fp8 experts with fp8 activations (``w8a8``) at each (tokens, row
    block, tile), against the bf16 kernels (weights uninitialised: times only): Mixtral's
    row-scaled experts (``mixtral-fp8``) and DeepSeek-V3's block experts (``deepseek``)."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    cases = []
    if "mixtral-fp8" in shapes:
        experts, hidden, inter, top_k, _ = MIXTRAL.values()
        s13 = channel_scales(experts, 2 * inter, gen)
        s2 = channel_scales(experts, hidden, gen)
        quant = dict(scales=(s13, s2, ROW), w8a8=True)
        plan = {16: (16, 32), 64: (16, 32), 256: (32, 64, 128), 512: (64, 128),
                1024: (64, 128), 2048: (128,), 4096: (128,)}  # fmt: skip
        cases.append(("mixtral-8x7b-fp8-channel", experts, hidden, inter, top_k, quant, plan))
    if "deepseek" in shapes:
        hidden, inter, top_k = DEEPSEEK["hidden"], DEEPSEEK["inter"], DEEPSEEK["top_k"]
        s13 = torch.rand(experts_v3, 2 * inter // 128, hidden // 128, device=DEVICE) * 1e-3
        s2 = torch.rand(experts_v3, hidden // 128, inter // 128, device=DEVICE) * 1e-3
        quant = dict(scales=(s13, s2, BLOCK), w8a8=True)
        plan = {64: (16, 32), 512: (16, 32, 64), 2048: (32, 64, 128), 8192: (64, 128)}
        cases.append((f"deepseek-v3-fp8-e{experts_v3}", experts_v3, hidden, inter, top_k, quant,
                      plan))  # fmt: skip
    tiles = [(64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4)]
    rows = []
    for name, experts, hidden, inter, top_k, quant, plan in cases:
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn, device=DEVICE)
        w2 = torch.empty(experts, hidden, inter, dtype=torch.float8_e4m3fn, device=DEVICE)
        deq = [torch.empty(w.shape, dtype=torch.bfloat16, device=DEVICE) for w in (w13, w2)]
        for tokens, blocks in plan.items():
            route = _route(tokens, experts, top_k, hidden, gen)
            b_us = graph_replay_us(partial(fused_moe, route[0], *deq, *route[1:], gemv=False))
            weight_only = {k: v for k, v in quant.items() if k != "w8a8"}
            w_us = graph_replay_us(
                partial(fused_moe, route[0], w13, w2, *route[1:], gemv=False, **weight_only)
            )
            for block_m, (bn, bk, warps, stages) in ((m, t) for m in blocks for t in tiles):
                tile = dict(block_m=block_m, block_n=bn, block_k=bk, num_warps=warps,
                            num_stages=stages)  # fmt: skip
                run = partial(fused_moe, route[0], w13, w2, *route[1:], gemv=False, **quant,
                              **tile)  # fmt: skip
                us = graph_replay_us(run)
                row = dict(shape=f"{name}-w8a8-sweep", tokens=tokens, **tile,
                           bf16_graph_us=round(b_us, 1), weight_only_graph_us=round(w_us, 1),
                           speedup=round(b_us / us, 3))  # fmt: skip
                print({**row, "us": round(us, 1)}, flush=True)
                rows.append(make_record("moe_quant_sweep_us", us, common, **row))
        del w13, w2, deq
        torch.cuda.empty_cache()
    return rows


def _fp8_rows(name: str, stack: tuple, block, top_k: int, gen, common: dict,
              extra: dict | None = None) -> list[dict]:  # fmt: skip
    """Each of TOKENS through fp8 experts ``stack`` = (w13, s13, w2, s2) with ``block``
    scales (and ``extra`` fused_moe arguments), against the bf16 kernels on the dequantized
    weights."""
    w13, s13, w2, s2 = stack
    experts, hidden, inter = w2.shape

    def expert(e: int):  # ([2I, H], [H, I]) fp32
        one = slice(e, e + 1)
        return (dequantize_experts(w13[one], s13[one], block)[0],
                dequantize_experts(w2[one], s2[one], block)[0])  # fmt: skip

    deq = _stacked(expert, experts)

    rows = []
    for tokens in TOKENS:
        x, weights, ids = _route(tokens, experts, top_k, hidden, gen)
        used = ids.unique().numel() * 3 * hidden * inter
        quant = dict(inputs=(x, weights, ids), weights=(w13, w2),
                     kwargs=dict(scales=(s13, s2, block), **(extra or {})))  # fmt: skip
        ref = moe_loop_by(x.float(), expert, experts, weights, ids)  # the CPU path, fp32
        rows.append(_case(name, tokens, quant, deq, ref, (used, 2 * used), common))
    return rows


def mixtral_gptq(common: dict) -> list[dict]:
    experts, hidden, inter, top_k, group = MIXTRAL.values()
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q13, sc13, z13 = int4_experts(experts, 2 * inter, hidden, group, gen)
    q2, sc2, z2 = int4_experts(experts, hidden, inter, group, gen)
    int4 = (sc13, z13, sc2, z2, group, group)

    def expert(e: int):  # ([2I, H], [H, I]) fp32
        one = slice(e, e + 1)
        return (dequantize_int4_experts(q13[one], sc13[one], z13[one], group)[0],
                dequantize_int4_experts(q2[one], sc2[one], z2[one], group)[0])  # fmt: skip

    deq = _stacked(expert, experts)

    rows = []
    for tokens in TOKENS:
        x, weights, ids = _route(tokens, experts, top_k, hidden, gen)
        used = ids.unique().numel() * 3 * hidden * inter
        quant = dict(inputs=(x, weights, ids), weights=(q13, q2), kwargs=dict(int4=int4))
        ref = moe_loop_by(x.float(), expert, experts, weights, ids)  # the CPU path, fp32
        rows.append(_case("mixtral-8x7b-gptq-g128", tokens, quant, deq, ref, (used // 2, 2 * used),
                          common))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--experts", type=int, default=256, help="DeepSeek-V3 experts built")
    parser.add_argument(
        "--shapes",
        default="deepseek,mixtral,mixtral-fp8",
        help="deepseek, mixtral (GPTQ), mixtral-fp8 (channel scales): any of",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="the w8a8 tile sweep of the fp8 --shapes only"
    )
    args = parser.parse_args()
    common = {**provenance("cuda"), "command": script_command()}
    if args.sweep:
        rows = sweep_w8a8(args.shapes.split(","), args.experts, common)
        if args.out:
            write_json(args.out, rows)
        return
    rows = []
    shapes = args.shapes.split(",")
    if "mixtral" in shapes:
        rows += mixtral_gptq(common)
        torch.cuda.empty_cache()
    if "mixtral-fp8" in shapes:
        rows += mixtral_fp8_channel(common)
        torch.cuda.empty_cache()
    if "deepseek" in shapes:
        rows += deepseek_fp8(args.experts, common)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
