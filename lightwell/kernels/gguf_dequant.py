"""GGUF block kernels: weights read as the file stores them, uint8 [N, bytes per row] (blocks of
Q4_0, Q4_1, Q8_0: 32 values; Q4_K, Q5_K, Q6_K: super-blocks of 256), dequantized in registers.

``gguf_dequantize`` writes the [N, K] weight (bit-exact with gguf-py's numpy dequantize in fp32:
the same products and sums, rounded in the same order, no fused multiply-add);
``gguf_gemv`` computes ``x @ W.T`` for 1 to ``MAX_M`` rows of x, reading each weight byte once;
``gguf_dequantize_ref`` is the torch reference (gguf-py's arithmetic on torch tensors). The block
layouts, their table ``BLOCKS`` and the reference live in ``kernels/gguf_blocks.py`` (shared
with the CPU kernels, no Triton there) and are re-exported here.

Every type is read as tiles of [BLOCK_N rows, S sub-blocks, 2, 16] values: a sub-block is 32
consecutive values sharing one scale (and min), a block for the 32-value types, 1/8 of a
super-block for the K-quants (Q6_K: one scale a half, 16 values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels.gguf_blocks import (  # noqa: F401 (the layouts and reference, re-exported)
    BLOCKS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    SUPPORTED,
    check_blocks,
    gguf_dequantize_ref,
)

MAX_M = 8  # rows of x the GEMV takes
SUB = 32  # values of a sub-block


@triton.jit
def _f16(p):  # the little-endian fp16 at byte pointer(s) p, as fp32
    lo = tl.load(p).to(tl.int32)
    hi = tl.load(p + 1).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8(b):  # a byte (int32 0..255) read as int8
    return b - ((b >> 7) << 8)


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _scale_min(sp, j):
    """Q4_K / Q5_K: 6-bit scale and min of sub-block j (0..7) from the 12 bytes at sp."""
    a = _u8(sp + j)
    b = _u8(sp + j + 4)
    c = _u8(sp + j % 4)
    low = j < 4
    sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _tile(rows, kb, QTYPE: tl.constexpr, BYTES: tl.constexpr, S: tl.constexpr):
    """Values of sub-blocks kb .. kb + S of the rows (byte pointers [BN, 1, 1, 1]): fp32
    [BN, S, 2, 16] (value 16h + t of each sub-block)."""
    s = kb + tl.arange(0, S)[None, :, None, None]  # [1, S, 1, 1] sub-block in the row
    h = tl.arange(0, 2)[None, None, :, None]  # [1, 1, 2, 1]
    t = tl.arange(0, 16)[None, None, None, :]  # [1, 1, 1, 16]
    i = h * 16 + t
    if QTYPE < 12:  # Q4_0, Q4_1, Q8_0 (2, 3, 8; the K-quants are 12-14): a block a sub-block
        blk = rows + s * BYTES
        d = _f16(blk)
        if QTYPE == 8:
            return d * _i8(_u8(blk + 2 + i)).to(tl.float32)
        if QTYPE == 2:
            q = ((_u8(blk + 2 + t) >> (4 * h)) & 15) - 8
            return d * q.to(tl.float32)
        q = (_u8(blk + 4 + t) >> (4 * h)) & 15
        return d * q.to(tl.float32) + _f16(blk + 2)
    blk = rows + (s // 8) * BYTES
    j = s % 8
    if QTYPE == 14:  # Q6_K
        a = j // 4
        g = j % 4
        ql = (_u8(blk + a * 64 + (g % 2) * 32 + i) >> (4 * (g // 2))) & 15
        qh = (_u8(blk + 128 + a * 32 + i) >> (2 * g)) & 3
        q = (ql | (qh << 4)) - 32
        sc = _i8(_u8(blk + 192 + 2 * j + h)).to(tl.float32)  # [BN, S, 2, 1]
        return (_f16(blk + 208) * sc) * q.to(tl.float32)
    sc, mn = _scale_min(blk + 4, j)
    qs = 48  # Q5_K: qh[32] first
    if QTYPE == 12:
        qs = 16
    q = (_u8(blk + qs + (j // 2) * 32 + i) >> (4 * (j % 2))) & 15
    if QTYPE == 13:
        q = q | (((_u8(blk + 16 + i) >> j) & 1) << 4)
    return (_f16(blk) * sc) * q.to(tl.float32) - _f16(blk + 2) * mn


@triton.jit
def _gguf_dequant_kernel(
    w_ptr, out_ptr, N, stride_wn, stride_on,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = tl.minimum(rn, N - 1).to(tl.int64)[:, None, None, None]  # past N: re-read the last row
    kb = tl.program_id(1) * S
    w = _tile(w_ptr + wn * stride_wn, kb, QTYPE, BYTES, S)  # [BN, S, 2, 16]
    s = tl.arange(0, S)[None, :, None, None]
    i = tl.arange(0, 2)[None, None, :, None] * 16 + tl.arange(0, 16)[None, None, None, :]
    cols = (kb + s) * 32 + i
    mask = (rn[:, None, None, None] < N) & (cols >= 0)
    tl.store(out_ptr + wn * stride_on + cols, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gguf_gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    S: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = tl.minimum(rn, N - 1).to(tl.int64)  # past N: re-read the last row, store nothing
    rows = w_ptr + wn[:, None, None, None] * stride_wn  # [BN, 1, 1, 1]
    rm = tl.arange(0, BLOCK_M)
    xm = tl.minimum(rm, M - 1)  # rows past M re-read row M - 1
    s = tl.arange(0, S)[None, :, None, None]
    i = tl.arange(0, 2)[None, None, :, None] * 16 + tl.arange(0, 16)[None, None, None, :]
    x_rows = x_ptr + xm[:, None, None, None] * stride_xm  # [BM, 1, 1, 1]
    if BLOCK_M == 1:  # the tile's own shape, no reshapes
        acc1 = tl.zeros([BLOCK_N, S, 2, 16], dtype=tl.float32)  # summed once, at the end
        for kb in range(0, K // 32, S):
            x = tl.load(x_rows + (kb + s) * 32 + i).to(tl.float32)  # [1, S, 2, 16]
            acc1 += _tile(rows, kb, QTYPE, BYTES, S) * x
        acc = tl.sum(tl.sum(tl.sum(acc1, axis=3), axis=2), axis=1)[:, None]  # [BN, 1]
    else:  # broadcast, not reshaped: compiled tl.reshape may reorder the tile's elements
        acc5 = tl.zeros([BLOCK_N, BLOCK_M, S, 2, 16], dtype=tl.float32)  # summed at the end
        for kb in range(0, K // 32, S):
            w = _tile(rows, kb, QTYPE, BYTES, S)  # [BN, S, 2, 16]
            x = tl.load(x_rows + (kb + s) * 32 + i).to(tl.float32)  # [BM, S, 2, 16]
            acc5 += tl.expand_dims(w, 1) * tl.expand_dims(x, 0)
        acc = tl.sum(tl.sum(tl.sum(acc5, axis=4), axis=3), axis=2)  # [BN, BM]
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _subs(k: int, most: int) -> int:
    """Sub-blocks a tile: the largest power of two up to ``most`` that divides K / 32."""
    n = k // SUB
    return min(most, n & -n)


def _check(w: torch.Tensor, qtype: int) -> int:
    """K of the blocks w, of a type these kernels read."""
    if qtype not in SUPPORTED:
        raise ValueError(f"the GGUF Triton kernels read types {SUPPORTED}, got {qtype}")
    return check_blocks(w, qtype)


def gguf_dequantize(
    w: torch.Tensor,  # [N, B] uint8 blocks
    qtype: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,  # [N, K] (rows contiguous) to write into
) -> torch.Tensor:  # [N, K] in dtype (out's)
    """The blocks' values (``out``: written there, any row stride)."""
    k = _check(w, qtype)
    n = w.shape[0]
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=w.device)
    if out.shape != (n, k) or out.stride(1) != 1:
        raise ValueError(f"gguf_dequantize: out must be [{n}, {k}] with contiguous rows")
    if n == 0:
        return out
    block_n, s = 4, _subs(k, 8)
    _gguf_dequant_kernel[(triton.cdiv(n, block_n), k // SUB // s)](
        w, out, n, w.stride(0), out.stride(0), QTYPE=qtype, BYTES=BLOCKS[qtype][1],
        BLOCK_N=block_n, S=s, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


# (BLOCK_N, sub-blocks a K step, num_warps) of the GEMV
Config = tuple[int, int, int]


def pick_config(n: int, k: int, m: int = 1) -> Config:
    """The GEMV tile: four rows a program, 8 sub-blocks (256 values) a K step for one or two
    rows of x, fewer as rows of x add accumulators ([BN, BM, 32 S] fp32, summed at the end:
    16 a thread at one row)."""
    most = 8 if m <= 2 else 4 if m <= 4 else 2
    return 4, _subs(k, most), 2


def gguf_gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_M
    w: torch.Tensor,  # [N, B] uint8 blocks
    qtype: int,
    out: torch.Tensor | None = None,  # [M, N] (columns contiguous) to write into
    config: Config | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype (out's)
    """``x @ W.T`` with W dequantized in registers, fp32 sums; ``out`` may be a column slice
    of a wider buffer (a fused layer's shard)."""
    k = _check(w, qtype)
    m, n = x.shape[0], w.shape[0]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"gguf_gemv: x must be [M, {k}] with contiguous rows, got {x.shape}")
    if m > MAX_M:
        raise ValueError(f"gguf_gemv handles at most {MAX_M} rows, got {m}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"gguf_gemv: out must be [{m}, {n}] with contiguous columns")
    if m == 0 or n == 0:
        return out
    block_n, s, warps = config or pick_config(n, k, m)
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), QTYPE=qtype,
        BYTES=BLOCKS[qtype][1], BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, S=s,
        num_warps=warps, enable_fp_fusion=True,
    )  # fmt: skip
    return out
