"""int8 x int8 GEMM with the W8A8 epilogue fused: ``out = (a @ b^T) * sa[m] * sb[n] (+ bias[n])``.

``a`` [M, K] int8 (activations, per-token scales ``sa`` [M, 1] float32), ``b`` [N, K] int8
(weights, per-channel scales ``sb`` [N] float32). Each program accumulates a [BLOCK_M, BLOCK_N]
tile exactly in int32 (``tl.dot``), then scales it in fp32, adds the bias and writes the
activation dtype: one pass over the output (split over K: after the partials' pass). Tiles are
fixed per M, N and K (``pick_config``, from an H200 sweep at llama-3-8b's shapes), no
autotuning; ``config`` overrides them (benchmarks sweep it).

Split over K (``split_k`` > 1), each program stores its int32 partial sums and counts itself in
a per-tile counter; the last one of a tile adds the partials (exactly: the result equals the
unsplit kernel's bit for bit), runs the epilogue and resets the counter to zero, so the
counters (one zeroed buffer per device, kernels/split_counters.py) are ready for the next call
and CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels.split_counters import last_to_arrive, split_counters
from lightwell.kernels.split_kv import device_sms


class Int8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


_DECODE_ROWS = 256  # up to here, tiles for a decode batch


def pick_config(m: int, n: int, k: int, sms: int = 132) -> Int8GemmConfig:
    """The tile for ``m`` rows, an [n, k] weight and ``sms`` SMs, the best of
    benchmarks/kernels/w8a8.py --sweep at llama-3-8b's shapes on the H200. Up to 16 rows:
    16-row tiles. Up to 256 (decode batches): wide weights (n >= 16,384: gate_up) 64 x 128
    tiles up to 64 rows, then 128 x 128; long K (k >= 8,192: down) past 128 rows 128 x 64 tiles
    split in two over K; others 64 x 64 tiles, 256-input K steps in four stages while the tiles
    are no more than the SMs (a program an SM), three stages up to twice the SMs (two an SM,
    by the H200's shared memory), else 128-input steps (three an SM). Above 256 rows:
    128 x 128."""
    if m <= 16:
        return Int8GemmConfig(16, 128, 128, 4, 4)
    if m > _DECODE_ROWS:
        return Int8GemmConfig(128, 128, 128, 8, 3)
    if n >= 16384:
        if m <= 64:
            return Int8GemmConfig(64, 128, 128, 4, 4)
        return Int8GemmConfig(128, 128, 128, 8, 3)
    if k >= 8192 and m > 128:
        return Int8GemmConfig(128, 64, 128, 4, 4, 2)
    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 64)
    if tiles <= sms:
        return Int8GemmConfig(64, 64, 256, 4, 4)
    if tiles <= 2 * sms:
        return Int8GemmConfig(64, 64, 256, 4, 3)
    return Int8GemmConfig(64, 64, 128, 4, 4)


# (a step's row count is not specialised: no variant compiles in the middle of serving)
@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K,
    stride_am, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    FENCE: tl.constexpr,  # compiled for a GPU: split_counters.last_to_arrive's fence
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + rn[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    k_lo, k_hi = 0, K
    if SPLIT_K > 1:  # this program's share of the K tiles
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = tl.program_id(2) * per
        k_hi = tl.minimum(K, k_lo + per)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + rk
        a = tl.load(a_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0)
        b = tl.load(b_rows + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    o_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tile = rm[:, None] * N + rn[None, :]  # [BM, BN] in one split's [M, N] partials
        tl.store(part_ptr + tl.program_id(2) * M * N + tile, acc, mask=o_mask)
        counter = cnt_ptr + pid_m * tl.num_programs(1) + pid_n
        if last_to_arrive(counter, SPLIT_K, rm, FENCE):
            acc = _sum_partials(part_ptr, tile, M * N, o_mask, SPLIT_K)
            tl.atomic_xchg(counter, 0)
            _epilogue(acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, rm, rn, M, N, stride_om, o_mask,
                      HAS_BIAS)  # fmt: skip
    else:
        _epilogue(acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, rm, rn, M, N, stride_om, o_mask,
                  HAS_BIAS)  # fmt: skip


@triton.jit
def _sum_partials(part_ptr, tile, split_stride, o_mask, SPLIT_K: tl.constexpr):
    """The tile's int32 sum over the splits' partials (read past L1: other programs wrote
    them)."""
    acc = tl.load(part_ptr + tile, mask=o_mask, other=0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * split_stride + tile, mask=o_mask, other=0,
                       cache_modifier=".cg")  # fmt: skip
    return acc


@triton.jit
def _epilogue(
    acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, rm, rn, M, N, stride_om, o_mask,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The int32 tile scaled by its rows' and columns' scales (+ bias), stored."""
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    out = out.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # rounded to the output dtype, then added in fp32: torch's ``out + bias``
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(out_ptr.dtype.element_ty)
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
    cfg = config or pick_config(m, n, k, device_sms(a.device) or 132)
    sa = a_scale.reshape(m).float().contiguous()
    sb = b_scale.reshape(n).float().contiguous()
    bias_t = sb if bias is None else bias.to(out_dtype).contiguous()
    grid_m, grid_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    split = _splits(cfg, m, n, k)
    part, cnt = out, sb  # (unread without a split)
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.int32, device=a.device)
        cnt = split_counters(a.device, grid_m * grid_n)
    _int8_gemm_kernel[(grid_m, grid_n, split)](
        a, b, sa, sb, bias_t, out, part, cnt, m, n, k, a.stride(0), b.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=split, FENCE=not envs.triton_interpret(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _splits(cfg: Int8GemmConfig, m: int, n: int, k: int) -> int:
    """The launch's K splits: the config's, each a share of whole K tiles and none empty (so
    no more than the tiles), 1 where the partials' int32 offsets could overflow."""
    tiles = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, tiles))
    split = triton.cdiv(tiles, triton.cdiv(tiles, split))
    return 1 if split * m * n >= 2**31 else split


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
