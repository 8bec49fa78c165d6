"""Fused mixture-of-experts MLP: tokens sorted by expert, one grouped GEMM launch per projection.

    out[t] = sum_j w[t, j] * W2[e_tj] @ (silu(W1[e_tj] @ x[t]) * W3[e_tj] @ x[t])

``align_by_expert`` sorts the (token, choice) pairs by expert and pads each expert's run to a
multiple of ``BLOCK_M`` (on the device, no host sync: the padded length has a static bound, so
the launches can sit in a CUDA graph); every ``BLOCK_M`` rows then belong to one expert.
``_gate_up_kernel``: per row block and ``BLOCK_N`` columns of the intermediate size, the gate and
up products over H for the block's expert, ``silu(gate) * up`` in the epilogue -> [T * k, I].
``_down_kernel``: per row block and ``BLOCK_N`` columns of H, the down product over I, times the
pair's router weight in the epilogue -> [T * k, H], then summed over the k choices. Blocks past
the experts' runs exit at once, so a batch of one token reads only its chosen experts' weights.
Expert ids outside ``[0, E)`` (another rank's experts under expert parallelism) are skipped.
Steps of a few tokens (``moe_gemv.use_gemv``: decode) skip the sort and take the GEMV kernels of
kernels/moe_gemv.py instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lightwell.kernels.moe_gemv import Config, moe_gemv, use_gemv


def align_by_expert(
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped)
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([P] pair index or T * k, [P / block_m] expert or -1)
    """Pair indices ``t * k + j`` grouped by expert, each expert's run padded to ``block_m``
    with the sentinel ``T * k``; the expert of each block of ``block_m`` rows (-1: none)."""
    pairs = ids.numel()
    flat = ids.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(key, stable=True)  # [T * k]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]  # [E] (no sync)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    max_len = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_len + 1,), pairs, dtype=torch.int64, device=ids.device)
    sorted_key = key[order]
    valid = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(pairs, device=ids.device) - start[e]
    dest = torch.where(valid, padded_end[e] - padded[e] + rank, max_len)  # invalid: spill slot
    sorted_ids.scatter_(0, dest, order)
    block_start = torch.arange(0, max_len, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids[:max_len].to(torch.int32), block_expert.to(torch.int32)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2 * I, H]
    out_ptr,  # [T * k, I]
    sorted_ptr,  # [P]
    expert_ptr,  # [P / BLOCK_M]
    s_ptr,  # SBN > 0: [E, 2 * I / SBN, ceil(H / SBK)] fp32 block scales of fp8 weights
    num_pairs,  # T * k
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SBN: tl.constexpr,  # the scale blocks' rows (0: unscaled 16/32-bit weights)
    SBK: tl.constexpr,  # their inputs (a multiple of BLOCK_K)
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs
    token = pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    w = w_ptr + expert * (2 * INTER * HIDDEN)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SBN > 0:
        KS: tl.constexpr = (HIDDEN + SBK - 1) // SBK
        s_rows = s_ptr + expert * (2 * INTER // SBN * KS) + (cols // SBN) * KS  # [BN]
        s_gate = tl.where(col_ok, s_rows, s_ptr)  # rows past I: any valid address
        s_up = tl.where(col_ok, s_rows + INTER // SBN * KS, s_ptr)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HIDDEN
        a = tl.load(x_ptr + token[:, None] * HIDDEN + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w + cols[None, :] * HIDDEN + ks[:, None], mask=b_mask, other=0.0)
        up = tl.load(w + (INTER + cols[None, :]) * HIDDEN + ks[:, None], mask=b_mask, other=0.0)
        if SBN > 0:  # fp8 blocks: exact in x's dtype, scaled per column after the dot
            sg = tl.load(s_gate + k0 // SBK)
            su = tl.load(s_up + k0 // SBK)
            acc_gate += tl.dot(a, gate.to(a.dtype)) * sg[None, :]
            acc_up += tl.dot(a, up.to(a.dtype)) * su[None, :]
        else:
            acc_gate = tl.dot(a, gate, acc_gate)
            acc_up = tl.dot(a, up, acc_up)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(out_ptr + pair[:, None] * INTER + cols[None, :], act.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _down_kernel(
    a_ptr,  # [T * k, I]
    w_ptr,  # [E, H, I]
    weight_ptr,  # [T * k] router weights
    out_ptr,  # [T * k, H]
    sorted_ptr,  # [P]
    expert_ptr,  # [P / BLOCK_M]
    s_ptr,  # SBN > 0: [E, ceil(H / SBN), I / SBK] fp32 block scales of fp8 weights
    num_pairs,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SBN: tl.constexpr,  # the scale blocks' rows (0: unscaled 16/32-bit weights)
    SBK: tl.constexpr,  # their inputs (a multiple of BLOCK_K)
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HIDDEN
    w = w_ptr + expert * (HIDDEN * INTER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SBN > 0:
        KS: tl.constexpr = (INTER + SBK - 1) // SBK
        s_rows = s_ptr + expert * ((HIDDEN + SBN - 1) // SBN * KS) + (cols // SBN) * KS
        s_rows = tl.where(col_ok, s_rows, s_ptr)  # [BN]; rows past H: any valid address
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        a = tl.load(a_ptr + pair[:, None] * INTER + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(w + cols[None, :] * INTER + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        if SBN > 0:  # fp8 blocks: exact in a's dtype, scaled per column after the dot
            acc += tl.dot(a, b.to(a.dtype)) * tl.load(s_rows + k0 // SBK)[None, :]
        else:
            acc = tl.dot(a, b, acc)
    scale = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(out_ptr + pair[:, None] * HIDDEN + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


# fp8 experts' block scales: (w13's [E, 2I / bn, ceil(H / bk)], w2's [E, ceil(H / bn), I / bk],
# (bn, bk)) float32
Scales = tuple[torch.Tensor, torch.Tensor, tuple[int, int]]


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights, ids, scales) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit w13 {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} does not fit w13 {tuple(w13.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)} for {x.shape}")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe wants contiguous x, w13 and w2")
    if (scales is not None) != (w13.dtype == torch.float8_e4m3fn):
        raise ValueError("fused_moe: fp8 experts need their block scales (and only they)")
    if scales is not None:
        (bn, bk), inter = scales[2], two_inter // 2
        want13 = (num_experts, two_inter // bn, -(-hidden // bk))
        want2 = (num_experts, -(-hidden // bn), inter // bk)
        if inter % bn or inter % bk or bk & (bk - 1) or bk < 16:
            raise ValueError(f"fused_moe: block {scales[2]} does not fit I = {inter}")
        if tuple(scales[0].shape) != want13 or tuple(scales[1].shape) != want2:
            raise ValueError(f"fused_moe: scales do not fit w13 {tuple(w13.shape)}, {scales[2]}")
        if not (scales[0].is_contiguous() and scales[1].is_contiguous()):
            raise ValueError("fused_moe wants contiguous scales")


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows, then up rows (16/32-bit, or fp8 + scales)
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped)
    block_m: int | None = None,  # default: from the mean tokens per expert (16 to 64)
    block_n: int = 64,
    block_k: int = 64,
    gemv: bool | None = None,  # the few-token GEMV kernels; default: moe_gemv.use_gemv
    gemv_configs: tuple[Config, Config] | None = None,  # theirs (gate/up, down); default: picked
    scales: Scales | None = None,  # fp8 experts: their block scales (weight-only: x unscaled)
) -> torch.Tensor:  # [T, H]
    """The grouped kernels (tiles ``block_m``/``block_n``/``block_k``) or, for a few tokens,
    kernels/moe_gemv.py's (the choice depends only on the shapes: CUDA-graph safe). FP8
    experts: each weight tile converted to x's dtype (exact), its dot product times the block
    scale of its columns and K chunk."""
    _check(x, w13, w2, weights, ids, scales)
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w2.shape
    pairs = num_tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    if use_gemv(num_tokens, top_k, num_experts) if gemv is None else gemv:
        if scales is not None:
            from lightwell.kernels.moe_gemv_fp8 import moe_gemv_fp8

            return moe_gemv_fp8(x, w13, w2, weights, ids, *scales, *(gemv_configs or (None, None)))
        return moe_gemv(x, w13, w2, weights, ids, *(gemv_configs or (None, None)))
    if block_m is None:
        per_expert = pairs / num_experts
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    s13, s2, (sbn, sbk) = scales if scales is not None else (x, x, (0, 0))
    if scales is not None:
        block_k = min(block_k, sbk)  # a K tile inside one scale block
    sorted_ids, block_expert = align_by_expert(ids, num_experts, block_m)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](
        x, w13, act, sorted_ids, block_expert, s13, pairs, TOP_K=top_k, HIDDEN=hidden,
        INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SBN=sbn, SBK=sbk,
    )  # fmt: skip
    out = torch.zeros(pairs, hidden, dtype=x.dtype, device=x.device)  # skipped pairs stay 0
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    grid = (block_expert.numel(), triton.cdiv(hidden, block_n))
    _down_kernel[grid](
        act, w2, flat_weights, out, sorted_ids, block_expert, s2, pairs, HIDDEN=hidden,
        INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SBN=sbn, SBK=sbk,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


def dequantize_experts(
    w: torch.Tensor,  # [E, N, K] fp8
    scale: torch.Tensor,  # [E, ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],
) -> torch.Tensor:  # [E, N, K] float32
    n, k = w.shape[1:]
    s = scale.float().repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    return w.float() * s[:, :n, :k]


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k]
    scales: Scales | None = None,  # fp8 experts: dequantized first
) -> torch.Tensor:  # [T, H]
    """Every (token, choice) pair on its own, in fp32."""
    if scales is not None:
        w13 = dequantize_experts(w13, scales[0], scales[2])
        w2 = dequantize_experts(w2, scales[1], scales[2])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    num_experts = w13.shape[0]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < num_experts:
                gate, up = (w13[e].float() @ x[t].float()).chunk(2)
                out[t] += float(weights[t, j]) * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)
