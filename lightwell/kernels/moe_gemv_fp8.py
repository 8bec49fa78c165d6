"""Mixture-of-experts MLP for a few tokens over block-FP8 experts (DeepSeek-V3/R1): the GEMV
kernels of kernels/moe_gemv.py reading fp8 weights and one fp32 scale per [SBN, SBK] block.

Weight-only: x and ``act`` stay in the activation dtype; each fp8 weight is converted to fp32 in
registers and multiplied by its block's scale before its FMA with x (``w = q * scale``). A K tile
of ``BLOCK_K`` inputs is loaded as [BLOCK_N, NS, TS]: NS slices of TS = min(BLOCK_K, SBK) inputs,
each inside one scale block, so a tile's scales are one [BLOCK_N, NS] load.

- ``_fp8_gemv_gate_up``: grid (pairs, cdiv(I, BLOCK_N)) -> ``act`` [T * k, I], silu(gate) * up.
- ``_fp8_gemv_down``: grid (T, cdiv(H, BLOCK_N)): a token's k pairs summed in a fixed order.
Expert ids outside ``[0, E)`` are skipped; no host sync: CUDA-graph safe. The torch reference is
``fused_moe_ref`` (kernels/fused_moe.py) on the dequantized weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels.moe_gemv import Config, pick_config


@triton.jit
def _scaled_tile(
    rows, s_rows, k0, hidden, num_sb,
    TS: tl.constexpr, NS: tl.constexpr, SBK: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """The [BN, NS, TS] fp8 tile at k0 of ``rows`` ([BN, 1, 1] pointers) times its block
    scales (``s_rows``: [BN, 1] pointers to each row's first scale), in fp32."""
    rs = tl.arange(0, NS)
    k = k0 + rs[:, None] * TS + tl.arange(0, TS)[None, :]  # [NS, TS]
    sb = (k0 + rs * TS) // SBK  # [NS]
    if EVEN_K:
        w = tl.load(rows + k[None, :, :])
        s = tl.load(s_rows + sb[None, :])
    else:
        w = tl.load(rows + k[None, :, :], mask=k[None, :, :] < hidden, other=0.0)
        s = tl.load(s_rows + sb[None, :], mask=sb[None, :] < num_sb, other=0.0)
    return w.to(tl.float32) * s[:, :, None]


@triton.jit
def _x_tile(x_row, k0, hidden, TS: tl.constexpr, NS: tl.constexpr, EVEN_K: tl.constexpr):
    k = k0 + tl.arange(0, NS)[:, None] * TS + tl.arange(0, TS)[None, :]  # [NS, TS]
    if EVEN_K:
        return tl.load(x_row + k).to(tl.float32)[None, :, :]
    return tl.load(x_row + k, mask=k < hidden, other=0.0).to(tl.float32)[None, :, :]


@triton.jit(do_not_specialize=["top_k", "num_experts"])
def _fp8_gemv_gate_up(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2 * I, H] fp8: gate rows, then up rows
    s_ptr,  # [E, 2 * I / SBN, ceil(H / SBK)] fp32
    ids_ptr,  # [T * k] expert ids
    out_ptr,  # [T * k, I]
    top_k, num_experts, hidden, inter,
    BLOCK_N: tl.constexpr, TS: tl.constexpr, NS: tl.constexpr,
    SBN: tl.constexpr, SBK: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return  # another rank's expert
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, inter - 1).to(tl.int64)  # past I: re-read the last row
    num_sb = (hidden + SBK - 1) // SBK
    gate_rows = w_ptr + expert * 2 * inter * hidden + rows[:, None, None] * hidden
    up_rows = gate_rows + inter * hidden
    s_base = s_ptr + expert * (2 * inter // SBN) * num_sb
    sg_rows = s_base + (rows // SBN)[:, None] * num_sb  # [BN, 1]
    su_rows = s_base + ((rows + inter) // SBN)[:, None] * num_sb
    x_row = x_ptr + (pair // top_k).to(tl.int64) * hidden
    acc_gate = tl.zeros([BLOCK_N, NS, TS], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, NS, TS], dtype=tl.float32)
    for k0 in range(0, hidden, NS * TS):
        x = _x_tile(x_row, k0, hidden, TS, NS, EVEN_K)
        acc_gate += _scaled_tile(gate_rows, sg_rows, k0, hidden, num_sb, TS, NS, SBK, EVEN_K) * x
        acc_up += _scaled_tile(up_rows, su_rows, k0, hidden, num_sb, TS, NS, SBK, EVEN_K) * x
    g = tl.sum(tl.sum(acc_gate, axis=2), axis=1)  # [BN]
    act = g / (1.0 + tl.exp(-g)) * tl.sum(tl.sum(acc_up, axis=2), axis=1)
    out = out_ptr + pair.to(tl.int64) * inter + rn
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=rn < inter)


@triton.jit(do_not_specialize=["top_k", "num_experts"])
def _fp8_gemv_down(
    a_ptr,  # [T * k, I]
    w_ptr,  # [E, H, I] fp8
    s_ptr,  # [E, ceil(H / SBN), I / SBK] fp32
    ids_ptr,  # [T * k] expert ids
    weight_ptr,  # [T * k] fp32 router weights
    out_ptr,  # [T, H]
    top_k, num_experts, hidden, inter,
    BLOCK_N: tl.constexpr, TS: tl.constexpr, NS: tl.constexpr,
    SBN: tl.constexpr, SBK: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, hidden - 1).to(tl.int64)  # past H: re-read the last row
    num_sb = (inter + SBK - 1) // SBK
    s_per_expert = (hidden + SBN - 1) // SBN * num_sb
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(top_k):
        pair = token * top_k + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if (expert >= 0) & (expert < num_experts):  # else: another rank's expert
            w_rows = w_ptr + expert * hidden * inter + rows[:, None, None] * inter
            s_rows = s_ptr + expert * s_per_expert + (rows // SBN)[:, None] * num_sb
            a_row = a_ptr + pair.to(tl.int64) * inter
            acc = tl.zeros([BLOCK_N, NS, TS], dtype=tl.float32)
            for k0 in range(0, inter, NS * TS):
                a = _x_tile(a_row, k0, inter, TS, NS, EVEN_K)
                acc += _scaled_tile(w_rows, s_rows, k0, inter, num_sb, TS, NS, SBK, EVEN_K) * a
            total += tl.load(weight_ptr + pair) * tl.sum(tl.sum(acc, axis=2), axis=1)
    out = out_ptr + token.to(tl.int64) * hidden + rn
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rn < hidden)


def _slices(block_k: int, sbk: int) -> tuple[int, int]:
    """(TS, NS): a K tile as NS slices of TS inputs, each inside one scale block."""
    ts = min(block_k, sbk)
    if sbk % ts or block_k % ts:
        raise ValueError(f"fp8 MoE GEMV: BLOCK_K {block_k} does not fit scale blocks of {sbk}")
    return ts, block_k // ts


def moe_gemv_fp8(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H] fp8
    w2: torch.Tensor,  # [E, H, I] fp8
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped)
    s13: torch.Tensor,  # [E, 2 * I / bn, ceil(H / bk)] fp32
    s2: torch.Tensor,  # [E, ceil(H / bn), I / bk] fp32
    block: tuple[int, int],  # (bn, bk)
    gate_up_config: Config | None = None,  # default: pick_config(H, 2, T)
    down_config: Config | None = None,  # default: pick_config(I, 1, T)
) -> torch.Tensor:  # [T, H] in x's dtype
    """``moe_gemv`` over fp8 experts with block scales (shapes checked by ``fused_moe``)."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w2.shape
    bn, bk = block
    flat_ids = ids.reshape(-1).contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = gate_up_config or pick_config(hidden, 2, num_tokens)
    ts, ns = _slices(block_k, bk)
    _fp8_gemv_gate_up[(act.shape[0], triton.cdiv(inter, block_n))](
        x, w13, s13, flat_ids, act, top_k, num_experts, hidden, inter, BLOCK_N=block_n, TS=ts,
        NS=ns, SBN=bn, SBK=bk, EVEN_K=hidden % block_k == 0, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()  # [T * k]
    block_n, block_k, warps, stages = down_config or pick_config(inter, 1, num_tokens)
    ts, ns = _slices(block_k, bk)
    _fp8_gemv_down[(num_tokens, triton.cdiv(hidden, block_n))](
        act, w2, s2, flat_ids, flat_weights, out, top_k, num_experts, hidden, inter,
        BLOCK_N=block_n, TS=ts, NS=ns, SBN=bn, SBK=bk, EVEN_K=inter % block_k == 0,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
