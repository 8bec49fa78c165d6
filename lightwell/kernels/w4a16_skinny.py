"""W4A16 matmul for a few rows of x (batched decode, 2-16 rows): ``_w4a16_skinny_kernel``, over
kernels/w4a16.py's layout (its module docstring describes it).

Each program owns BLOCK_N output columns (and, split over K, a share of the K tiles) and walks K
in tiles that lie inside one group, so a tile's scale and zero point are one value per column:
the tile adds ``scale[n] * P`` with ``P = sum_k x[m, k] * (q[n, k] - zero[n])``. P is eight
tensor-core dots, one per value position j of the words: the j-th nibbles of a [BLOCK_N,
BLOCK_K / 8] word tile minus the zero point (small integers in the activation dtype: exact)
against x's columns ``8w + j``. For 16-bit x two nibbles (j and j + 4) are masked at once into
the mantissas of a pair of 16-bit floats whose exponent makes a mantissa step 1, and the zero
point (plus that exponent's value) is subtracted from the pair in one packed instruction: about
half an instruction a weight for each of mask, subtract and pairing the halves for the tensor
cores. No multiply by the scale per weight, no interleave back into input order. Rows of x past
M re-read row M - 1 and are not stored.

Split over K (``SPLIT_K`` > 1: the narrow weights, whose columns alone give too few programs),
each program stores its fp32 partial sums and counts itself in a per-column-tile counter; the
last one of a tile adds the partials, writes the output and resets the counter to zero, so the
counters (one zeroed buffer per device, kernels/split_counters.py) are ready for the next call
and CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels.split_counters import last_to_arrive, split_counters
from lightwell.kernels.w4a16 import _planes

MAX_M = 16

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, SWAP, X_SPLIT)
Config = tuple[int, int, int, int, int, bool, bool]


@triton.jit
def _plane(words, J: tl.constexpr, zo):
    """Value J of each word minus its column's zero point, exact in zo's dtype (zo: [BN, 1],
    the zero points plus ``_offset``). 16-bit: values J and J + 4 as the two halves of a word
    ``(words >> 4 (J % 4)) & 0x000F000F`` ORed with the exponent of 128 (bf16) or 1024 (fp16), so
    each half reads 128 + q or 1024 + q (the two planes share the mask once compiled); fp32: the
    nibble in the mantissa of 2^23. No integer-to-float conversion."""
    if zo.dtype == tl.float32:
        f = (((words >> (4 * J)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        return f - zo
    if zo.dtype == tl.bfloat16:
        pair = ((words >> (4 * (J % 4))) & 0x000F000F) | 0x43004300
    else:
        pair = ((words >> (4 * (J % 4))) & 0x000F000F) | 0x64006400
    if J >= 4:
        pair = pair >> 16
    return pair.to(tl.int16).to(zo.dtype, bitcast=True) - zo


@triton.jit
def _offset(dtype: tl.constexpr):
    """What ``_plane``'s float reads for a nibble of 0 in ``dtype``: the float whose mantissa
    step is 1 (bits 0x4300, 0x6400, 0x4B000000)."""
    if dtype == tl.bfloat16:
        return 128.0
    if dtype == tl.float16:
        return 1024.0
    return 8388608.0


@triton.jit
def _x_planes(x_rows, k0, BLOCK_K: tl.constexpr):
    """x[:, k0 : k0 + BLOCK_K] as its eight [BM, BLOCK_K / 8] planes (plane j: inputs 8w + j),
    from one contiguous load split in registers."""
    x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :])  # [BM, BK]
    return _planes(tl.reshape(x, [x.shape[0], BLOCK_K // 8, 2, 2, 2]))


@triton.jit
def _plane_dot(p, words, zo, xj, J: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """p plus x's plane J against the words' value J minus the zero point ([BM, BN]; SWAP:
    [BN, BM])."""
    qj = _plane(words, J, zo)
    if SWAP:
        p = tl.dot(qj, tl.trans(xj), p, input_precision=PRECISION)
    else:
        p = tl.dot(xj, tl.trans(qj), p, input_precision=PRECISION)
    return p


@triton.jit
def _tile_sums(
    x_rows, q_rows, zo, k0,
    BLOCK_K: tl.constexpr, SWAP: tl.constexpr, X_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """P of the K tile at k0: x @ (q - zero).T ([BM, BN]; SWAP: [BN, BM]). x_rows [BM, 1], q_rows
    [BN, 1]: row pointers; zo [BN, 1]: the zero points plus ``_offset`` in x's dtype. X_SPLIT:
    x's planes from one contiguous load (else eight strided loads)."""
    TW: tl.constexpr = BLOCK_K // 8
    rw = tl.arange(0, TW)[None, :]  # [1, TW]
    words = tl.load(q_rows + (k0 // 8 + rw))  # [BN, TW]
    if SWAP:
        p = tl.zeros([q_rows.shape[0], x_rows.shape[0]], dtype=tl.float32)
    else:
        p = tl.zeros([x_rows.shape[0], q_rows.shape[0]], dtype=tl.float32)
    if X_SPLIT:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_rows, k0, BLOCK_K)
        p = _plane_dot(p, words, zo, x0, 0, SWAP, PRECISION)
        p = _plane_dot(p, words, zo, x1, 1, SWAP, PRECISION)
        p = _plane_dot(p, words, zo, x2, 2, SWAP, PRECISION)
        p = _plane_dot(p, words, zo, x3, 3, SWAP, PRECISION)
        p = _plane_dot(p, words, zo, x4, 4, SWAP, PRECISION)
        p = _plane_dot(p, words, zo, x5, 5, SWAP, PRECISION)
        p = _plane_dot(p, words, zo, x6, 6, SWAP, PRECISION)
        p = _plane_dot(p, words, zo, x7, 7, SWAP, PRECISION)
    else:
        xk = x_rows + (k0 + 8 * rw)  # [BM, TW]: input 8w of the tile
        for j in tl.static_range(8):
            p = _plane_dot(p, words, zo, tl.load(xk + j), j, SWAP, PRECISION)
    return p


@triton.jit(do_not_specialize=["M"])
def _w4a16_skinny_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # inputs a group, a multiple of BLOCK_K (K: one group a column)
    HAS_BIAS: tl.constexpr, SWAP: tl.constexpr, X_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    FENCE: tl.constexpr,  # compiled for a GPU: split_counters.last_to_arrive's fence
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = tl.minimum(rn, N - 1).to(tl.int64)  # past N: re-read the last column, store nothing
    rm = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + tl.minimum(rm, M - 1)[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    q_rows = q_ptr + wn[:, None] * stride_qn  # [BN, 1]
    tiles = K // BLOCK_K
    per = tl.cdiv(tiles, SPLIT_K)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(pid_k * per, tl.minimum(tiles, pid_k * per + per)):
        k0 = t * BLOCK_K
        g = k0 // GROUP_SIZE
        sc = tl.load(s_ptr + wn * stride_sn + g).to(tl.float32)
        zp = tl.load(z_ptr + wn * stride_sn + g).to(tl.float32) + _offset(x_ptr.dtype.element_ty)
        zo = zp.to(x_ptr.dtype.element_ty)[:, None]  # exact: integer zero points
        p = _tile_sums(x_rows, q_rows, zo, k0, BLOCK_K, SWAP, X_SPLIT, PRECISION)
        if SWAP:
            acc += p * sc[:, None]
        else:
            acc += p * sc[None, :]
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tile = rm[:, None] * N + rn[None, :]  # [BM, BN] in one split's [BLOCK_M, N] partials
        tl.store(part_ptr + pid_k * BLOCK_M * N + tile, acc, mask=omask)
        if last_to_arrive(cnt_ptr + pid_n, SPLIT_K, rn, FENCE):
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=omask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
            _store(out_ptr, acc, b_ptr, rm, rn, wn, omask, stride_om, HAS_BIAS)
    else:
        _store(out_ptr, acc, b_ptr, rm, rn, wn, omask, stride_om, HAS_BIAS)


@triton.jit
def _store(out_ptr, acc, b_ptr, rm, rn, wn, omask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + wn).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)


def supports(m: int, k: int, group_size: int) -> bool:
    """Whether the kernel takes this call: 2..MAX_M rows, contiguous groups (or one group a
    column) that a 128-input tile divides."""
    return (
        2 <= m <= MAX_M
        and k % 128 == 0
        and group_size > 0
        and (group_size % 128 == 0 or group_size >= k)
    )


def pick_config(n: int, k: int, m: int) -> Config:
    """The tile for an [N, K] weight and M rows (the same at every M): the best of 36 tiles
    (BLOCK_N 64-256, SPLIT_K 2-16, 2-8 warps, BLOCK_K 128, 3 stages) timed on an H200 at
    llama-3-8b's TP=1 shapes and 1-16 rows, the weights as the dot's first operand, x read
    whole: wide weights (N >= 16,384, gate_up) 256 columns a program, K split in
    2; others 128 columns, K split in 8, on eight warps where K is long (> 4,096, down)."""
    if n >= 16384:
        return 256, 128, 2, 4, 3, True, True
    return 128, 128, 8, 8 if k > 4096 else 4, 3, True, True


def w4a16_skinny(
    x: torch.Tensor,  # [M, K], 2 <= M <= MAX_M
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G]
    bias: torch.Tensor | None = None,  # [N]
    group_size: int = 128,
    config: Config | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ W.T (+ bias)`` for a few rows (``supports``), on the tensor cores. ``config``:
    (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, SWAP, X_SPLIT), default ``pick_config``."""
    m, k = x.shape
    n = qweight.shape[0]
    if not supports(m, k, group_size):
        raise ValueError(f"w4a16_skinny: M={m}, K={k}, group {group_size} not supported")
    block_n, block_k, split, warps, stages, swap, x_split = config or pick_config(n, k, m)
    gs = k if group_size >= k else group_size
    if gs % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide K ({k}) and the group ({gs})")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles_n = triton.cdiv(n, block_n)
    split = max(1, min(split, k // block_k))
    part = out
    cnt = scales
    if split > 1:
        part = torch.empty((split, MAX_M, n), dtype=torch.float32, device=x.device)
        cnt = split_counters(x.device, tiles_n)
    _w4a16_skinny_kernel[(tiles_n, split)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, part, cnt,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, GROUP_SIZE=gs,
        HAS_BIAS=bias is not None, SWAP=swap, X_SPLIT=x_split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        FENCE=not envs.triton_interpret(), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
