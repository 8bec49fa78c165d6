"""Paged flash attention over a flat batch of requests (prefill, prefix-cached prefill, decode).

Request i owns tokens ``query_start_loc[i]:query_start_loc[i+1]`` of ``q``; its query j sits at
position ``p = seq_lens[i] - query_len_i + j`` and attends keys ``0..p`` of the request, read from
the paged cache through ``block_table[i]`` (the new tokens' K/V are already stored there).

One kernel serves every shape. A program owns one KV head and a tile of ``BLOCK_Q`` query tokens
times the ``G = Hq / Hkv`` query heads that share it (``BLOCK_M >= 16`` rows, padded), so each K/V
tile is loaded once per group and both products run on tensor cores even for decode. Keys stream
in ``BLOCK_N`` tiles with an online softmax (fp32 accumulators, base-2 exponentials); tiles fully
below the causal diagonal skip the masking. With a sliding window ``W`` (``SLIDING``), query
position p sees keys ``p - W < j <= p``: keys before the window of the tile's first row are never
loaded, and tiles that start before the window of its last row are masked too. With
``SPLIT_KV`` (flash-decoding) the key range is cut into ``grid[2]`` chunks per request, each
program writes a partial (max, sum, acc), and ``split_kv.reduce_splits`` combines them.

An 8-bit cache (fp8 e4m3 or int8, ``KV_QUANT``; blocks of rows of D values, then their fp32
scales, kernels/kv_quant.py) is read as is: the two products run in fp16 for 16-bit queries (bf16
queries convert exactly at fp16's normal magnitudes, the tiles always) and in fp32 for fp32
queries; each key's scale multiplies its scores, and each value's scale its probabilities
(times ``_V_LIFT``, undone at the end, so fp16 probabilities keep their precision); fp16
operands are clamped to fp16's finite range. On a GPU (``V_ASM``) a value tile is converted to
fp16 in registers (``kv_quant.tile_to_f16``), so its fp16 copy reaches the tensor cores through
shared memory the way a 16-bit cache's tile does. Launches of prompt chunks long enough read a
copy of their blocks in the query dtype instead (kernels/kv_dequant.py).

Tiles map to requests without a host sync: virtual tile ids ``query_start_loc[i] // BLOCK_Q + i``
are increasing in i, so a program finds its request by binary search (grid ``T // BLOCK_Q + R``);
when every request fits in one tile (decode) the tile id is the request index.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels.attention_tiles import (
    MAX_HEAD_DIM,
    AttentionConfig,
    default_config,
    load_tile,
    locate_tile,
)
from lightwell.kernels.kv_dequant import copy_for_prefill
from lightwell.kernels.kv_quant import (
    SCALE_BYTES,
    is_quantized,
    load_scales,
    scales_offset,
    tile_to_f16,
)
from lightwell.kernels.pdl import use_pdl
from lightwell.kernels.split_kv import (
    MAX_SPLITS,
    SplitPartials,
    auto_num_splits,
    device_sms,
    reduce_splits,
    store_partials,
)

if TYPE_CHECKING:  # (the metadata's type only: kernels sit below attention/)
    from lightwell.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
# initial running max: finite, so fully masked rows never see inf - inf
_NEG_BIG = tl.constexpr(-1.0e30)
_V_LIFT = tl.constexpr(256.0)  # 8-bit caches: probabilities x value scales x 2**8
_F16_MAX = tl.constexpr(65504.0)


@triton.jit
def _to_f16(x):
    """fp32 to fp16, clamped to its finite range."""
    return tl.minimum(tl.maximum(x, -_F16_MAX), _F16_MAX).to(tl.float16)


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32 (log2 domain)
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    pos,  # [BLOCK_M] query positions
    start_n,
    hi,
    bt_row_ptr,
    k_base,
    v_base,
    ks_base,  # 8-bit: the first block's scales of this KV head (byte pointers)
    vs_base,
    stride_k_blk,
    stride_k_tok,
    stride_v_blk,
    stride_v_tok,
    qk_scale,
    offs_d,
    d_ok,
    window,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    PAD_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    F16_DOT: tl.constexpr,
    V_ASM: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    if MASKED:
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    in_blk = offs_n % BLOCK_SIZE
    k_off = blk * stride_k_blk + in_blk * stride_k_tok  # [BLOCK_N]
    k = load_tile(k_base + k_off[:, None] + offs_d[None, :], n_ok, d_ok, MASKED, PAD_D)
    if KV_QUANT:
        ks = (ks_base + blk * stride_k_blk).to(tl.pointer_type(tl.float32)) + in_blk
        k_scale = load_scales(ks, n_ok, MASKED) * qk_scale  # [BLOCK_N]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * k_scale[None, :]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        if SLIDING:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = blk * stride_v_blk + in_blk * stride_v_tok
    v = load_tile(v_base + v_off[:, None] + offs_d[None, :], n_ok, d_ok, MASKED, PAD_D)
    if KV_QUANT:
        vs = (vs_base + blk * stride_v_blk).to(tl.pointer_type(tl.float32)) + in_blk
        v_scale = load_scales(vs, n_ok, MASKED) * _V_LIFT  # [BLOCK_N]
        if F16_DOT:
            pv = _to_f16(p * v_scale[None, :])
            v = tile_to_f16(v, V_ASM)
        else:
            pv = p * v_scale[None, :]
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


# Per-step integers are not specialised: Triton would otherwise compile a variant for each
# combination of "== 1" / "divisible by 16" among them (seconds each, in the middle of serving).
@triton.jit(
    do_not_specialize=["req_base", "num_reqs", "tok_base", "tile_base", "window", "stride_bt"]
)
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,  # [T, Hq, D], [N, B, Hkv, D(+4)] x2, [T, Hq, D]
    part_acc_ptr, part_m_ptr, part_l_ptr,  # split-KV partials (split_kv.SplitPartials)
    qsl_ptr, seq_lens_ptr, block_table_ptr,  # [R+1] int32, [R] int32, [R, max_blocks] int32
    req_base,  # this launch's first request: its rows of the three tables above
    num_reqs,
    tok_base,  # first token of this launch (partials are indexed from it)
    tile_base,  # tok_base // BLOCK_Q: virtual tile id of program 0
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (keys per query, itself included); read only when SLIDING
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok, stride_v_head,
    stride_bt,
    scale_off,  # 8-bit: bytes from a block's start to its scales (kv_quant.scales_offset)
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # grid[2] > 1: write partials for split_kv.reduce_splits
    SLIDING: tl.constexpr,
    ONE_TILE_PER_REQ: tl.constexpr, PAD_D: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL_SIGNAL: tl.constexpr,  # let a PDL-launched next kernel start now (kernels/pdl.py)
    KV_QUANT: tl.constexpr,  # an 8-bit cache: rows of D values + an fp32 scale
    F16_DOT: tl.constexpr,  # KV_QUANT with 16-bit queries: the products run in fp16
    V_ASM: tl.constexpr,  # F16_DOT on a GPU: value tiles convert by inline PTX (tile_to_f16)
):  # fmt: skip
    if PDL_SIGNAL:
        tl.extra.cuda.gdc_launch_dependents()
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The tables' rows from req_base on, offset here rather than passed as sliced tensors:
    # a slice's address is 16-byte aligned or not by req_base, and Triton would compile a
    # variant for each (a second of stall in the middle of serving).
    qsl_ptr += req_base
    seq_lens_ptr += req_base
    block_table_ptr += req_base.to(tl.int64) * stride_bt
    req, t0 = locate_tile(qsl_ptr, tl.program_id(0), tile_base, num_reqs, BLOCK_Q, ONE_TILE_PER_REQ)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # cached tokens before this request's new ones

    # rows: (query token, query head of this KV group), token-major
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GQA
    head = kvh * GQA + offs_m % GQA
    q_idx = t0 + tok
    row_ok = (tok < BLOCK_Q) & (q_idx < q_len)
    pos = ctx + q_idx  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F16_DOT:  # (the 8-bit tiles convert to fp16 in one instruction)
        q = _to_f16(q.to(tl.float32))

    # this program's keys: [lo, hi) within [kv_start, kv_end), the keys some row can see
    kv_end = tl.minimum(seq_len, ctx + t0 + BLOCK_Q)
    if SLIDING:
        kv_start = tl.maximum(ctx + t0 - window + 1, 0)
    else:
        kv_start = ctx * 0
    if not SPLIT_KV:
        lo = kv_start
        hi = kv_end
    else:
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = kv_start + split * chunk
        hi = tl.minimum(kv_end, lo + chunk)
    # tiles [lo, win_end) start before the last row's window: masked; then unmasked tiles up to
    # full_end (keys <= ctx + t0 are visible to every row); then masked tiles up to hi
    if SLIDING:
        edge = tl.minimum(tl.maximum(ctx + t0 + BLOCK_Q - window - lo, 0), tl.maximum(hi - lo, 0))
        win_end = lo + tl.cdiv(edge, BLOCK_N) * BLOCK_N
    else:
        win_end = lo
    full_end = win_end + tl.maximum(tl.minimum(hi, ctx + t0 + 1) - win_end, 0) // BLOCK_N * BLOCK_N

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_k_head
    v_base = v_cache_ptr + kvh * stride_v_head
    ks_base = k_cache_ptr + scale_off + kvh * (BLOCK_SIZE * 4)  # fp32 scales, if KV_QUANT
    vs_base = v_cache_ptr + scale_off + kvh * (BLOCK_SIZE * 4)
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if SLIDING:
        for start_n in range(lo, win_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, pos, start_n, hi, bt_row, k_base, v_base, ks_base, vs_base,
                stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, qk_scale, offs_d, d_ok,
                window, BLOCK_SIZE, BLOCK_N, True, SLIDING, PAD_D, DOT_PREC, KV_QUANT, HEAD_DIM,
                F16_DOT, V_ASM,
            )  # fmt: skip
    for start_n in range(win_end, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, pos, start_n, hi, bt_row, k_base, v_base, ks_base, vs_base,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, qk_scale, offs_d, d_ok,
            window, BLOCK_SIZE, BLOCK_N, False, SLIDING, PAD_D, DOT_PREC, KV_QUANT, HEAD_DIM,
            F16_DOT, V_ASM,
        )  # fmt: skip
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, pos, start_n, hi, bt_row, k_base, v_base, ks_base, vs_base,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, qk_scale, offs_d, d_ok,
            window, BLOCK_SIZE, BLOCK_N, True, SLIDING, PAD_D, DOT_PREC, KV_QUANT, HEAD_DIM,
            F16_DOT, V_ASM,
        )  # fmt: skip

    if KV_QUANT:
        acc = acc * (1.0 / _V_LIFT)
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT_KV:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (q_rows - tok_base) * (tl.num_programs(1) * GQA) + head  # [BLOCK_M] (token, head)
        store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part, split, acc, l_i, m_i, row_ok,
                        offs_d, HEAD_DIM_PAD)  # fmt: skip


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # [2, N, B, Hkv, D] or K, V
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    *,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal paged attention of every request's new queries over its ``seq_lens[i]`` keys
    (with ``sliding_window`` W: query position p over keys ``p - W < j <= p``).

    ``kv_cache`` is one ``[2, N, B, Hkv, D]`` tensor or a ``(k_cache, v_cache)`` pair of
    ``[N, B, Hkv, D]`` views, in q's dtype, or 8-bit (fp8 e4m3 / int8) with a last dim of D + 4
    (kernels/kv_quant.py's block layout).
    ``num_splits``: None picks split-KV automatically for decode batches, 1 forces it off, > 1
    forces that many splits (any batch). ``config`` overrides the tile shape (tests, tuning).
    When the first ``num_decodes`` requests are exactly the decodes, they get their own
    decode-shaped launch. Tokens not covered by ``query_start_loc`` are left unwritten (split
    path: zeroed)."""
    k_cache, v_cache = (kv_cache[0], kv_cache[1]) if not isinstance(kv_cache, tuple) else kv_cache
    _check(q, k_cache, v_cache, meta, out)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    out = torch.empty_like(q) if out is None else out
    qsl, nreq, nd = meta.query_start_loc_cpu, meta.num_reqs, meta.num_decodes
    if nreq == 0 or q.shape[0] == 0:
        return out
    args = (q, k_cache, v_cache, meta, scale, out)
    if meta.max_query_len > 1 and 0 < nd < nreq and qsl[: nd + 1] == list(range(nd + 1)):
        _launch(*args, 0, nd, 1, num_splits, config, sliding_window)
        rest = num_splits or 1  # auto split-KV is for decodes only
        _launch(*args, nd, nreq, meta.max_query_len, rest, config, sliding_window)
    else:
        _launch(*args, 0, nreq, meta.max_query_len, num_splits, config, sliding_window)
    return out


