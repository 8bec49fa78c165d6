"""The (token, expert) pairs around the grouped MoE kernels (kernels/fused_moe.py):

- ``align_by_expert`` (before): pair indices sorted by expert, each expert's run padded to the
  kernels' row block, on the device without a host sync (the padded length has a static bound,
  so the launches can sit in a CUDA graph);
- ``sum_pairs`` (after): each token's sum over its pairs, ``out[t] = sum_j y[t * k + j]
  (+ add[t])``, over the pairs whose expert id lies in ``[0, E)``; other ranks' pairs (expert
  parallelism) are never read, so their rows of ``y`` need not be set. Summed in float32 in a
  fixed order and rounded once; one program a token and ``BLOCK_H`` columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _sum_pairs_kernel(
    y_ptr,  # [T * k, H]: each pair's weighted output (pairs of other ranks' experts: unset)
    ids_ptr,  # [T, k]
    add_ptr,  # HAS_ADD: [T, H]
    out_ptr,  # [T, H]
    num_experts,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,  # TOP_K rounded up to a power of two
    BLOCK_H: tl.constexpr,
    HAS_ADD: tl.constexpr,
):
    t, pid_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    j = tl.arange(0, KP)
    e = tl.load(ids_ptr + t * TOP_K + j, mask=j < TOP_K, other=-1)
    ok = (j < TOP_K) & (e >= 0) & (e < num_experts)  # [KP]
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < HIDDEN
    y = tl.load(y_ptr + (t * TOP_K + j)[:, None] * HIDDEN + cols[None, :],
                mask=ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
    acc = tl.sum(y.to(tl.float32), axis=0)
    if HAS_ADD:
        acc += tl.load(add_ptr + t * HIDDEN + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def sum_pairs(
    per_pair: torch.Tensor,  # [T * k, H]
    ids: torch.Tensor,  # [T, k]: pairs whose id is outside [0, E) count as 0
    num_experts: int,
    add: torch.Tensor | None = None,  # [T, H]: added to the sum (the shared experts' output)
) -> torch.Tensor:  # [T, H]
    """Each token's sum over its k pairs (in float32, rounded once), plus ``add``."""
    num_tokens, top_k = ids.shape
    hidden = per_pair.shape[1]
    out = per_pair.new_empty(num_tokens, hidden)
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    _sum_pairs_kernel[grid](
        per_pair, ids.contiguous(), out if add is None else add.contiguous(), out, num_experts,
        HIDDEN=hidden, TOP_K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_H=block_h,
        HAS_ADD=add is not None, num_warps=4,
    )  # fmt: skip
    return out
