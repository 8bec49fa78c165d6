"""W4A16 matmul: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W stored as 4-bit integers and
dequantized in registers, ``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]``.

Weights (``lightwell/quant/wna16.py``'s layout, K-contiguous): ``qweight`` [N, K / 8] int32, word
``w`` of row ``n`` holding inputs ``8w .. 8w + 7`` (value ``j`` at bits ``4j``); ``scales``,
``zeros`` [N, G] in the activation dtype; ``g_idx`` [K] int32. With contiguous groups
(``group_size`` > 0: ``g = k // group_size``) a K tile of BLOCK_K inputs is seen as [NG, TG]:
NG slices of TG = min(group, BLOCK_K) inputs, each inside one group, so a tile's scales and
zeros are one [BLOCK_N, NG] load; otherwise (``group_size`` 0, act-order rows that could not be
sorted by group) each input's group is gathered through ``g_idx``.

Unpacking has no integer-to-float conversion (quarter rate): nibble ``j`` is masked in place
(after one 12-bit shift for j >= 5) and ORed with the bits of 1.0 (``ONE``, passed at run time
so the masks stay immediates), giving the fp32 ``f = 1 + q * 2^(p - 23)`` (``p`` its lowest
bit), and one FMA gives ``f * 2^(23 - p) - (2^(23 - p) + z) = q - z`` exactly.

``_w4a16_gemv_kernel`` (kernels/w4a16_gemv.py; M <= 4, decode; kernels/gemv.py's design): each
program owns BLOCK_N rows and walks K with vector loads (unmasked when BLOCK_K divides K). x's
tile is split into eight planes (plane j: the inputs of value j of each word), so
``x_j * (q_j - z)`` pairs with the words as loaded (no interleave): one FMA a weight, summed per
slice, times the slice's scale into a [BLOCK_N, NG] accumulator a row of x, reduced at the end.
Its first tile is peeled: those weights are read before it waits under PDL. x's tile is split
into the planes in registers by a layout change through shared memory.
``_w4a16_gemm_kernel`` (more rows): ``tl.dot`` on dequantized [BLOCK_N, BLOCK_K] tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _nibble(words, z, J: tl.constexpr, one=0x3F800000):
    """Value J of each word minus z ([.., 1] or 0.0: integers, as every format's zero points
    are), exact in fp32 (module docstring)."""
    if J >= 5:
        words = words >> 12
    P: tl.constexpr = 4 * J - 12 if J >= 5 else 4 * J
    C: tl.constexpr = 1.0 * (1 << (23 - P))
    f = ((words & (0xF << P)) | one).to(tl.float32, bitcast=True)
    return f * C - (z + C)


@triton.jit
def _unpack(words, z):
    """[.., TW] int32 words -> [.., 8 * TW] fp32 values minus z, in input order."""
    a = tl.interleave(tl.interleave(_nibble(words, z, 0), _nibble(words, z, 4)),
                      tl.interleave(_nibble(words, z, 2), _nibble(words, z, 6)))  # fmt: skip
    b = tl.interleave(tl.interleave(_nibble(words, z, 1), _nibble(words, z, 5)),
                      tl.interleave(_nibble(words, z, 3), _nibble(words, z, 7)))  # fmt: skip
    return tl.interleave(a, b)


@triton.jit
def _planes(x):
    """x [..., 2, 2, 2] (input 8w + 4a + 2b + c at [..., w, a, b, c]) -> its eight [..., w]
    planes, plane j holding inputs 8w + j."""
    c0, c1 = tl.split(x)
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    x0, x4 = tl.split(c0b0)
    x2, x6 = tl.split(c0b1)
    x1, x5 = tl.split(c1b0)
    x3, x7 = tl.split(c1b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _load_words(q_rows, k0, K, BLOCK_K: tl.constexpr, TG: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BN, NG, TG / 8] words of the K tile at k0 (q_rows: [BN, 1, 1] row pointers)."""
    rg = tl.arange(0, BLOCK_K // TG)
    rw = tl.arange(0, TG // 8)
    w = k0 // 8 + rg[:, None] * (TG // 8) + rw[None, :]  # [NG, TW]
    if EVEN_K:
        return tl.load(q_rows + w[None, :, :])
    return tl.load(q_rows + w[None, :, :], mask=w[None, :, :] < K // 8, other=0)


@triton.jit
def _group_scales(
    s_rows, z_rows, k0, K,
    BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """The scales and zeros of the K tile at k0's slices, fp32 [BN, NG] (contiguous groups;
    s_rows, z_rows: [BN, 1] row pointers)."""
    g = ((k0 + tl.arange(0, BLOCK_K // TG) * TG) // GROUP_SIZE)[None, :]  # [1, NG]
    if EVEN_K:
        s = tl.load(s_rows + g)
        z = tl.load(z_rows + g)
    else:  # slices past K: no group
        mask = g < (K + GROUP_SIZE - 1) // GROUP_SIZE
        s = tl.load(s_rows + g, mask=mask, other=0.0)
        z = tl.load(z_rows + g, mask=mask, other=0.0)
    return s.to(tl.float32), z.to(tl.float32)


@triton.jit
def _dequant(
    words, s_rows, z_rows, g_ptr, k0, K,
    BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """W of the K tile at k0 as fp32 [BN, NG, TG]."""
    if GROUP_SIZE > 0:
        s, z = _group_scales(s_rows, z_rows, k0, K, BLOCK_K, TG, GROUP_SIZE, EVEN_K)
        return _unpack(words, z[:, :, None]) * s[:, :, None]
    k = k0 + tl.arange(0, TG)[None, :]  # [1, TG]: each input's group gathered (NG == 1)
    g = tl.load(g_ptr + k, mask=k < K, other=0)[None, :, :]  # [1, 1, TG]
    s = tl.load(s_rows[:, :, None] + g).to(tl.float32)
    z = tl.load(z_rows[:, :, None] + g).to(tl.float32)
    return (_unpack(words, 0.0) - z) * s


@triton.jit
def _load_x(x_row, k0, K, BLOCK_K: tl.constexpr, TG: tl.constexpr, EVEN_K: tl.constexpr):
    """x[m, k0 : k0 + BLOCK_K] as fp32 [1, NG, TG] (x_row: row m's pointer)."""
    rg = tl.arange(0, BLOCK_K // TG)
    k = k0 + rg[:, None] * TG + tl.arange(0, TG)[None, :]  # [NG, TG]
    if EVEN_K:
        return tl.load(x_row + k).to(tl.float32)[None, :, :]
    return tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)[None, :, :]


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr,
    GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32" (unused by 16-bit)
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    wn = tl.minimum(rn, N - 1).to(tl.int64)
    q_rows = q_ptr + wn[:, None, None] * stride_qn  # [BN, 1, 1]
    s_rows = s_ptr + wn[:, None] * stride_sn  # [BN, 1]
    z_rows = z_ptr + wn[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        words = _load_words(q_rows, k0, K, BLOCK_K, TG, EVEN_K)
        w = _dequant(words, s_rows, z_rows, g_ptr, k0, K, BLOCK_K, TG, GROUP_SIZE, EVEN_K)
        k = k0 + rk
        x_mask = (rm[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(x.dtype)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + wn).to(tl.float32)[None, :]
    o_mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def slice_size(block_k: int, group_size: int, k: int) -> tuple[int, int]:
    """(BLOCK_K, TG) for a K tile: TG inputs a slice, each slice inside one group (BLOCK_K
    shrunk to a power of two dividing the group when neither divides the other)."""
    if group_size <= 0 or group_size >= k or group_size % block_k == 0:
        return block_k, block_k
    if block_k % group_size == 0:
        return block_k, group_size
    tg = min(block_k, group_size & -group_size)  # the largest power of two dividing the group
    return tg, tg


def _group(group_size: int) -> int:
    """Contiguous groups the kernels can tile (multiples of 8 inputs), else 0: gather g_idx."""
    return group_size if group_size > 0 and group_size % 8 == 0 else 0


def w4a16_matmul(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G]
    g_idx: torch.Tensor,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
    group_size: int = 0,  # > 0: contiguous groups (g_idx unread); 0: gather by g_idx
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ W.T (+ bias)``: one row (and rows the skinny kernel does not take, up to its
    MAX_M) through the GEMV, 2-16 rows with tiles inside groups through kernels/w4a16_skinny.py,
    the ``tl.dot`` GEMM for the rest. (The skinny kernel takes one row too; at one row the GEMV
    is the faster of the two.)"""
    from lightwell.kernels import w4a16_skinny as skinny
    from lightwell.kernels.w4a16_gemv import MAX_M, w4a16_gemv

    if x.dim() == 2 and x.dtype != torch.float32:
        m, k = x.shape
        if m > 1 and skinny.supports(m, k, _group(group_size)):
            _check(x, qweight, scales, zeros, g_idx, bias)
            return skinny.w4a16_skinny(x, qweight, scales, zeros, bias, _group(group_size))
    if x.dim() == 2 and x.shape[0] <= MAX_M:
        return w4a16_gemv(x, qweight, scales, zeros, g_idx, bias, group_size)
    return w4a16_gemm(x, qweight, scales, zeros, g_idx, bias, group_size)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM
GemmConfig = tuple[int, int, int, int, int]


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return block_m, 64, min(64, triton.next_power_of_2(k)), 4, 3


def w4a16_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    g_idx: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 0,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x @ W.T (+ bias)`` through ``tl.dot`` on dequantized tiles, any M (the arguments as
    ``w4a16_matmul``'s; ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), default
    ``gemm_config``)."""
    _check(x, qweight, scales, zeros, g_idx, bias)
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = config or gemm_config(m, n, k)
    gs = _group(group_size)
    block_k, tg = slice_size(block_k, gs, k)
    if block_k < 16:  # tl.dot's least K: one slice, groups gathered
        block_k, tg, gs = 16, 16, 0
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx, bias if bias is not None else scales, out, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TG=tg, GROUP_SIZE=gs,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out


def _check(x, qweight, scales, zeros, g_idx, bias) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"want x [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    k, n = x.shape[1], (qweight.shape[0] if qweight.dim() == 2 else -1)
    if k % 8:
        raise ValueError(f"w4a16: K ({k}) must be a multiple of 8 (eight 4-bit values a word)")
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (n, k // 8):
        raise ValueError(f"qweight must be int32 [N, {k // 8}], got {tuple(qweight.shape)}")
    if scales.shape != zeros.shape or scales.dim() != 2 or scales.shape[0] != n:
        raise ValueError("scales and zeros must be [N, G]")
    if g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [{k}]")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("qweight, scales and zeros must be contiguous")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]")


def w4a16_matmul_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G]
    g_idx: torch.Tensor,  # [K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    q = ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)  # [N, K]
    g = g_idx.long()
    w = (q.float() - zeros.float()[:, g]) * scales.float()[:, g]  # [N, K]
    out = x.float() @ w.t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


_GEMV_NAMES = ("MAX_M", "Config", "pick_config", "w4a16_gemv")


def __getattr__(name: str):
    """The GEMV's names, re-exported from kernels/w4a16_gemv.py (which imports this module)."""
    if name in _GEMV_NAMES:
        from lightwell.kernels import w4a16_gemv

        return getattr(w4a16_gemv, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
