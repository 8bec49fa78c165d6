"""int8 x int8 GEMM with the W8A8 epilogue fused: ``out = (a @ b^T) * sa[m] * sb[n] (+ bias[n])``.

``a`` [M, K] int8 (activations, per-token scales ``sa`` [M, 1] float32), ``b`` [N, K] int8
(weights, per-channel scales ``sb`` [N] float32). Each program accumulates a [BLOCK_M, BLOCK_N]
tile exactly in int32 (``tl.dot``), then scales it in fp32, adds the bias and writes the
activation dtype: one pass over the output. Tiles are fixed per M and N (``pick_config``), no
autotuning; ``config`` overrides them (benchmarks sweep it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lightwell.kernels.split_kv import num_sms


class Int8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


_SKINNY_MAX_ROWS = 256  # up to here, 64-row tiles when 128-row ones leave SMs without a tile


def pick_config(m: int, n: int, sms: int = 132) -> Int8GemmConfig:
    """The tile for ``m`` rows and ``n`` output columns on ``sms`` SMs: thin for decode,
    square-ish for prefill; 64-row tiles up to ``_SKINNY_MAX_ROWS`` rows when 128 x 128 tiles
    would number fewer than the SMs (a decode batch's qkv / o / down projections)."""
    if m <= 16:
        return Int8GemmConfig(16, 128, 128, 4, 4)
    few_tiles = triton.cdiv(m, 128) * triton.cdiv(n, 128) < sms
    if m <= 64 or (m <= _SKINNY_MAX_ROWS and few_tiles):
        return Int8GemmConfig(64, 128, 128, 4, 4)
    return Int8GemmConfig(128, 128, 128, 8, 3)


# (a step's row count is not specialised: no variant compiles in the middle of serving)
@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, K,
    stride_am, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + rn[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(a_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0)
        b = tl.load(b_rows + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    out = out.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # rounded to the output dtype, then added in fp32: torch's ``out + bias``
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(out_ptr.dtype.element_ty)
    o_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], out, o_mask)


def int8_gemm(
    a: torch.Tensor,  # [M, K] int8
    b: torch.Tensor,  # [N, K] int8
    a_scale: torch.Tensor,  # [M, 1] or [M] float32
    b_scale: torch.Tensor,  # [N] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N] in out_dtype
    config: Int8GemmConfig | None = None,
) -> torch.Tensor:  # [M, N]
    m, k = a.shape
    n = b.shape[0]
    if a.dtype != torch.int8 or b.dtype != torch.int8 or b.shape[1] != k:
        raise ValueError(f"int8 GEMM: a {a.dtype} {tuple(a.shape)}, b {b.dtype} {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("int8 GEMM: a and b need a contiguous last dim")
    if a_scale.numel() != m or b_scale.numel() != n:
        raise ValueError(f"int8 GEMM: scales {tuple(a_scale.shape)}, {tuple(b_scale.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    cfg = config or pick_config(m, n, _num_sms(a.device))
    sa = a_scale.reshape(m).float().contiguous()
    sb = b_scale.reshape(n).float().contiguous()
    bias_t = sb if bias is None else bias.to(out_dtype).contiguous()
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _int8_gemm_kernel[grid](
        a, b, sa, sb, bias_t, out, m, n, k, a.stride(0), b.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def int8_gemm_ref(
    a: torch.Tensor,  # [M, K] int8
    b: torch.Tensor,  # [N, K] int8
    a_scale: torch.Tensor,  # [M, 1] float32
    b_scale: torch.Tensor,  # [N] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """Exact integer product (int64 on the CPU), then the same fp32 scaling order."""
    acc = (a.cpu().long() @ b.cpu().long().t()).to(torch.int32).to(a.device)
    out = acc.float() * a_scale.reshape(-1, 1).float() * b_scale.reshape(1, -1).float()
    out = out.to(out_dtype)
    return out if bias is None else out + bias.to(out_dtype)
