"""Mixture-of-experts MLP for a few tokens over quantized experts: the GEMV kernels of
kernels/moe_gemv.py reading block-FP8 weights (DeepSeek-V3/R1: one fp32 scale per [SBN, SBK]
block) or int4 words with group scales and zero points (GPTQ / AWQ after loading: SBN = 1, SBK
the group size; quant/experts_wna16.py's layout).

Weight-only: x and ``act`` stay in the activation dtype; each weight is dequantized to fp32 in
registers (``q * scale``, ``(q - zero) * scale``) before its FMA with x. A K tile of ``BLOCK_K``
inputs is loaded as [BLOCK_N, NS, TS]: NS slices of TS = min(BLOCK_K, SBK) inputs, each inside
one scale block or group, so a tile's scales (and zeros) are one [BLOCK_N, NS] load.

- ``_quant_gemv_gate_up``: grid (pairs, cdiv(I, BLOCK_N)) -> ``act`` [T * k, I], silu(gate) * up.
- ``_quant_gemv_down``: grid (T, cdiv(H, BLOCK_N)): a token's k pairs summed in a fixed order.
Expert ids outside ``[0, E)`` are skipped; no host sync: CUDA-graph safe. The torch reference is
``fused_moe_ref`` (kernels/fused_moe.py) on the dequantized weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels.fused_moe import ROW
from lightwell.kernels.moe_gemv import Config, pick_config
from lightwell.kernels.w4a16 import _unpack


@triton.jit
def _scaled_tile(
    rows, s_rows, z_rows, k0, hidden, num_sb,
    TS: tl.constexpr, NS: tl.constexpr, SBK: tl.constexpr, EVEN_K: tl.constexpr,
    INT4: tl.constexpr,
):  # fmt: skip
    """The [BN, NS, TS] weight tile at k0 of ``rows`` ([BN, 1, 1] pointers to each row's
    stored elements) dequantized in fp32: fp8 values times their block scales, or int4 values
    (value j of a word at bits 4j) minus their zeros times their group scales (``s_rows``,
    ``z_rows``: [BN, 1] pointers to each row's first scale / zero)."""
    rs = tl.arange(0, NS)
    sb = (k0 + rs * TS) // SBK  # [NS]
    if INT4:  # [NS, TS / 8] words, unpacked in input order (kernels/w4a16.py's _unpack)
        k = k0 // 8 + rs[:, None] * (TS // 8) + tl.arange(0, TS // 8)[None, :]
        limit = hidden // 8
    else:
        k = k0 + rs[:, None] * TS + tl.arange(0, TS)[None, :]  # [NS, TS]
        limit = hidden
    if EVEN_K:
        w = tl.load(rows + k[None, :, :])
        s = tl.load(s_rows + sb[None, :])
    else:
        w = tl.load(rows + k[None, :, :], mask=k[None, :, :] < limit)
        s = tl.load(s_rows + sb[None, :], mask=sb[None, :] < num_sb, other=0.0)
    if INT4:  # (one return: the compiler types every return of a constexpr branch)
        z = tl.load(z_rows + sb[None, :], mask=sb[None, :] < num_sb, other=0.0).to(tl.float32)
        tile = _unpack(w, z[:, :, None])
    else:
        tile = w.to(tl.float32)
    return tile * s.to(tl.float32)[:, :, None]


@triton.jit
def _x_tile(x_row, k0, hidden, TS: tl.constexpr, NS: tl.constexpr, EVEN_K: tl.constexpr):
    k = k0 + tl.arange(0, NS)[:, None] * TS + tl.arange(0, TS)[None, :]  # [NS, TS]
    if EVEN_K:
        return tl.load(x_row + k).to(tl.float32)[None, :, :]
    return tl.load(x_row + k, mask=k < hidden, other=0.0).to(tl.float32)[None, :, :]


@triton.jit(do_not_specialize=["top_k", "num_experts"])
def _quant_gemv_gate_up(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2 * I, H] fp8 or [E, 2 * I, H / 8] int4 words: gate rows, then up rows
    s_ptr,  # [E, 2 * I / SBN, ceil(H / SBK)] scales
    z_ptr,  # INT4: [E, 2 * I, H / SBK] zero points
    ids_ptr,  # [T * k] expert ids
    out_ptr,  # [T * k, I]
    top_k, num_experts, hidden, inter,
    BLOCK_N: tl.constexpr, TS: tl.constexpr, NS: tl.constexpr,
    SBN: tl.constexpr, SBK: tl.constexpr, EVEN_K: tl.constexpr, INT4: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return  # another rank's expert
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, inter - 1).to(tl.int64)  # past I: re-read the last row
    num_sb = (hidden + SBK - 1) // SBK
    kw = hidden // 8 if INT4 else hidden  # a row's stored elements
    gate_rows = w_ptr + expert * 2 * inter * kw + rows[:, None, None] * kw
    up_rows = gate_rows + inter * kw
    g_off = expert * (2 * inter // SBN) * num_sb + (rows // SBN)[:, None] * num_sb  # [BN, 1]
    u_off = g_off + inter // SBN * num_sb
    x_row = x_ptr + (pair // top_k).to(tl.int64) * hidden
    acc_gate = tl.zeros([BLOCK_N, NS, TS], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, NS, TS], dtype=tl.float32)
    for k0 in range(0, hidden, NS * TS):
        x = _x_tile(x_row, k0, hidden, TS, NS, EVEN_K)
        acc_gate += _scaled_tile(gate_rows, s_ptr + g_off, z_ptr + g_off, k0, hidden, num_sb,
                                 TS, NS, SBK, EVEN_K, INT4) * x  # fmt: skip
        acc_up += _scaled_tile(up_rows, s_ptr + u_off, z_ptr + u_off, k0, hidden, num_sb,
                               TS, NS, SBK, EVEN_K, INT4) * x  # fmt: skip
    g = tl.sum(tl.sum(acc_gate, axis=2), axis=1)  # [BN]
    act = g / (1.0 + tl.exp(-g)) * tl.sum(tl.sum(acc_up, axis=2), axis=1)
    out = out_ptr + pair.to(tl.int64) * inter + rn
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=rn < inter)