def _launch(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]
    r0: int,
    r1: int,
    max_query_len: int,
    num_splits: int | None,
    config: AttentionConfig | None,
    sliding_window: int | None,
) -> None:
    """One kernel launch over requests ``r0:r1`` (their tokens are contiguous in ``q``)."""
    if max_query_len > 1:  # prompt chunks over an 8-bit cache may read a copy (kv_dequant.py)
        copy = copy_for_prefill(k_cache, v_cache, meta, r0, r1, q.dtype)
        if copy is not None:
            k_cache, v_cache, table = copy
            meta = dataclasses.replace(meta, block_table=table)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    gqa = num_heads // num_kv_heads
    decode = max_query_len <= 1
    quant = is_quantized(k_cache.dtype)
    f16_dot = quant and q.dtype != torch.float32
    tok0, tok1 = meta.query_start_loc_cpu[r0], meta.query_start_loc_cpu[r1]
    if config is None:
        wide = decode and (r1 - r0) * num_kv_heads >= (device_sms(q.device) or 1 << 30)
        config = default_config(head_dim, decode, quant, wide)
    cfg = config
    block_m = max(cfg.block_m, triton.next_power_of_2(gqa))
    block_q = 1 if decode else block_m // gqa
    one_tile = max_query_len <= block_q
    num_tiles = r1 - r0 if one_tile else tok1 // block_q - tok0 // block_q + (r1 - r0)
    if num_splits is None:
        programs = num_tiles * num_kv_heads
        keys = min(meta.max_seq_len, sliding_window or meta.max_seq_len)  # keys read per query
        num_splits = auto_num_splits(programs, keys, q.device) if decode else 1
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        parts = SplitPartials.empty(tok1 - tok0, num_heads, num_splits, d_pad, q.device)
        part_acc, part_m, part_l = parts.acc, parts.row_max, parts.row_sum
    else:
        part_acc = part_m = part_l = out  # unused
    block_size = k_cache.shape[1]
    if quant:  # the value rows' strides within a block; the scales follow them
        tok_stride, head_stride = num_kv_heads * head_dim, head_dim
        scale_off = scales_offset(block_size, num_kv_heads, head_dim)
        k_strides = (k_cache.stride(0), tok_stride, head_stride)
        v_strides = (v_cache.stride(0), tok_stride, head_stride)
    else:
        scale_off = 0
        k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        meta.query_start_loc, meta.seq_lens, meta.block_table, r0,
        r1 - r0, tok0, tok0 // block_q, scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_strides, *v_strides,
        meta.block_table.stride(0), scale_off,
        GQA=gqa, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, SPLIT_KV=num_splits > 1,
        SLIDING=sliding_window is not None,
        ONE_TILE_PER_REQ=one_tile, PAD_D=d_pad != head_dim, DOT_PREC=_dot_precision(q.dtype),
        PDL_SIGNAL=decode and use_pdl(q.device), KV_QUANT=quant,
        F16_DOT=f16_dot, V_ASM=f16_dot and q.is_cuda and not envs.triton_interpret(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        reduce_splits(parts, out, meta.query_start_loc, tok0, covered_index=r1)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays exact; 16-bit ignores it


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # [2, N, B, Hkv, D] or K, V
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Plain torch, fp32, one request at a time: gather its blocks, causal mask with offset
    (and the sliding window's lower edge)."""
    k_cache, v_cache = (kv_cache[0], kv_cache[1]) if not isinstance(kv_cache, tuple) else kv_cache
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    gqa = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_reqs):
        s, e, length = qsl[i], qsl[i + 1], meta.seq_lens_cpu[i]
        if e == s:
            continue
        blocks = meta.block_table[i, : triton.cdiv(length, block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()  # [L, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        k, v = k.repeat_interleave(gqa, dim=1), v.repeat_interleave(gqa, dim=1)  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale  # [Hq, n, L]
        q_pos = torch.arange(length - (e - s), length, device=q.device)
        key_pos = torch.arange(length, device=q.device)[None, :]
        hidden = key_pos > q_pos[:, None]  # [n, L]
        if sliding_window is not None:
            hidden |= key_pos <= q_pos[:, None] - sliding_window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"want q [T, Hq, D] and K/V caches [N, B, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1:]
    quant = is_quantized(k_cache.dtype)
    row = head_dim + SCALE_BYTES if quant else head_dim
    if k_cache.shape[3] != row or num_heads % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the K/V caches need a contiguous last dim")
    if (k_cache.dtype != q.dtype and not quant) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from q dtype {q.dtype}")
    if quant and head_dim % SCALE_BYTES:
        raise ValueError("an 8-bit cache needs head_dim % 4 == 0 (4-byte aligned scales)")
    block_strides = (k_cache.shape[2] * row, row, 1)
    if quant and (k_cache.stride()[1:] != block_strides or v_cache.stride()[1:] != block_strides):
        raise ValueError("an 8-bit cache needs contiguous blocks")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"{q.shape[0]} tokens given, metadata describes {meta.num_tokens}")
    if meta.block_table.stride(1) != 1 or meta.query_start_loc.dtype != torch.int32:
        raise ValueError("block_table needs a contiguous last dim; query_start_loc must be int32")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype}")
