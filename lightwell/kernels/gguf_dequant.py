"""GGUF block kernels: weights read as the file stores them, uint8 [N, bytes per row] (blocks of
Q4_0, Q4_1, Q8_0: 32 values; Q4_K, Q5_K, Q6_K: super-blocks of 256), dequantized in registers.

``gguf_dequantize`` writes the [N, K] weight (bit-exact with gguf-py's numpy dequantize in fp32:
the same products and sums, rounded in the same order, no fused multiply-add);
``gguf_gemv`` computes ``x @ W.T`` for 1 to ``MAX_M`` rows of x, reading each weight byte once;
``gguf_dequantize_ref`` is the torch reference (gguf-py's arithmetic on torch tensors).

Every type is read as tiles of [BLOCK_N rows, S sub-blocks, 2, 16] values: a sub-block is 32
consecutive values sharing one scale (and min), a block for the 32-value types, 1/8 of a
super-block for the K-quants (Q6_K: one scale a half, 16 values). Block layouts (ggml):
  Q4_0 (18 B): d f16, qs[16]: value i = (qs[i % 16] >> 4 * (i // 16) & 15) - 8, w = d * q
  Q4_1 (20 B): d f16, m f16, qs[16]: q as Q4_0 without the -8, w = d * q + m
  Q8_0 (34 B): d f16, qs[32] int8: w = d * q
  Q4_K (144 B): d, dmin f16, scales[12] (eight 6-bit scales and mins), qs[128]: sub-block j,
    value i: q = qs[32 * (j // 2) + i] >> 4 * (j % 2) & 15, w = (d * sc[j]) * q - dmin * mn[j]
  Q5_K (176 B): as Q4_K with qh[32] before qs: q |= (qh[i] >> j & 1) << 4
  Q6_K (210 B): ql[128], qh[64], scales[16] int8, d f16: sub-block j = 4a + g, value i:
    q = (ql[64a + 32 (g % 2) + i] >> 4 (g // 2) & 15 | (qh[32a + i] >> 2g & 3) << 4) - 32,
    w = (d * scales[2j + i // 16]) * q
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14  # ggml type ids
# type -> (values, bytes) per block
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176),
          Q6_K: (256, 210)}  # fmt: skip
SUPPORTED = tuple(BLOCKS)
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


def _check(w: torch.Tensor, qtype: int) -> int:
    """K (values per row) of the blocks w, after checking them."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF kernels take types {SUPPORTED}, got {qtype}")
    values, nbytes = BLOCKS[qtype]
    if w.dtype != torch.uint8 or w.dim() != 2 or w.stride(1) != 1 or w.shape[1] % nbytes:
        raise ValueError(f"GGUF blocks must be uint8 [N, B] rows of {nbytes}-byte blocks")
    return w.shape[1] // nbytes * values


def _subs(k: int, most: int) -> int:
    """Sub-blocks a tile: the largest power of two up to ``most`` that divides K / 32."""
    n = k // SUB
    return min(most, n & -n)


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


def _f16_ref(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] fp32
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _i8_ref(b: torch.Tensor) -> torch.Tensor:  # uint8 -> fp32 of the bytes read as int8
    return b.contiguous().view(torch.int8).float()


def _nibbles(qs: torch.Tensor, dim: int) -> torch.Tensor:  # low nibbles, then high, along dim
    return torch.stack((qs & 15, qs >> 4), dim=dim)


def _ref_32(blk: torch.Tensor, qtype: int) -> torch.Tensor:  # [n, nb, bytes] -> [n, nb, 32]
    d = _f16_ref(blk[..., 0:2])[..., None]
    if qtype == Q8_0:
        return _i8_ref(blk[..., 2:]) * d
    if qtype == Q4_0:
        return d * (_nibbles(blk[..., 2:].int(), 2).flatten(2) - 8).float()
    q = _nibbles(blk[..., 4:].int(), 2).flatten(2).float()
    return d * q + _f16_ref(blk[..., 2:4])[..., None]


def _scale_min_ref(sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [.., 12] -> [.., 8]
    a, b, c = sb[..., 0:4].int(), sb[..., 4:8].int(), sb[..., 8:12].int()
    sc = torch.cat((a & 63, (c & 15) | ((a >> 6) << 4)), -1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), -1)
    return sc.float(), mn.float()


def _ref_k(blk: torch.Tensor, qtype: int) -> torch.Tensor:  # [n, nb, bytes] -> [n, nb, 8, 32]
    n, nb = blk.shape[:2]
    if qtype == Q6_K:
        low = _nibbles(blk[..., :128].int().reshape(n, nb, 2, 64), 3).reshape(n, nb, 8, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=blk.device)[:, None]
        qh = blk[..., 128:192].int().reshape(n, nb, 2, 1, 32) >> shifts
        q = (low | ((qh & 3).reshape(n, nb, 8, 32) << 4)) - 32
        d = _f16_ref(blk[..., 208:210])[..., None] * _i8_ref(blk[..., 192:208])  # [n, nb, 16]
        return (d[..., None] * q.reshape(n, nb, 16, 16).float()).reshape(n, nb, 8, 32)
    sc, mn = _scale_min_ref(blk[..., 4:16])
    first = 16 if qtype == Q4_K else 48
    q = _nibbles(blk[..., first:].int().reshape(n, nb, 4, 32), 3).reshape(n, nb, 8, 32)
    if qtype == Q5_K:
        bits = torch.arange(8, dtype=torch.int32, device=blk.device)[:, None]
        q = q | (((blk[..., 16:48].int()[..., None, :] >> bits) & 1) << 4)
    d = (_f16_ref(blk[..., 0:2])[..., None] * sc)[..., None]
    dm = (_f16_ref(blk[..., 2:4])[..., None] * mn)[..., None]
    return d * q.float() - dm


def gguf_dequantize_ref(
    w: torch.Tensor,  # [N, B] uint8 blocks
    qtype: int,
) -> torch.Tensor:  # [N, K] fp32
    """gguf-py's dequantize (its arithmetic, rounded in its order) in torch."""
    _check(w, qtype)
    values, nbytes = BLOCKS[qtype]
    blk = w.reshape(w.shape[0], -1, nbytes)
    out = _ref_32(blk, qtype) if values == 32 else _ref_k(blk, qtype)
    return out.reshape(w.shape[0], -1)