@triton.jit(do_not_specialize=["top_k", "num_experts"])
def _quant_gemv_down(
    a_ptr,  # [T * k, I]
    w_ptr,  # [E, H, I] fp8 or [E, H, I / 8] int4 words
    s_ptr,  # [E, ceil(H / SBN), I / SBK] scales
    z_ptr,  # INT4: [E, H, I / SBK] zero points
    ids_ptr,  # [T * k] expert ids
    weight_ptr,  # [T * k] fp32 router weights
    out_ptr,  # [T, H]
    top_k, num_experts, hidden, inter,
    BLOCK_N: tl.constexpr, TS: tl.constexpr, NS: tl.constexpr,
    SBN: tl.constexpr, SBK: tl.constexpr, EVEN_K: tl.constexpr, INT4: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, hidden - 1).to(tl.int64)  # past H: re-read the last row
    num_sb = (inter + SBK - 1) // SBK
    kw = inter // 8 if INT4 else inter  # a row's stored elements
    s_per_expert = (hidden + SBN - 1) // SBN * num_sb
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(top_k):
        pair = token * top_k + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if (expert >= 0) & (expert < num_experts):  # else: another rank's expert
            w_rows = w_ptr + expert * hidden * kw + rows[:, None, None] * kw
            off = expert * s_per_expert + (rows // SBN)[:, None] * num_sb  # [BN, 1]
            a_row = a_ptr + pair.to(tl.int64) * inter
            acc = tl.zeros([BLOCK_N, NS, TS], dtype=tl.float32)
            for k0 in range(0, inter, NS * TS):
                a = _x_tile(a_row, k0, inter, TS, NS, EVEN_K)
                acc += _scaled_tile(w_rows, s_ptr + off, z_ptr + off, k0, inter, num_sb,
                                    TS, NS, SBK, EVEN_K, INT4) * a  # fmt: skip
            total += tl.load(weight_ptr + pair) * tl.sum(tl.sum(acc, axis=2), axis=1)
    out = out_ptr + token.to(tl.int64) * hidden + rn
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rn < hidden)


def _slices(block_k: int, sbk: int) -> tuple[int, int]:
    """(TS, NS): a K tile as NS slices of TS inputs, each inside one scale block or group (TS:
    the largest power of two dividing both)."""
    ts = min(block_k & -block_k, sbk & -sbk)
    return ts, block_k // ts


def moe_gemv_quant(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H] fp8, or [E, 2 * I, H / 8] int4 words
    w2: torch.Tensor,  # [E, H, I] fp8, or [E, H, I / 8] int4 words
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped)
    scales: tuple | None,  # fp8: fused_moe.Scales
    int4: tuple | None,  # int4: fused_moe.Int4
    gate_up_config: Config | None = None,  # default: pick_config(H, 2, T)
    down_config: Config | None = None,  # default: pick_config(I, 1, T)
) -> torch.Tensor:  # [T, H] in x's dtype
    """``moe_gemv`` over quantized experts (shapes checked by ``fused_moe``)."""
    num_tokens, top_k = ids.shape
    num_experts, hidden = w2.shape[:2]
    if int4 is not None:
        s13, z13, s2, z2, g13, g2 = int4
        (bn13, bk13), (bn2, bk2), inter = (1, g13), (1, g2), w13.shape[1] // 2
    else:
        s13, s2, (bn13, bk13) = scales
        z13, z2, (bn2, bk2), inter = s13, s2, (bn13, bk13), w2.shape[2]
        if (bn13, bk13) == ROW:  # one scale a row: a block of all of K
            bk13, bk2 = hidden, inter
    flat_ids = ids.reshape(-1).contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = gate_up_config or pick_config(hidden, 2, num_tokens)
    ts, ns = _slices(block_k, bk13)
    _quant_gemv_gate_up[(act.shape[0], triton.cdiv(inter, block_n))](
        x, w13, s13, z13, flat_ids, act, top_k, num_experts, hidden, inter, BLOCK_N=block_n,
        TS=ts, NS=ns, SBN=bn13, SBK=bk13, EVEN_K=hidden % block_k == 0, INT4=int4 is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()  # [T * k]
    block_n, block_k, warps, stages = down_config or pick_config(inter, 1, num_tokens)
    ts, ns = _slices(block_k, bk2)
    _quant_gemv_down[(num_tokens, triton.cdiv(hidden, block_n))](
        act, w2, s2, z2, flat_ids, flat_weights, out, top_k, num_experts, hidden, inter,
        BLOCK_N=block_n, TS=ts, NS=ns, SBN=bn2, SBK=bk2, EVEN_K=inter % block_k == 0,
        INT4=int4 is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
