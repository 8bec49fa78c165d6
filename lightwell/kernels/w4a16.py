"""W4A16 matmul: y[M, N] = x[M, K] @ W[K, N] (+ bias) with W stored as 4-bit integers and
dequantized in registers, ``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``, ``g = g_idx[k]``.

Weights (``lightwell/quant/wna16.py``'s layout): ``qweight`` [K / 8, N] int32, eight 4-bit
values of consecutive inputs per word (value j at bits 4j); ``scales``, ``zeros`` [G, N] in the
activation dtype; ``g_idx`` [K] int32. With contiguous groups (``group_size`` > 0: ``g = k //
group_size``) the kernels compute the group and, when a K tile lies in one group, load one row of
scales and zeros per tile; otherwise (act-order) they gather the rows ``g_idx`` names.

Two kernels: ``_w4a16_gemv_kernel`` for one row (batch-1 decode: CUDA cores, a [BLOCK_K,
BLOCK_N] fp32 accumulator reduced once at the end), ``_w4a16_gemm_kernel`` for more rows
(``tl.dot`` on dequantized [BLOCK_K, BLOCK_N] tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_tile(
    q_ptr, s_ptr, z_ptr, g_ptr, k0, k, rn, K, N, stride_q, stride_s,
    GROUP_SIZE: tl.constexpr, ONE_GROUP: tl.constexpr,
):  # fmt: skip
    """W[k, rn] as fp32 [BLOCK_K, BLOCK_N] (zeros past K or N)."""
    mask = (k[:, None] < K) & (rn[None, :] < N)
    words = tl.load(q_ptr + (k // 8)[:, None] * stride_q + rn[None, :], mask=mask, other=0)
    q = ((words >> ((k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    if GROUP_SIZE > 0:
        if ONE_GROUP:  # the tile lies in one group: one row of scales and zeros
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * stride_s + rn, mask=rn < N, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * stride_s + rn, mask=rn < N, other=0.0).to(tl.float32)
            return (q - z[None, :]) * s[None, :]
        g = k // GROUP_SIZE
    else:
        g = tl.load(g_ptr + k, mask=k < K, other=0)
    s = tl.load(s_ptr + g[:, None] * stride_s + rn[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + g[:, None] * stride_s + rn[None, :], mask=mask, other=0.0)
    return (q - z.to(tl.float32)) * s.to(tl.float32)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, K, N,
    stride_q, stride_s,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
    ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        w = _dequant_tile(
            q_ptr, s_ptr, z_ptr, g_ptr, k0, k, rn, K, N, stride_q, stride_s, GROUP_SIZE, ONE_GROUP
        )
        acc += x[:, None] * w
    out = tl.sum(acc, axis=0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M, K, N,
    stride_xm, stride_q, stride_s, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32" (unused by 16-bit)
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x_mask = (rm[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w = _dequant_tile(
            q_ptr, s_ptr, z_ptr, g_ptr, k0, k, rn, K, N, stride_q, stride_s, GROUP_SIZE, ONE_GROUP
        )
        acc += tl.dot(x, w.to(x.dtype), out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    o_mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def _check(x, qweight, scales, zeros, g_idx, bias) -> None:
    m, k = x.shape
    n = qweight.shape[1]
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"want x [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (-(-k // 8), n):
        raise ValueError(f"qweight must be int32 [{-(-k // 8)}, {n}], got {tuple(qweight.shape)}")
    if scales.shape != zeros.shape or scales.shape[1] != n or g_idx.shape != (k,):
        raise ValueError("scales and zeros must be [G, N] and g_idx [K]")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("qweight, scales and zeros must be contiguous")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]")


def w4a16_matmul(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
    group_size: int = 0,  # > 0: contiguous groups (g_idx unread); 0: gather by g_idx
) -> torch.Tensor:  # [M, N] in x.dtype
    _check(x, qweight, scales, zeros, g_idx, bias)
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    b = bias if bias is not None else out
    if m == 1:
        block_n, block_k = 64, 64
        one = group_size > 0 and group_size % block_k == 0
        grid = (triton.cdiv(n, block_n),)
        _w4a16_gemv_kernel[grid](
            x, qweight, scales, zeros, g_idx, b, out, k, n, qweight.stride(0), scales.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k, GROUP_SIZE=group_size, ONE_GROUP=one,
            HAS_BIAS=bias is not None, num_warps=4,
        )  # fmt: skip
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 32
    one = group_size > 0 and group_size % block_k == 0
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx, b, out, m, k, n,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_SIZE=group_size,
        ONE_GROUP=one, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    return out


def w4a16_matmul_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])
    g = g_idx.long()
    w = (q[: x.shape[1]].float() - zeros.float()[g]) * scales.float()[g]  # [K, N]
    out = x.float() @ w
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
