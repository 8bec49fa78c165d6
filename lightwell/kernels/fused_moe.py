"""Fused mixture-of-experts MLP: tokens sorted by expert, one grouped GEMM launch per projection.

    out[t] = sum_j w[t, j] * W2[e_tj] @ (silu(W1[e_tj] @ x[t]) * W3[e_tj] @ x[t])

``align_by_expert`` (kernels/moe_pairs.py) sorts the (token, choice) pairs by expert and pads
each expert's run to a multiple of ``BLOCK_M`` (on the device, no host sync); every ``BLOCK_M``
rows then belong to one expert. ``_gate_up_kernel``: per row block and ``BLOCK_N`` columns of
the intermediate size, the gate and up products over H for the block's expert,
``silu(gate) * up`` in the epilogue -> [T * k, I]. ``_down_kernel``: per row block and
``BLOCK_N`` columns of H, the down product over I, times the pair's router weight in the
epilogue -> [T * k, H]; ``sum_pairs`` (kernels/moe_pairs.py) then sums each token's k pairs
(and adds the shared experts' output when given). Programs take the column tiles of ``GROUP_M``
row blocks before moving on (``_tile_ids``), so that what they read is shared in L2. Blocks
past the experts' runs exit at once, so a batch of one token reads only its chosen experts'
weights.
Expert ids outside ``[0, E)`` (another rank's experts under expert parallelism) are skipped.
Steps of a few tokens (``moe_gemv_rule.use_gemv``: decode) skip the sort and take the GEMV
kernels of kernels/moe_gemv.py instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lightwell.kernels.act_quant import act_quant, fp8_groups
from lightwell.kernels.moe_gemv import Config, moe_gemv
from lightwell.kernels.moe_gemv_rule import use_gemv
from lightwell.kernels.moe_pairs import align_by_expert, sum_pairs
from lightwell.kernels.w4a16 import _unpack


@triton.jit
def _tile_ids(num_blocks_m, NUM_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: ``GROUP_M`` row blocks at a time, every
    column tile of them before the next group, so that consecutive programs share their row
    blocks' inputs and their expert's weights in L2."""
    pid = tl.program_id(0)
    per_group = GROUP_M * NUM_N
    first = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_blocks_m - first, GROUP_M)
    return first + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _b_tile(w, rows, rows_ok, k0, ks, k_ok, z_rows, kb, dtype,
            INT4: tl.constexpr, KW: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] weight tile of ``rows`` over inputs ``ks`` (= k0 + [0, BLOCK_K)),
    in ``dtype``: as stored (16/32-bit; fp8, converted exactly), or int4 words
    unpacked minus their zero points (``z_rows``: [BLOCK_N] pointers to each row's zeros; ``kb``:
    the tile's group): integers, exact in any float dtype. ``KW``: a row's stored elements."""
    if INT4:  # [BN, BK / 8] words, unpacked in input order (kernels/w4a16.py's _unpack)
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK / 8]
        mask = rows_ok[:, None] & (kw[None, :] < KW)
        words = tl.load(w + rows[:, None] * KW + kw[None, :], mask=mask, other=0)
        z = tl.load(z_rows + kb).to(tl.float32)
        tile = tl.trans(_unpack(words, z[:, None])).to(dtype)
    else:  # (one return: the compiler types every return of a constexpr branch)
        mask = k_ok[:, None] & rows_ok[None, :]
        tile = tl.load(w + rows[None, :] * KW + ks[:, None], mask=mask, other=0.0).to(dtype)
    return tile


@triton.jit
def _a_scales(ptr, rows, rows_ok, KS: tl.constexpr, kb, A_SCALED: tl.constexpr):
    """[BLOCK_M, 1] scales of fp8 activation ``rows`` for K block ``kb`` of ``KS`` ([rows, KS]
    fp32 at ``ptr``), or ones for activations in their own dtype (one return: the compiler
    types every return of a constexpr branch)."""
    if A_SCALED:
        s = tl.load(ptr + rows * KS + kb, mask=rows_ok, other=0.0)
    else:
        s = tl.where(rows_ok, 1.0, 1.0)
    return s[:, None]


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])  # (per-step counts: no variants)
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2 * I, H] (int4: [E, 2 * I, H / 8] int32 words)
    out_ptr,  # [T * k, I]
    sorted_ptr,  # [P]
    expert_ptr,  # [P / BLOCK_M]
    s_ptr,  # SCALED: [E, 2 * I / SBN, ceil(H / SBK)] fp32 block scales (fp8), or group scales
    z_ptr,  # INT4: [E, 2 * I, H / SBK] zero points
    xs_ptr,  # A_SCALED: [T, ceil(H / SBK)] fp32 scales of x (fp8) per row and scale block
    num_pairs,  # T * k
    num_blocks_m,  # P / BLOCK_M
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,  # fp8 or int4 weights with scales (else 16/32-bit, SBN = SBK = 1)
    SBN: tl.constexpr,  # the scale blocks' rows (fp8: bn; int4: 1)
    SBK: tl.constexpr,  # their inputs (fp8: bk; int4: the group size), a multiple of BLOCK_K
    INT4: tl.constexpr,
    A_SCALED: tl.constexpr,  # x in fp8 with scales like the weights' along K: fp8 dots
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_blocks_m, (INTER + BLOCK_N - 1) // BLOCK_N, GROUP_M)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs
    token = pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    KW: tl.constexpr = HIDDEN // 8 if INT4 else HIDDEN
    w = w_ptr + expert * (2 * INTER * KW)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    KS: tl.constexpr = (HIDDEN + SBK - 1) // SBK
    SROWS: tl.constexpr = 2 * INTER // SBN
    gate_off = expert * (SROWS * KS) + (tl.minimum(cols, INTER - 1) // SBN) * KS
    up_off = gate_off + INTER // SBN * KS  # [BN]; rows past I: the last row's
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HIDDEN
        a = tl.load(x_ptr + token[:, None] * HIDDEN + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        kb = k0 // SBK
        gate = _b_tile(w, cols, col_ok, k0, ks, k_ok, z_ptr + gate_off, kb, a.dtype, INT4, KW,
                       BLOCK_K)  # fmt: skip
        up = _b_tile(w, INTER + cols, col_ok, k0, ks, k_ok, z_ptr + up_off, kb, a.dtype, INT4, KW,
                     BLOCK_K)  # fmt: skip
        if SCALED and SBK < HIDDEN:  # scaled per column and K chunk after the dot
            xs = _a_scales(xs_ptr, token, row_ok, KS, kb, A_SCALED)
            acc_gate += tl.dot(a, gate) * tl.load(s_ptr + gate_off + kb)[None, :] * xs
            acc_up += tl.dot(a, up) * tl.load(s_ptr + up_off + kb)[None, :] * xs
        else:
            acc_gate = tl.dot(a, gate, acc_gate)
            acc_up = tl.dot(a, up, acc_up)
    if SCALED and SBK >= HIDDEN:  # one scale a row over all of H: scaled once
        xs = _a_scales(xs_ptr, token, row_ok, 1, 0, A_SCALED)
        acc_gate *= tl.load(s_ptr + gate_off).to(tl.float32)[None, :] * xs
        acc_up *= tl.load(s_ptr + up_off).to(tl.float32)[None, :] * xs
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(out_ptr + pair[:, None] * INTER + cols[None, :], act.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])  # (per-step counts: no variants)
def _down_kernel(
    a_ptr,  # [T * k, I]
    w_ptr,  # [E, H, I] (int4: [E, H, I / 8] int32 words)
    weight_ptr,  # [T * k] router weights
    out_ptr,  # [T * k, H]
    sorted_ptr,  # [P]
    expert_ptr,  # [P / BLOCK_M]
    s_ptr,  # SCALED: [E, ceil(H / SBN), I / SBK] fp32 block scales (fp8), or group scales
    z_ptr,  # INT4: [E, H, I / SBK] zero points
    as_ptr,  # A_SCALED: [T * k, I / SBK] fp32 scales of a (fp8) per row and scale block
    num_pairs,
    num_blocks_m,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,  # as _gate_up_kernel's
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    INT4: tl.constexpr,
    A_SCALED: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_blocks_m, (HIDDEN + BLOCK_N - 1) // BLOCK_N, GROUP_M)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HIDDEN
    KW: tl.constexpr = INTER // 8 if INT4 else INTER
    w = w_ptr + expert * (HIDDEN * KW)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    KS: tl.constexpr = (INTER + SBK - 1) // SBK
    SROWS: tl.constexpr = (HIDDEN + SBN - 1) // SBN
    off = expert * (SROWS * KS) + (tl.minimum(cols, HIDDEN - 1) // SBN) * KS  # [BN]
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        a = tl.load(a_ptr + pair[:, None] * INTER + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        kb = k0 // SBK
        b = _b_tile(w, cols, col_ok, k0, ks, k_ok, z_ptr + off, kb, a.dtype, INT4, KW, BLOCK_K)
        if SCALED and SBK < INTER:  # scaled per column and K chunk after the dot
            a_s = _a_scales(as_ptr, pair, row_ok, KS, kb, A_SCALED)
            acc += tl.dot(a, b) * tl.load(s_ptr + off + kb)[None, :] * a_s
        else:
            acc = tl.dot(a, b, acc)
    if SCALED and SBK >= INTER:  # one scale a row over all of I: scaled once
        a_s = _a_scales(as_ptr, pair, row_ok, 1, 0, A_SCALED)
        acc *= tl.load(s_ptr + off).to(tl.float32)[None, :] * a_s
    scale = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(out_ptr + pair[:, None] * HIDDEN + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


# fp8 experts' block scales: (w13's [E, 2I / bn, ceil(H / bk)], w2's [E, ceil(H / bn), I / bk],
# (bn, bk)) float32
Scales = tuple[torch.Tensor, torch.Tensor, tuple[int, int]]
# int4 experts (w13 [E, 2I, H / 8], w2 [E, H, I / 8] int32 words, value j of a word at bits 4j):
# (w13 scales, w13 zeros [E, 2I, H / g13], w2 scales, w2 zeros [E, H, I / g2], g13, g2)
Int4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]
# the block of fp8 experts with one scale a row (scales [E, 2I, 1], [E, H, 1]): all of K
ROW = (1, 0)


def _check_quant(w13: torch.Tensor, hidden: int, inter: int, scales, int4) -> None:
    num_experts = w13.shape[0]
    if (scales is not None) != (w13.dtype == torch.float8_e4m3fn):
        raise ValueError("fused_moe: fp8 experts need their block scales (and only they)")
    if (int4 is not None) != (w13.dtype == torch.int32):
        raise ValueError("fused_moe: int4 experts need their group scales and zeros (only they)")
    if scales is not None and scales[2] == ROW:
        want, tensors = [(num_experts, 2 * inter, 1), (num_experts, hidden, 1)], scales[:2]
    elif scales is not None:
        bn, bk = scales[2]
        want = [(num_experts, 2 * inter // bn, -(-hidden // bk)),
                (num_experts, -(-hidden // bn), inter // bk)]  # fmt: skip
        if inter % bn or inter % bk or bk & (bk - 1) or bk < 16:
            raise ValueError(f"fused_moe: block {scales[2]} does not fit I = {inter}")
        tensors = scales[:2]
    if int4 is not None:
        g13, g2 = int4[4:]
        if hidden % g13 or inter % g2 or g13 % 16 or g2 % 16:
            raise ValueError(f"fused_moe: groups {g13}, {g2} do not fit H = {hidden}, I = {inter}")
        shape13, shape2 = (
            (num_experts, 2 * inter, hidden // g13),
            (num_experts, hidden, inter // g2),
        )
        want, tensors = [shape13, shape13, shape2, shape2], int4[:4]
    if scales is not None or int4 is not None:
        contiguous = all(t.is_contiguous() for t in tensors)
        if [tuple(t.shape) for t in tensors] != want or not contiguous:
            raise ValueError(
                f"fused_moe: scales (zeros) do not fit experts of H {hidden}, I {inter}"
            )


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights, ids, scales, int4):
    per = 8 if w13.dtype == torch.int32 else 1  # values a stored element
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * per
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit w13 {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2 // per):
        raise ValueError(f"w2 {tuple(w2.shape)} does not fit w13 {tuple(w13.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)} for {x.shape}")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe wants contiguous x, w13 and w2")
    _check_quant(w13, hidden, two_inter // 2, scales, int4)
    return num_experts, hidden, two_inter // 2


# Row blocks whose column tiles the grouped kernels' programs take in turn (``_tile_ids``).
GROUP_M = 8


def pick_block_m(per_expert: float, small_tiles: bool) -> int:
    """Rows an expert block holds, from the mean (token, expert) pairs an expert gets;
    128-row blocks only where the larger tiles apply (16-bit unquantized experts)."""
    if per_expert <= 16:
        return 16
    if per_expert <= 64:
        return 32
    return 64 if per_expert <= 128 or small_tiles else 128


def grouped_tiles(block_m: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, warps, stages) of the grouped kernels for ``block_m`` rows of 16-bit
    unquantized experts (other experts take (64, 64, 4, 3)); ``python3 -m
    benchmarks.kernels.fused_moe --sweep`` times the alternatives."""
    if block_m >= 128:
        return 128, 64, 8, 3
    if block_m >= 64:
        return 128, 64, 4, 4
    return 64, 64, 4, 3


def w8a8_tiles(per_expert: float, rows: bool) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, warps, stages) of the grouped kernels on fp8 activations
    (``w8a8``), from the mean (token, expert) pairs an expert gets, after the H200 sweep of
    ``python3 -m benchmarks.workloads.moe_quant --sweep`` (kernels_moe_w8a8_sweep_h200.json).
    Row-scaled experts (``rows``; Mixtral's shapes): 32-row blocks up to 32 pairs an expert,
    then 128-row blocks (fewer row blocks: each expert's weights read fewer times). Block
    experts (DeepSeek-V3's), whose K tiles are scaled one by one: 16, 32, then 64 rows (at 128
    rows the two [128, 128] fp32 products a step cost twice the time)."""
    if rows:
        return (32, 128, 128, 4, 3) if per_expert <= 32 else (128, 128, 128, 8, 4)
    if per_expert <= 8:
        return 16, 64, 128, 4, 3
    return (32, 128, 128, 4, 3) if per_expert <= 32 else (64, 64, 128, 4, 3)


def grouped_variants(quant: dict, act_dtype: torch.dtype) -> list[dict]:
    """fused_moe's tile keyword arguments of every grouped-kernel variant a step can pick for
    experts with these kernel inputs (``quant``: fused_moe's quantization keywords) and
    activations in ``act_dtype``: what start-up compiles before serving."""
    if quant.get("w8a8"):
        rows = quant["scales"][2] == ROW
        tiles = {w8a8_tiles(n, rows) for n in (1, 16, 64)}
        keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
        return [dict(zip(keys, t)) for t in sorted(tiles)]
    large = not (quant.get("scales") or quant.get("int4")) and act_dtype.itemsize == 2
    return [dict(block_m=m) for m in ((16, 32, 64, 128) if large else (16, 32, 64))]


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows, then up rows (16/32-bit, fp8, int4 words)
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids (outside [0, E): skipped)
    block_m: int | None = None,  # default: from the mean tokens per expert (16 to 128)
    block_n: int | None = None,  # default (and the launch options): grouped_tiles(block_m)
    block_k: int | None = None,
    gemv: bool | None = None,  # the few-token GEMV kernels; default: moe_gemv_rule.use_gemv
    gemv_configs: tuple[Config, Config] | None = None,  # theirs (gate/up, down); default: picked
    scales: Scales | None = None,  # fp8 experts: their block scales (ROW: one a row)
    int4: Int4 | None = None,  # int4 experts: their group scales and zeros
    w8a8: bool = False,  # fp8 experts: activations in fp8 too (grouped path)
    num_shared: int = 0,  # the last S experts are every token's, weight 1 (GEMV path only)
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,  # row blocks a program group spans (default GROUP_M)
    add: torch.Tensor | None = None,  # [T, H]: added to the output
) -> torch.Tensor:  # [T, H]
    """The grouped kernels (tiles ``block_m``/``block_n``/``block_k``) or, for a few tokens,
    kernels/moe_gemv.py's (the choice depends only on the shapes: CUDA-graph safe).
    Quantized experts are weight-only: x stays in its dtype; each weight tile is converted to
    it exactly (fp8 values; int4 values minus their zero points), and its dot product scaled
    per column by the scale of its block (fp8) or group (int4): a K tile lies in one. A scale
    that covers a whole row (int4 groups of all K; fp8 experts with ``ROW`` blocks: one scale
    a row) is applied once after the grouped kernels' K loop, the dots accumulating in the
    MMA. With ``w8a8`` (fp8 experts) the
    grouped path quantizes x and the activation before down to fp8, dynamic, with scales
    shaped as the weights' along K (row-scaled experts: a scale a row, kernels/act_quant.py;
    block experts: a scale per row and bk inputs, act_quant.py's ``fp8_groups``) and runs
    fp8 dots, each product scaled by its row's and column's scales; the GEMV path stays
    weight-only."""
    dims = _check(x, w13, w2, weights, ids, scales, int4)  # E, H, I
    if w8a8 and (scales is None or scales[2] != ROW and scales[2][1] < 32 and x.is_cuda):
        raise ValueError("fused_moe: w8a8 needs fp8 experts (bk >= 32 on a GPU: fp8 dots)")
    num_experts = dims[0]
    num_tokens, top_k = ids.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    if use_gemv(num_tokens, top_k + num_shared, num_experts) if gemv is None else gemv:
        configs = gemv_configs or (None, None)
        if num_shared and (scales is not None or int4 is not None):
            raise ValueError("fused_moe: shared experts are supported in 16/32-bit experts only")
        if scales is not None or int4 is not None:
            from lightwell.kernels.moe_gemv_quant import moe_gemv_quant

            out = moe_gemv_quant(x, w13, w2, weights, ids, scales, int4, *configs)
        else:
            out = moe_gemv(x, w13, w2, weights, ids, *configs, num_shared=num_shared)
        return out if add is None else out + add
    if num_shared:
        raise ValueError("fused_moe: shared experts are supported on the GEMV path only")
    # the larger tiles are sized for 16-bit unquantized experts (shared memory, registers)
    large = scales is None and int4 is None and x.element_size() == 2
    per_expert = num_tokens * top_k / num_experts
    if w8a8:
        picked = w8a8_tiles(per_expert, scales[2] == ROW)
        block_m, tiles = block_m or picked[0], picked[1:]
    else:
        if block_m is None:
            block_m = pick_block_m(per_expert, not large)
        tiles = grouped_tiles(block_m) if large else (64, 64, 4, 3)
    tile = (block_m, block_n or tiles[0], block_k or tiles[1], num_warps or tiles[2],
            num_stages or tiles[3], group_m or GROUP_M)  # fmt: skip
    return _grouped(x, w13, w2, weights, ids, dims, tile, scales, int4, add, w8a8)


def _grouped(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k]
    dims: tuple[int, int, int],  # E, H, I
    tile: tuple[int, int, int, int, int, int],  # block m / n / k, warps, stages, GROUP_M
    scales: Scales | None,
    int4: Int4 | None,
    add: torch.Tensor | None,  # [T, H]
    w8a8: bool = False,  # fp8 activations
) -> torch.Tensor:  # [T, H]
    """The grouped path: pairs sorted by expert, the gate/up and down launches, the pair sum."""
    (num_experts, hidden, inter), (num_tokens, top_k) = dims, ids.shape
    pairs = num_tokens * top_k
    block_m, block_n, block_k, num_warps, num_stages, group_m = tile
    if int4 is not None:
        s13, z13, s2, z2, g13, g2 = int4
        block_k = min(block_k, g13 & -g13, g2 & -g2)  # a K tile inside one group
        quant = dict(SCALED=True, INT4=True)
        sb13, sb2 = (1, g13), (1, g2)
    elif scales is not None and scales[2] == ROW:  # a scale a row: over all of K
        s13, s2 = z13, z2 = scales[:2]
        sb13, sb2 = (1, hidden), (1, inter)
        quant = dict(SCALED=True, INT4=False)
    elif scales is not None:
        s13, s2, sb13 = *scales[:2], scales[2]
        z13, z2, sb2 = s13, s2, sb13
        block_k = min(block_k, sb13[1] & -sb13[1])  # a K tile inside one scale block
        quant = dict(SCALED=True, INT4=False)
    else:
        s13 = z13 = s2 = z2 = x
        sb13 = sb2 = (1, block_k)
        quant = dict(SCALED=False, INT4=False)
    if w8a8 and x.is_cuda and block_k < 32:
        raise ValueError(f"fused_moe: w8a8 needs block_k >= 32 on a GPU (fp8 dots), got {block_k}")
    sorted_ids, block_expert = align_by_expert(ids, num_experts, block_m)
    blocks_m = block_expert.numel()
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **quant, GROUP_M=group_m,
                  A_SCALED=w8a8, num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    a, xs = _fp8_activations(x, sb13[1]) if w8a8 else (x, x)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks_m * triton.cdiv(inter, block_n),)](
        a, w13, act, sorted_ids, block_expert, s13, z13, xs, pairs, blocks_m, TOP_K=top_k,
        HIDDEN=hidden, INTER=inter, SBN=sb13[0], SBK=sb13[1], **launch,
    )  # fmt: skip
    a, act_s = _fp8_activations(act, sb2[1]) if w8a8 else (act, act)
    per_pair = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(blocks_m * triton.cdiv(hidden, block_n),)](
        a, w2, flat_weights, per_pair, sorted_ids, block_expert, s2, z2, act_s, pairs, blocks_m,
        HIDDEN=hidden, INTER=inter, SBN=sb2[0], SBK=sb2[1], **launch,
    )  # fmt: skip
    return sum_pairs(per_pair, ids, num_experts, add)


def _fp8_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] in fp8 with a scale per row and ``group`` inputs: ([M, K], [M, ceil(K /
    group)] float32); one launch when a group spans the row."""
    if group >= x.shape[1]:
        return act_quant(x, torch.float8_e4m3fn)
    q, scale = fp8_groups(x, group)
    return q.contiguous(), scale.contiguous()


def dequantize_experts(
    w: torch.Tensor,  # [E, N, K] fp8
    scale: torch.Tensor,  # [E, ceil(N / bn), ceil(K / bk)] ([E, N, 1] for ROW)
    block: tuple[int, int],
) -> torch.Tensor:  # [E, N, K] float32
    n, k = w.shape[1:]
    if block == ROW:
        return w.float() * scale.float()
    s = scale.float().repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    return w.float() * s[:, :n, :k]


def dequantize_int4_experts(
    words: torch.Tensor,  # [E, N, K / 8] int32, value j of a word at bits 4j
    scales: torch.Tensor,  # [E, N, K / group]
    zeros: torch.Tensor,  # [E, N, K / group]
    group: int,
) -> torch.Tensor:  # [E, N, K] float32
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    q = ((words[..., None] >> shifts) & 0xF).flatten(-2).float()  # [E, N, K]
    g = torch.arange(q.shape[-1], device=words.device) // group
    return (q - zeros.float()[..., g]) * scales.float()[..., g]


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k]
    scales: Scales | None = None,  # fp8 experts: dequantized first
    int4: Int4 | None = None,  # int4 experts: dequantized first
    num_shared: int = 0,  # the last S experts: every token's, weight 1
) -> torch.Tensor:  # [T, H]
    """Every (token, choice) pair on its own, in fp32."""
    if num_shared:
        weights, ids = with_shared(weights, ids, w13.shape[0], num_shared)
    if scales is not None:
        w13 = dequantize_experts(w13, scales[0], scales[2])
        w2 = dequantize_experts(w2, scales[1], scales[2])
    if int4 is not None:
        w13 = dequantize_int4_experts(w13, int4[0], int4[1], int4[4])
        w2 = dequantize_int4_experts(w2, int4[2], int4[3], int4[5])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    num_experts = w13.shape[0]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < num_experts:
                gate, up = (w13[e].float() @ x[t].float()).chunk(2)
                out[t] += float(weights[t, j]) * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)


def with_shared(
    weights: torch.Tensor,  # [T, k] router weights
    ids: torch.Tensor,  # [T, k] expert ids
    num_experts: int,  # stacked experts, the last ``num_shared`` of them shared
    num_shared: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k + S] weights, [T, k + S] ids)
    """The routed choices followed by the shared experts (weight 1), as ``num_shared`` asks."""
    shared = torch.arange(num_experts - num_shared, num_experts, device=ids.device)
    shared = shared.to(ids.dtype).expand(ids.shape[0], num_shared)
    ones = torch.ones(ids.shape[0], num_shared, dtype=weights.dtype, device=weights.device)
    return torch.cat([weights, ones], 1), torch.cat([ids, shared], 1)
