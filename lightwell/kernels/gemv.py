"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with M <= 16.

Decode at small batch is bound by streaming W once; cuBLAS reaches ~2.7 TB/s of the H200's
4.2 TB/s there (PERFORMANCE.md). This kernel gives each program a slab of BLOCK_N output
columns and the whole K (or a 1/SPLIT_K share of it, reduced through fp32 partials), pads
the M rows to 16 so ``tl.dot`` runs on tensor cores, and keeps several K tiles in flight
(``num_stages``) so enough bytes are outstanding per SM to approach the copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels.split_kv import num_sms

MAX_M = 16


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BK, BN]
        acc += tl.dot(x, w)
    ptrs = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
    tl.store(ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


def pick_config(n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, split_k, num_warps, num_stages) for an [N, K] weight.

    Enough programs to give every SM several: BLOCK_N 16/32 by N, then split K while the grid
    is under ~4 programs per SM.
    """
    sms = 8
    if device.type == "cuda":
        sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    block_n = 32 if n >= 16384 else 16
    block_k = 256
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 4 * sms and k // (block_k * split * 2) >= 1:
        split *= 2
    return block_n, block_k, split, 4, 4


def gemv(
    x: torch.Tensor,  # [M, K], M <= 16
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``config``: (BLOCK_N, BLOCK_K, split_k, num_warps, num_stages), default pick_config."""
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, split, warps, stages = config or pick_config(n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    parts = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split)
    _gemv_kernel[grid](
        x, weight, parts, m, n, k,
        x.stride(0), weight.stride(0), parts.stride(1), parts.stride(0),
        BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, K_PER_SPLIT=k_per_split,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    out = parts[0] if split == 1 else parts.sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def gemv_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} mismatch")
    if x.shape[0] > MAX_M:
        raise ValueError(f"gemv handles at most {MAX_M} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs a contiguous last dimension on x and weight")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")
