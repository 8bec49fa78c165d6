"""W4A16 GEMV for decode (M <= 4 rows of x): ``_w4a16_gemv_kernel`` and its tiles
(``pick_config``), over kernels/w4a16.py's layout and helpers (its module docstring describes
both)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell.kernels import pdl as _pdl
from lightwell.kernels.w4a16 import (
    _check,
    _dequant,
    _group,
    _group_scales,
    _load_words,
    _load_x,
    _nibble,
    _planes,
    slice_size,
)

MAX_M = 4


@triton.jit
def _x_planes(x_row, k0, K, BLOCK_K: tl.constexpr, TG: tl.constexpr, EVEN_K: tl.constexpr):
    """x[m, k0 : k0 + BLOCK_K] as eight fp32 [1, NG, TG / 8] planes: plane j holds the inputs
    of value j of each word."""
    x = tl.reshape(_load_x(x_row, k0, K, BLOCK_K, TG, EVEN_K), [BLOCK_K // TG, TG // 8, 2, 2, 2])
    x0, x1, x2, x3, x4, x5, x6, x7 = _planes(x)
    return x0[None], x1[None], x2[None], x3[None], x4[None], x5[None], x6[None], x7[None]


@triton.jit
def _row_acc(
    acc, x_row, w, z, s, one, k0, K,
    FIRST: tl.constexpr,  # the first tile: its sums start the accumulator
    BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """acc [BN, NG] plus each slice's sum of x[m] * W (x_row: row m's pointer). Contiguous: w
    the [BN, NG, TG / 8] words, z [BN, NG, 1] and s [BN, NG] the slices' zeros and scales;
    gathered groups: w the dequantized [BN, 1, TG] tile."""
    if GROUP_SIZE > 0:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_row, k0, K, BLOCK_K, TG, EVEN_K)
        p = x0 * _nibble(w, z, 0, one)
        p += x1 * _nibble(w, z, 1, one)
        p += x2 * _nibble(w, z, 2, one)
        p += x3 * _nibble(w, z, 3, one)
        p += x4 * _nibble(w, z, 4, one)
        p += x5 * _nibble(w, z, 5, one)
        p += x6 * _nibble(w, z, 6, one)
        p += x7 * _nibble(w, z, 7, one)
        p = tl.sum(p, axis=2) * s
    else:
        p = tl.sum(_load_x(x_row, k0, K, BLOCK_K, TG, EVEN_K) * w, axis=2)
    if FIRST:
        return p
    return acc + p


@triton.jit
def _tile_loads(
    q_rows, s_rows, z_rows, k0, K,
    BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """(words, scales, zeros) of the K tile at k0: [BN, NG, TW] int32, [BN, NG] and [BN, NG, 1]
    fp32 (contiguous groups; gathered groups: 1.0 and 0.0, read with the tile's math)."""
    words = _load_words(q_rows, k0, K, BLOCK_K, TG, EVEN_K)
    if GROUP_SIZE > 0:
        s, z = _group_scales(s_rows, z_rows, k0, K, BLOCK_K, TG, GROUP_SIZE, EVEN_K)
        z = z[:, :, None]
    else:
        s, z = 1.0, 0.0
    return words, s, z


@triton.jit
def _gemv_tile(
    accs, words, s, z, x_ptr, s_rows, z_rows, g_ptr, k0, M, K, stride_xm, one,
    FIRST: tl.constexpr,  # the first tile: its sums start the accumulators
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr, GROUP_SIZE: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """accs (one [BN, NG] accumulator a row of x, BLOCK_M of them used) plus the tile at k0
    (its words, scales and zeros from _tile_loads). Rows past M re-read row M - 1."""
    w = words
    if GROUP_SIZE == 0:
        w = _dequant(words, s_rows, z_rows, g_ptr, k0, K, BLOCK_K, TG, GROUP_SIZE, EVEN_K)
    acc0, acc1, acc2, acc3 = accs
    acc0 = _row_acc(acc0, x_ptr, w, z, s, one, k0, K, FIRST, BLOCK_K, TG, GROUP_SIZE,
                    EVEN_K)  # fmt: skip
    if BLOCK_M > 1:
        x1 = x_ptr + tl.minimum(1, M - 1) * stride_xm
        acc1 = _row_acc(acc1, x1, w, z, s, one, k0, K, FIRST, BLOCK_K, TG, GROUP_SIZE,
                        EVEN_K)  # fmt: skip
    elif FIRST:
        acc1 = acc0
    if BLOCK_M > 2:
        x2 = x_ptr + tl.minimum(2, M - 1) * stride_xm
        x3 = x_ptr + tl.minimum(3, M - 1) * stride_xm
        acc2 = _row_acc(acc2, x2, w, z, s, one, k0, K, FIRST, BLOCK_K, TG, GROUP_SIZE,
                        EVEN_K)  # fmt: skip
        acc3 = _row_acc(acc3, x3, w, z, s, one, k0, K, FIRST, BLOCK_K, TG, GROUP_SIZE,
                        EVEN_K)  # fmt: skip
    elif FIRST:
        acc2, acc3 = acc0, acc0
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_row(out_ptr, acc, b_ptr, rn, wn, m, M, N, stride_om, HAS_BIAS: tl.constexpr):
    out = tl.sum(acc, axis=1)  # [BN]
    if HAS_BIAS:
        out += tl.load(b_ptr + wn).to(tl.float32)
    mask = (rn < N) & (rn * 0 + m < M)
    tl.store(out_ptr + m * stride_om + rn, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    ONE,  # 0x3F800000, the bits of 1.0f, at run time: kept in a register, masks immediate
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TG: tl.constexpr,
    GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    GDC: tl.constexpr,  # signal, then wait for the kernel before after the first weights' loads
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = tl.minimum(rn, N - 1).to(tl.int64)  # past N: re-read the last row, store nothing
    q_rows = q_ptr + wn[:, None, None] * stride_qn  # [BN, 1, 1]
    s_rows = s_ptr + wn[:, None] * stride_sn  # [BN, 1]
    z_rows = z_ptr + wn[:, None] * stride_sn
    # the first tile peeled: its words, scales and zeros, which no kernel before writes, are read
    # before the wait
    words, s, z = _tile_loads(q_rows, s_rows, z_rows, 0, K, BLOCK_K, TG, GROUP_SIZE, EVEN_K)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    accs = _gemv_tile(
        (0, 0, 0, 0), words, s, z, x_ptr, s_rows, z_rows, g_ptr, 0, M, K, stride_xm, ONE, True,
        BLOCK_M, BLOCK_K, TG, GROUP_SIZE, EVEN_K,
    )  # fmt: skip
    for k0 in range(BLOCK_K, K, BLOCK_K):
        words, s, z = _tile_loads(q_rows, s_rows, z_rows, k0, K, BLOCK_K, TG, GROUP_SIZE, EVEN_K)
        accs = _gemv_tile(
            accs, words, s, z, x_ptr, s_rows, z_rows, g_ptr, k0, M, K, stride_xm, ONE, False,
            BLOCK_M, BLOCK_K, TG, GROUP_SIZE, EVEN_K,
        )  # fmt: skip
    acc0, acc1, acc2, acc3 = accs
    _store_row(out_ptr, acc0, b_ptr, rn, wn, 0, M, N, stride_om, HAS_BIAS)
    if BLOCK_M > 1:
        _store_row(out_ptr, acc1, b_ptr, rn, wn, 1, M, N, stride_om, HAS_BIAS)
    if BLOCK_M > 2:
        _store_row(out_ptr, acc2, b_ptr, rn, wn, 2, M, N, stride_om, HAS_BIAS)
        _store_row(out_ptr, acc3, b_ptr, rn, wn, 3, M, N, stride_om, HAS_BIAS)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV
Config = tuple[int, int, int, int]


def pick_config(n: int, k: int, m: int = 1) -> Config:
    """The GEMV tile for an [N, K] weight and M rows. One row of x: the best tiles of the H200
    sweep (benchmarks/kernels/w4a16.py --sweep) on llama-3-8b's shapes: wide weights (N >=
    16,384, gate_up) sixteen rows a program, 256-input K steps, one warp; others four rows a
    program, 2,048-input steps, four warps past N = 4,096 and two up to it. Two to four rows of
    x: two rows a program, 1,024-input steps, one warp (each row of x adds its planes and
    products: ~140 registers at 4). num_stages leaves this kernel's code as it is (no pipelined
    loads)."""
    if m <= 1:
        if n >= 16384:
            return 16, min(256, triton.next_power_of_2(k)), 1, 1
        return 4, min(2048, triton.next_power_of_2(k)), 4 if n > 4096 else 2, 1
    return 2, min(1024, triton.next_power_of_2(k)), 1, 3


def w4a16_gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_M
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G]
    g_idx: torch.Tensor,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
    group_size: int = 0,  # > 0: contiguous groups (g_idx unread); 0: gather by g_idx
    config: Config | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ W.T (+ bias)`` on the CUDA cores for decode. ``config``: (BLOCK_N, BLOCK_K,
    num_warps, num_stages), default ``pick_config``; BLOCK_K may shrink to fit the group
    (``slice_size``). ``pdl`` (default: ``kernels.pdl.use_pdl``): on an sm_90+ GPU, launch with
    programmatic dependent launch, waiting for the kernel before only after the first weight
    tiles' loads (so ``qweight``, ``scales``, ``zeros`` must be written by no kernel of the
    stream). x's tile is split into its eight planes through shared memory."""
    _check(x, qweight, scales, zeros, g_idx, bias)
    if x.shape[0] > MAX_M:
        raise ValueError(f"w4a16_gemv handles at most {MAX_M} rows, got {x.shape[0]}")
    m, k = x.shape
    n = qweight.shape[0]
    block_n, block_k, warps, stages = config or pick_config(n, k, m)
    gs = _group(group_size)
    block_k, tg = slice_size(block_k, gs, k)
    gdc = (_pdl.use_pdl(x.device) if pdl is None else pdl) and _pdl.device_supports(x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, g_idx, bias if bias is not None else scales, out, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), 0x3F800000,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, TG=tg,
        GROUP_SIZE=gs, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, GDC=gdc,
        num_warps=warps, num_stages=stages, enable_fp_fusion=True, **_pdl.launch_options(gdc),
    )  # fmt: skip
    return out
