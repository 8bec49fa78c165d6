"""MLA decode: one absorbed query per request over its paged latent cache, split-KV.

    out[r, h] = softmax_j(scale * q[r, h] . c_j) @ c_j[:L]      (c_j: the latent entry of key j)

Every head of a request reads the same entries (MQA over the latent), so a program takes
``BLOCK_H`` heads of one request and one split of its keys: each ``BLOCK_S`` keys' entries are
loaded once for all those heads and go through two dots (scores against the latent and the RoPE
part, then probabilities times the latent). A request's keys are cut into ``num_splits`` equal
runs of whole tiles by its own length (inside the kernel, so a graph captured for long contexts
spreads a short one over all its splits). Each split writes its partial output with its
log-sum-exp and ``_combine_kernel`` rescales and sums them into the output; with one split the
decode kernel writes the output itself. Entry width ``L + P`` (512 + 64 for
DeepSeek) need not be a power of two: the latent and RoPE parts are loaded apart. An 8-bit
cache (quant/kv_cache.py's layout, kernels/kv_quant.py's pointers: one fp32 scale an entry
after each block's values) is loaded converted to the query's dtype, the entry's scale
multiplying its scores and its probability in the second dot.
``store_latent`` writes a step's entries into the cache, skipping slots < 0 (CUDA-graph padding).
Nothing here reads host-side metadata per step, so decode steps can replay from CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightwell import envs
from lightwell.kernels import pdl as _pdl
from lightwell.kernels.kv_quant import (
    block_ptr,
    head_dim_of,
    quant_mode,
    row_ptrs,
    scale_ptrs,
    store_rows,
)
from lightwell.kernels.pdl_sync import wait_then_signal


# (per-step integers are not specialised: no variant compiles in the middle of serving)
@triton.jit(do_not_specialize=["stride_bt"])
def _mla_decode_kernel(
    q_ptr,  # [R, H, L + P]
    cache_ptr,  # the latent cache's first element (blocks of BLOCK_SIZE entries)
    block_table_ptr,  # [R, max_blocks]
    seq_lens_ptr,  # [R]
    part_ptr,  # [R, S, H, L] float32 partial outputs (several splits)
    lse_ptr,  # [R, S, H] float32 log-sum-exp of each split (several splits)
    out_ptr,  # [R, H, L] the output (one split)
    scale,
    num_heads,
    stride_bt,
    stride_or,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_PREC: tl.constexpr,  # "ieee" for fp32 (exact), else "tf32" (ignored by 16-bit dots)
    SPLIT: tl.constexpr,  # several splits: partials and log-sum-exps, else the output
    KV_QUANT: tl.constexpr,  # kv_quant.quant_mode: 8-bit entries with a scale each
    GDC: tl.constexpr,  # launched with PDL: wait for the kernel before, then signal
):
    wait_then_signal(GDC)
    req, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    width = LATENT + ROPE
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    lat, pe = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_P)
    lat_ok, pe_ok = lat < LATENT, pe < ROPE
    q_row = q_ptr + (req * num_heads + heads)[:, None] * width
    q_lat = tl.load(q_row + lat[None, :], mask=head_ok[:, None] & lat_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + LATENT + pe[None, :], mask=head_ok[:, None] & pe_ok[None, :],
                   other=0.0)  # fmt: skip
    if KV_QUANT and q_lat.dtype != tl.float32:
        # 16-bit dots in fp16, into which 8-bit entries convert exactly (and cheaply); a head's
        # query scaled by a power of two when its largest value would near fp16's range, its
        # scores unscaled after the dot
        top = tl.maximum(tl.max(tl.abs(q_lat.to(tl.float32)), 1),
                         tl.max(tl.abs(q_pe.to(tl.float32)), 1))  # fmt: skip
        q_shift = tl.where(top > 16384.0, tl.exp2(tl.ceil(tl.log2(top / 16384.0))), 1.0)
        q_lat = (q_lat.to(tl.float32) / q_shift[:, None]).to(tl.float16)
        q_pe = (q_pe.to(tl.float32) / q_shift[:, None]).to(tl.float16)
        q_shift = q_shift[:, None]  # [BLOCK_H, 1]
    else:
        q_shift = 1.0
    seq_len = tl.load(seq_lens_ptr + req)
    # this request's keys in num_splits equal runs of whole BLOCK_S tiles
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_S) * BLOCK_S
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    for s0 in range(start, end, BLOCK_S):
        pos = s0 + tl.arange(0, BLOCK_S)
        pos_ok = pos < end
        block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        base = block_ptr(cache_ptr, block, 1, LATENT + ROPE, BLOCK_SIZE, KV_QUANT)  # [BLOCK_S]
        rows = row_ptrs(base, pos % BLOCK_SIZE, 0, 1, LATENT + ROPE)
        c = tl.load(rows[:, None] + lat[None, :], mask=pos_ok[:, None] & lat_ok[None, :],
                    other=0.0).to(q_lat.dtype)  # fmt: skip
        k_pe = tl.load(rows[:, None] + LATENT + pe[None, :], mask=pos_ok[:, None] & pe_ok[None, :],
                       other=0.0).to(q_lat.dtype)  # fmt: skip
        scores = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PREC) + tl.dot(
            q_pe, tl.trans(k_pe), input_precision=DOT_PREC
        )  # [BLOCK_H, BLOCK_S]
        # an 8-bit entry's scale multiplies its scores and its probability's weight
        if KV_QUANT:
            ks = tl.load(scale_ptrs(base, pos % BLOCK_SIZE, 0, 1, LATENT + ROPE, BLOCK_SIZE),
                         mask=pos_ok, other=0.0)[None, :]  # fmt: skip
        else:
            ks = tl.full((1, BLOCK_S), 1.0, tl.float32)
        scores = tl.where(pos_ok[None, :], scores * ks * scale * q_shift, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot((p * ks).to(c.dtype), c, input_precision=DOT_PREC)
        m = m_new
    safe = denom > 0  # an empty split (past the sequence's end) contributes nothing
    out = acc / tl.where(safe, denom, 1.0)[:, None]
    keep = head_ok[:, None] & lat_ok[None, :]
    if not SPLIT:
        o_rows = out_ptr + req * stride_or + heads[:, None] * stride_oh
        tl.store(o_rows + lat[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        lse = tl.where(safe, m + tl.log(tl.where(safe, denom, 1.0)), float("-inf"))
        base = (req * num_splits + split) * num_heads + heads
        tl.store(part_ptr + base[:, None] * LATENT + lat[None, :], out, mask=keep)
        tl.store(lse_ptr + base, lse, mask=head_ok)


@triton.jit
def combine_splits(
    part_ptr,  # [R, S, H, L] float32
    lse_ptr,  # [R, S, H] float32 (-inf: an empty split)
    req, head, num_heads, num_splits,
    lat,  # [BLOCK_L] latent offsets
    LATENT: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):  # fmt: skip
    """Request ``req``'s head ``head`` output [BLOCK_L] fp32 from its splits' partials, each
    weighted by exp(its log-sum-exp - the largest) over their sum; empty splits are not read.
    ``_combine_kernel``'s, and kernels/mla_output.py's when it combines as it reads."""
    s = tl.arange(0, BLOCK_SPLITS)
    rows = (req * num_splits + s) * num_heads + head  # [BS]
    lse = tl.load(lse_ptr + rows, mask=s < num_splits, other=float("-inf"))
    live = lse > float("-inf")
    top = tl.max(tl.where(live, lse, -1e30), axis=0)
    w = tl.where(live, tl.exp(lse - top), 0.0)  # empty splits weigh nothing
    total = tl.sum(w, axis=0)
    parts = tl.load(part_ptr + rows[:, None] * LATENT + lat[None, :],
                    mask=live[:, None] & (lat < LATENT)[None, :], other=0.0)  # fmt: skip
    return tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    part_ptr,  # [R, S, H, L] float32
    lse_ptr,  # [R, S, H] float32
    out_ptr,  # [R, H, L]
    num_heads,
    stride_or,
    stride_oh,
    num_splits,
    LATENT: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    GDC: tl.constexpr,  # as _mla_decode_kernel's
):
    wait_then_signal(GDC)
    req, head = tl.program_id(0), tl.program_id(1)
    lat = tl.arange(0, BLOCK_L)
    out = combine_splits(part_ptr, lse_ptr, req, head, num_heads, num_splits, lat, LATENT,
                         BLOCK_SPLITS)  # fmt: skip
    o_row = out_ptr + req * stride_or + head * stride_oh
    tl.store(o_row + lat, out.to(out_ptr.dtype.element_ty), mask=lat < LATENT)


@triton.jit
def _store_latent_kernel(
    entry_ptr,  # [T, D]
    cache_ptr,  # the cache's first element (kv_quant.py's blocks of B tokens)
    slot_ptr,  # [T] int64; < 0: padding, skipped
    stride_entry,
    WIDTH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_quant.quant_mode of the cache dtype
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    row = tl.load(entry_ptr + token * stride_entry + offs, mask=mask)
    block = block_ptr(cache_ptr, slot // BLOCK_SIZE, 1, WIDTH, BLOCK_SIZE, KV_QUANT)
    tok = slot % BLOCK_SIZE
    rows = row_ptrs(block, tok, 0, 1, WIDTH)[None]  # [1]
    scales = scale_ptrs(block, tok, 0, 1, WIDTH, BLOCK_SIZE)[None]
    store_rows(rows, scales, offs, mask[None, :], row[None, :], KV_QUANT, INTERPRET)


def store_latent(
    entry: torch.Tensor,  # [T, D]
    kv_cache: torch.Tensor,  # [1, N, B, 1, D] (8-bit: D + 4, quant/kv_cache.py's layout)
    slot_mapping: torch.Tensor,  # [T] int64; < 0 (CUDA-graph padding): not stored
) -> None:
    """The step's entries at their slots, quantized with a scale each in an 8-bit cache
    (bit for bit as quant/kv_cache.py's ``write_rows``)."""
    width = head_dim_of(kv_cache)
    if entry.dim() != 2 or entry.shape[1] != width or entry.stride(1) != 1:
        raise ValueError(f"entries {tuple(entry.shape)} do not fit the cache's width {width}")
    if entry.shape[0]:
        _store_latent_kernel[(entry.shape[0],)](
            entry, kv_cache, slot_mapping, entry.stride(0), WIDTH=width,
            BLOCK_SIZE=kv_cache.shape[2], BLOCK=triton.next_power_of_2(width),
            KV_QUANT=quant_mode(kv_cache.dtype), INTERPRET=envs.triton_interpret(),
        )  # fmt: skip


def store_latent_ref(entry: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """A model-dtype cache's reference (an 8-bit cache's: quant/kv_cache.py's ``write_rows``)."""
    if head_dim_of(kv_cache) != kv_cache.shape[-1]:
        raise ValueError("store_latent_ref: an 8-bit cache's reference is write_rows")
    keep = slot_mapping >= 0
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping[keep]] = entry[keep].to(kv_cache.dtype)


MAX_SPLITS = 32
# (BLOCK_H, BLOCK_S, num_warps, num_stages) of the decode kernel
Config = tuple[int, int, int, int]


def pick_config(num_heads: int) -> Config:
    """The H200 sweep's tiles (benchmarks/kernels/mla_decode.py --sweep): up to 16 heads,
    sixteen heads a program (tl.dot's smallest tile) and 32 keys a step; more heads, 64 heads
    and 64 keys a step on 8 warps (each program reads its keys once for all its heads)."""
    if num_heads <= 16:
        return 16, 32, 4, 2
    return min(64, triton.next_power_of_2(num_heads)), 64, 8, 2


def pick_num_splits(num_reqs: int, num_heads: int, max_seq_len: int, sms: int = 132) -> int:
    """Key splits per request: as many as fit two programs an SM in one wave, 1 to 32, no
    more than the longest context has key tiles. The kernel sizes each split from the
    request's own length, so a CUDA graph captured at a long ``max_seq_len`` spreads short
    contexts over all its splits too."""
    block_h, block_s = pick_config(num_heads)[:2]
    programs = num_reqs * triton.cdiv(num_heads, block_h)
    tiles = triton.cdiv(max_seq_len, block_s)
    return max(1, min(MAX_SPLITS, 2 * sms // max(programs, 1), tiles))


def _check(q, kv_cache, block_table, num_splits) -> None:
    width = q.shape[2]
    if kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1 or head_dim_of(kv_cache) != width:
        raise ValueError(f"latent cache {tuple(kv_cache.shape)} does not fit q {tuple(q.shape)}")
    if (
        not q.is_contiguous()
        or block_table.shape[0] != q.shape[0]
        or not 0 < num_splits <= MAX_SPLITS
    ):
        raise ValueError("mla_decode wants a contiguous q, a block table row per request")


def mla_decode(
    q: torch.Tensor,  # [R, H, L + P]: one absorbed query per request
    kv_cache: torch.Tensor,  # [1, N, B, 1, L + P]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32
    scale: float,
    kv_lora_rank: int,
    num_splits: int = 1,  # key splits per request (more for long contexts and few requests)
    out: torch.Tensor | None = None,  # [R, H, L] to write into (rows contiguous in L)
    config: Config | None = None,
) -> torch.Tensor:  # [R, H, L] in q.dtype
    num_reqs, num_heads, width = q.shape
    _check(q, kv_cache, block_table, num_splits)
    if out is None:
        out = q.new_empty(num_reqs, num_heads, kv_lora_rank)
    if out.shape != (num_reqs, num_heads, kv_lora_rank) or out.stride(2) != 1:
        raise ValueError(f"mla_decode: out {tuple(out.shape)} does not fit the query")
    if num_reqs == 0:
        return out
    part, lse = _decode(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, num_splits,
                        out, config)  # fmt: skip
    if num_splits > 1:
        combine(part, lse, out)
    return out


def mla_decode_split(
    q: torch.Tensor,  # [R, H, L + P]: one absorbed query per request
    kv_cache: torch.Tensor,  # [1, N, B, 1, L + P]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32
    scale: float,
    kv_lora_rank: int,
    num_splits: int,  # at least 2
    config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, S, H, L], [R, S, H]) float32
    """The decode kernel without the combine: each split's partial output and log-sum-exp (an
    empty split's is -inf), for a consumer that combines them as it reads them (``combine``'s
    arithmetic; kernels/mla_output.py's ``absorb_output`` with ``lse``)."""
    _check(q, kv_cache, block_table, num_splits)
    if num_splits < 2 or q.shape[0] == 0:
        raise ValueError(f"mla_decode_split: {num_splits} splits of {q.shape[0]} requests")
    return _decode(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, num_splits, None,
                   config)  # fmt: skip


def combine(
    part: torch.Tensor,  # [R, S, H, L] float32
    lse: torch.Tensor,  # [R, S, H] float32
    out: torch.Tensor,  # [R, H, L] (rows contiguous in L)
) -> None:
    """The splits' partial outputs weighted by their log-sum-exps into ``out``."""
    num_reqs, num_splits, num_heads, kv_lora_rank = part.shape
    if num_reqs:
        _combine_kernel[(num_reqs, num_heads)](
            part, lse, out, num_heads, out.stride(0), out.stride(1), num_splits,
            LATENT=kv_lora_rank, BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            BLOCK_L=max(16, triton.next_power_of_2(kv_lora_rank)),
            **_pdl.kernel_args(part.device),
        )  # fmt: skip


def _decode(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, num_splits, out, config):
    """The decode kernel's launch: with one split it writes ``out``; with more it returns the
    partials and their log-sum-exps (for ``combine``; ``out`` may then be None)."""
    num_reqs, num_heads, width = q.shape
    block_h, block_s, warps, stages = config or pick_config(num_heads)
    rope = width - kv_lora_rank
    part = lse = out  # (unread with one split)
    if num_splits > 1:
        part = torch.empty(num_reqs, num_splits, num_heads, kv_lora_rank, device=q.device)
        lse = torch.empty(num_reqs, num_splits, num_heads, device=q.device)
        if out is None:  # (the output's arguments unread)
            out = part[:, 0]
    grid = (num_reqs, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_kernel[grid](
        q, kv_cache, block_table, seq_lens, part, lse, out, scale, num_heads,
        block_table.stride(0), out.stride(0), out.stride(1), BLOCK_SIZE=kv_cache.shape[2],
        LATENT=kv_lora_rank, ROPE=rope,
        # (tl.dot needs K >= 16: small test shapes pad the latent and RoPE tiles, masked)
        BLOCK_L=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h,
        BLOCK_S=block_s, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=num_splits > 1, KV_QUANT=quant_mode(kv_cache.dtype), num_warps=warps,
        num_stages=stages,
        **_pdl.kernel_args(q.device),
    )  # fmt: skip
    return part, lse


def mla_decode_ref(
    q: torch.Tensor,  # [R, H, L + P]
    kv_cache: torch.Tensor,  # [1, N, B, 1, L + P]
    block_table: torch.Tensor,  # [R, max_blocks]
    seq_lens: torch.Tensor,  # [R]
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [R, H, L]
    """Each request's one query over its ``seq_lens[r]`` entries, in fp32 torch ops (a
    model-dtype cache; an 8-bit one is checked through its dequantized copy)."""
    _, num_blocks, block_size, _, dim = kv_cache.shape
    flat = kv_cache.view(num_blocks, block_size * dim)
    out = []
    for r in range(q.shape[0]):
        length = int(seq_lens[r])
        blocks = block_table[r, : -(-length // block_size)].long()
        keys = flat.index_select(0, blocks).view(-1, dim)[:length].float()  # [L, L + P]
        scores = (q[r].float() @ keys.t()) * scale  # [H, L]
        out.append((scores.softmax(-1) @ keys[:, :kv_lora_rank]).to(q.dtype))
    return torch.stack(out)
