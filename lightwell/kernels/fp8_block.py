"""Block-scaled FP8 GEMM (DeepSeek-V3 / HF fine-grained FP8): out[M, N] = (a * sa) @ (b * sb)^T.

``a`` [M, K] fp8 with ``a_scale`` [M, K / bk] (activations quantized per token and per group of
``bk`` inputs), ``b`` [N, K] fp8 with ``b_scale`` [ceil(N / bn), K / bk] (one scale per [bn, bk]
weight block). Each program computes a [BLOCK_M, BLOCK_N] tile walking K one ``bk`` block at a
time: ``acc += dot(a_tile, b_tile^T) * sa[:, kb] * sb[n // bn, kb]`` in fp32.

``fp8_block_gemv``: the same weights against one to ``GEMV_MAX_ROWS`` rows of 16- or 32-bit
activations, weight-only (x is not quantized): decode steps of a few tokens, where the GEMM's
activation quantization and 16-row dot tiles cost more than the weights' stream. A program
takes ``BLOCK_N`` weight rows (inside one scale row) and one x row, the x rows of a weight
tile next to each other (L2 serves the tile to all but the first); each K step multiplies the
fp8 tile by x already scaled by its blocks' scales, in fp32. With PDL the first weight tile
loads before the wait (kernels/pdl.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl
from lightwell.kernels.pdl_sync import signal_then_wait

GEMV_MAX_ROWS = 4  # activation rows fp8_block_gemv takes


# (a step's row count is not specialised: no variant compiles in the middle of serving)
@triton.jit(do_not_specialize=["M"])
def _fp8_block_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, M, N, K,
    stride_am, stride_bn, stride_sam, stride_sbn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_K = bk
    BN: tl.constexpr,  # the weight block's rows (bn)
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a_mask = (rm[:, None] < M) & (k[None, :] < K)
        b_mask = (rn[:, None] < N) & (k[None, :] < K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_bn + k[None, :], mask=b_mask, other=0.0)
        sa = tl.load(sa_ptr + rm * stride_sam + kb, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + (rn // BN) * stride_sbn + kb, mask=rn < N, other=0.0)
        part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        acc += part * sa[:, None] * sb[None, :]
    o_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), o_mask
    )


def fp8_block_matmul(
    a: torch.Tensor,  # [M, K] fp8
    a_scale: torch.Tensor,  # [M, ceil(K / bk)] float32
    b: torch.Tensor,  # [N, K] fp8
    b_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk)
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    m, k = a.shape
    n = b.shape[0]
    bn, bk = block
    kb = -(-k // bk)
    if b.shape[1] != k or a_scale.shape != (m, kb) or b_scale.shape != (-(-n // bn), kb):
        raise ValueError(
            f"fp8 block GEMM: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, b "
            f"{tuple(b.shape)}, b_scale {tuple(b_scale.shape)} do not fit block {block}"
        )
    # (an fp8 tl.dot on a GPU needs K >= 32; the interpreter takes 16)
    min_bk = 32 if a.is_cuda else 16
    if bk < min_bk or bk & (bk - 1):
        raise ValueError(f"fp8 block GEMM: bk must be a power of two >= {min_bk}, got {bk}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("fp8 block GEMM: a and b need a contiguous last dim")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_kernel[grid](
        a, b, a_scale, b_scale, out, m, n, k,
        a.stride(0), b.stride(0), a_scale.stride(0), b_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, BN=bn, num_warps=4,
    )  # fmt: skip
    return out


def fp8_block_matmul_ref(
    a: torch.Tensor,  # [M, K] fp8
    a_scale: torch.Tensor,  # [M, ceil(K / bk)]
    b: torch.Tensor,  # [N, K] fp8
    b_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    k, bk = a.shape[1], block[1]
    sa = a_scale.float().repeat_interleave(bk, dim=1)[:, :k]
    return ((a.float() * sa) @ _weight_ref(b, b_scale, block).t()).to(out_dtype)


def _weight_ref(b: torch.Tensor, b_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The block-scaled fp8 weight ``b`` [N, K] dequantized, fp32."""
    n, k = b.shape
    bn, bk = block
    sb = b_scale.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    return b.float() * sb


@triton.jit
def _scaled_x(x_row, s_row, k, K, BK: tl.constexpr):
    """x[k] times its weight block's scale (0 past K), fp32."""
    x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
    return x * tl.load(s_row + k // BK, mask=k < K, other=0.0)


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,  # the weight block (BLOCK_N divides BN)
    EVEN_K: tl.constexpr,  # BLOCK_K divides K: the loads unmasked
    GDC: tl.constexpr,  # launched with PDL: the first weight tile loads before the wait
):  # fmt: skip
    pid = tl.program_id(0)
    m, nb = pid % M, pid // M  # a weight tile's x rows are neighbours
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn  # past N: re-read
    s_row = s_ptr + (nb * BLOCK_N // BN).to(tl.int64) * stride_sn  # the tile's scale row
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    if EVEN_K:
        w = tl.load(w_rows + rk[None, :])
    else:
        w = tl.load(w_rows + rk[None, :], mask=rk[None, :] < K, other=0.0)
    signal_then_wait(GDC)
    acc = w.to(tl.float32) * _scaled_x(x_row, s_row, rk, K, BK)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=k[None, :] < K, other=0.0)
        acc += w.to(tl.float32) * _scaled_x(x_row, s_row, k, K, BK)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rn, out.to(out_ptr.dtype.element_ty),
             mask=rn < N)  # fmt: skip


def fp8_block_gemv(
    x: torch.Tensor,  # [M, K] 16/32-bit, M <= GEMV_MAX_ROWS
    b: torch.Tensor,  # [N, K] fp8
    b_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk)
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ (b * b_scale)^T`` for a few rows, weight-only (see the module docstring)."""
    m, k = x.shape
    n = b.shape[0]
    bn, bk = block
    if m > GEMV_MAX_ROWS or b.shape[1] != k or b_scale.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(
            f"fp8 block GEMV: x {tuple(x.shape)} (at most {GEMV_MAX_ROWS} rows), b "
            f"{tuple(b.shape)}, b_scale {tuple(b_scale.shape)} do not fit block {block}"
        )
    block_n = 8 if n >= 4096 else 4
    if bn % block_n or b.stride(1) != 1:
        raise ValueError(f"fp8 block GEMV: bn {bn} not a multiple of {block_n}, or b strided")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_k = min(512, triton.next_power_of_2(k))
    gdc = _pdl.use_pdl(x.device)
    _fp8_block_gemv_kernel[(m * triton.cdiv(n, block_n),)](
        x, b, b_scale, out, m, n, k, x.stride(0), b.stride(0), b_scale.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, BN=bn, BK=bk, EVEN_K=k % block_k == 0, GDC=gdc,
        num_warps=4, num_stages=3, **_pdl.launch_options(gdc),
    )  # fmt: skip
    return out


def fp8_block_gemv_ref(
    x: torch.Tensor,  # [M, K]
    b: torch.Tensor,  # [N, K] fp8
    b_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],
) -> torch.Tensor:  # [M, N] in x's dtype
    return (x.float() @ _weight_ref(b, b_scale, block).t()).to(x.dtype)
