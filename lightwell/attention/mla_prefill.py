"""MLA prefill in the expanded form, every prefill request of a step at once, through the
paged attention kernel (``kernels/paged_attention.py``).

A step's single-token requests, wherever they sit in the batch, go to the decode kernel
(absorbed queries, ``kernels/mla_decode.py``); ``split_step`` separates them from the rest.

The latent cache (``attention/mla_torch.py``) holds ``[c | k_pe]`` per token. For prefill the
keys are expanded rather than the queries absorbed: the prefill requests' entries (cached
prefix and new tokens, all stored by then) are gathered block by block into one contiguous
buffer, ``c`` goes through ``kv_b_proj`` in one GEMM (per head ``K_nope`` and ``V``), and
``K = [K_nope | k_pe]`` (``k_pe`` broadcast over the heads) meets the plain queries
``[q_nope | q_pe]``: causal after each request's cached prefix, the buffer read as a paged
cache whose block table numbers each request's blocks in order. A score then costs
``nope + rope`` products per head and key (192 for DeepSeek-V2/V3) rather than
``kv_lora_rank + rope`` (576), in the model dtype on tensor cores. (The kernel's tiles are
powers of two: 192 dims run as 256, for the scores and for the values alike.)

V is not copied: the kernel reads V with q's head dim (``nope + rope >= v``), and V is a
strided view of the GEMM output ``[keys, heads, nope + v]`` from each head's V columns on. Its
columns past ``v`` read the next head's ``K_nope`` (a zeroed tail after the last); they reach
only output columns past ``v``, which are dropped.

Memory: a pass holds the gathered entries, the GEMM output and K, at most ``PASS_BYTES``.
Requests are grouped into passes in order; a pass whose keys do not fit with every head
expands a group of heads at a time. Only a single request whose keys with one head exceed the
bound makes a pass larger than it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightwell.attention.metadata import AttentionMetadata
from lightwell.quant.kv_cache import cache_head_dim, dequantize_blocks, is_quantized

if TYPE_CHECKING:  # (triton is imported when a kernel runs)
    from lightwell.kernels.attention_tiles import AttentionConfig

# The expanded keys and values one pass holds at once (as much as the torch path's chunk of
# fp32 scores, attention/mla_torch.SCORES_PER_CHUNK).
PASS_BYTES = 256 << 20


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)  # (no wait for the stream to drain)


def leading_decodes(meta: AttentionMetadata) -> int:
    """How many requests at the front of the batch have one query token each (``num_decodes``
    counts every single-token request, wherever it sits)."""
    qsl, n = meta.query_start_loc_cpu, 0
    while n < min(meta.num_decodes, meta.num_reqs) and qsl[n + 1] == n + 1:
        n += 1
    return n


@dataclass
class StepSplit:
    """A step's single-token requests (the decode kernel's, wherever they sit in the batch)
    and the rest (the expanded prefill's): slices when the single-token requests lead the
    batch, index tensors otherwise."""

    decode_rows: slice | torch.Tensor  # [nd]: their token rows
    decode_table: torch.Tensor  # [nd, max_blocks]: their block-table rows
    decode_lens: torch.Tensor  # [nd]: their seq_lens
    prefill_rows: slice | torch.Tensor  # [P]: the other requests' token rows
    prefill: AttentionMetadata | None  # those requests alone, None without any

    @property
    def num_decodes(self) -> int:
        return self.decode_lens.shape[0]


def split_step(meta: AttentionMetadata) -> StepSplit:
    """The step's split, made once per step (``meta.backend_cache``)."""
    if "mla_split" in meta.backend_cache:
        return meta.backend_cache["mla_split"]
    qsl, dev = meta.query_start_loc_cpu, meta.seq_lens.device
    dec = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    pre = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] != 1]
    if dec == list(range(len(dec))):  # leading decodes (the common order): views
        d_req, d_rows = slice(0, len(dec)), slice(0, len(dec))
        p_req, p_rows = slice(len(dec), meta.num_reqs), slice(len(dec), meta.num_tokens)
    else:
        d_req = _to(torch.tensor(dec, dtype=torch.int64), dev)
        d_rows = _to(torch.tensor([qsl[i] for i in dec], dtype=torch.int64), dev)
        p_req = _to(torch.tensor(pre, dtype=torch.int64), dev)
        rows = [t for i in pre for t in range(qsl[i], qsl[i + 1])]
        p_rows = _to(torch.tensor(rows, dtype=torch.int64), dev)
    prefill = _select(meta, pre, p_req) if pre else None
    split = StepSplit(d_rows, meta.block_table[d_req], meta.seq_lens[d_req], p_rows, prefill)
    meta.backend_cache["mla_split"] = split
    return split


def _select(
    meta: AttentionMetadata, reqs: list[int], index: slice | torch.Tensor
) -> AttentionMetadata:
    """The metadata of requests ``reqs`` alone (``index``: them on the device)."""
    qsl, lens = meta.query_start_loc_cpu, [meta.seq_lens_cpu[i] for i in reqs]
    sub_qsl = [0]
    for i in reqs:
        sub_qsl.append(sub_qsl[-1] + qsl[i + 1] - qsl[i])
    return AttentionMetadata(
        query_start_loc=_to(torch.tensor(sub_qsl, dtype=torch.int32), meta.seq_lens.device),
        seq_lens=meta.seq_lens[index],
        block_table=meta.block_table[index],
        slot_mapping=meta.slot_mapping[:0],
        max_query_len=max(b - a for a, b in zip(sub_qsl, sub_qsl[1:])),
        max_seq_len=max(lens),
        query_start_loc_cpu=sub_qsl,
        seq_lens_cpu=lens,
    )


def plan_groups(
    key_blocks: list[int],  # per request: cache blocks holding its keys
    block_size: int,
    key_bytes: int,  # per key, whatever the heads: the gathered entry
    head_key_bytes: int,  # per key and head: the GEMM output and K
    num_heads: int,
    budget: int = PASS_BYTES,
) -> list[tuple[int, int, int]]:
    """Passes as ``(first, end, heads)``: requests ``first:end`` (relative to ``key_blocks``),
    expanded ``heads`` heads at a time."""
    groups, r0 = [], 0
    per_key = key_bytes + num_heads * head_key_bytes
    while r0 < len(key_blocks):
        r1, keys = r0 + 1, key_blocks[r0] * block_size
        while r1 < len(key_blocks) and (keys + key_blocks[r1] * block_size) * per_key <= budget:
            keys, r1 = keys + key_blocks[r1] * block_size, r1 + 1
        fit = (budget // max(keys, 1) - key_bytes) // head_key_bytes
        groups.append((r0, r1, max(1, min(num_heads, fit))))
        r0 = r1
    return groups


@dataclass
class PrefillPass:
    """One pass: requests ``reqs`` (their query rows ``tokens``), expanded ``heads`` heads at
    a time."""

    reqs: tuple[int, int]
    tokens: tuple[int, int]
    heads: int
    blocks: torch.Tensor  # [nb] int64: the cache blocks to gather, request by request
    meta: AttentionMetadata  # the pass's requests over the buffer (block i = gathered block i)


def _build_pass(
    meta: AttentionMetadata, r0: int, r1: int, heads: int, block_size: int
) -> PrefillPass:
    qsl, lens, dev = meta.query_start_loc_cpu, meta.seq_lens_cpu[r0:r1], meta.seq_lens.device
    nblocks = torch.tensor([-(-n // block_size) for n in lens], dtype=torch.int64)  # [R']
    starts = torch.cumsum(nblocks, 0) - nblocks
    rows = torch.repeat_interleave(torch.arange(r0, r1), nblocks)  # [nb]
    cols = torch.arange(int(nblocks.sum())) - torch.repeat_interleave(starts, nblocks)
    width = max(1, int(nblocks.max()))
    table = starts[:, None] + torch.arange(width)[None, :]  # [R', width]
    table = torch.where(torch.arange(width)[None, :] < nblocks[:, None], table, 0)
    sub_qsl = [qsl[i] - qsl[r0] for i in range(r0, r1 + 1)]
    sub = AttentionMetadata(
        query_start_loc=_to(torch.tensor(sub_qsl, dtype=torch.int32), dev),
        seq_lens=meta.seq_lens[r0:r1],
        block_table=_to(table.to(torch.int32), dev),
        slot_mapping=torch.empty(0, dtype=torch.int64, device=dev),
        max_query_len=max(b - a for a, b in zip(sub_qsl, sub_qsl[1:])),
        max_seq_len=max(lens),
        query_start_loc_cpu=sub_qsl,
        seq_lens_cpu=list(lens),
    )
    tokens = (qsl[r0], qsl[r1])
    blocks = meta.block_table[_to(rows, dev), _to(cols, dev)].long()
    return PrefillPass((r0, r1), tokens, heads, blocks, sub)


def plan_passes(
    meta: AttentionMetadata,
    block_size: int,
    key_bytes: int,
    head_key_bytes: int,
    num_heads: int,
    budget: int = PASS_BYTES,
) -> list[PrefillPass]:
    """The passes over the requests of ``meta``, planned once per step (every layer of the
    step reuses them through ``meta.backend_cache``)."""
    key = ("mla_prefill", block_size, key_bytes, head_key_bytes, num_heads, budget)
    if key not in meta.backend_cache:
        blocks = [-(-n // block_size) for n in meta.seq_lens_cpu]
        groups = plan_groups(blocks, block_size, key_bytes, head_key_bytes, num_heads, budget)
        meta.backend_cache[key] = [_build_pass(meta, a, b, h, block_size) for a, b, h in groups]
    return meta.backend_cache[key]


def expand_keys(
    latent: torch.Tensor,  # [nb * B, rank + rope]: gathered entries, whole blocks
    w_kvb: torch.Tensor,  # [H * (nope + v), rank]: kv_b_proj's weight
    dims: tuple[int, int, int],  # nope, rope, v
    heads: tuple[int, int],  # the heads h0:h1 to expand
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V as paged caches [nb, B, h, nope + rope]
    """K = [c @ W_UK^T | k_pe] and V = c @ W_UV^T of heads h0:h1, in one GEMM; V as a view
    (see the module docstring)."""
    nope, rope, v = dims
    rank, width = latent.shape[1] - rope, nope + v
    h, keys = heads[1] - heads[0], latent.shape[0]
    w = w_kvb.view(-1, width, rank)[heads[0] : heads[1]].reshape(h * width, rank)
    size = keys * h * width
    flat = latent.new_empty(size + nope + rope - v)
    torch.mm(latent[:, :rank], w.t(), out=flat[:size].view(keys, h * width))  # [keys, h * width]
    flat[size:].zero_()
    k = latent.new_empty(keys, h, nope + rope)
    k[..., :nope] = flat[:size].view(keys, h, width)[..., :nope]
    k[..., nope:] = latent[:, None, rank:]
    nb = keys // block_size
    shape = (nb, block_size, h, nope + rope)
    v_view = flat.as_strided(shape, (block_size * h * width, h * width, width, 1), nope)
    return k.view(shape), v_view


def expanded_prefill(
    q: torch.Tensor,  # [P, H, nope + rope]: [q_nope | rotated q_pe]
    kv_cache: torch.Tensor,  # [1, N, B, 1, rank + rope]: the step's entries stored
    meta: AttentionMetadata,  # the prefill requests (StepSplit.prefill)
    w_kvb: torch.Tensor,  # [H * (nope + v), rank]
    dims: tuple[int, int, int],  # nope, rope, v
    scale: float,
    budget: int = PASS_BYTES,
    config: AttentionConfig | None = None,  # the paged attention kernel's tile (tuning)
) -> torch.Tensor:  # [P, H, v] (a view)
    """Causal attention of every request's queries over its ``seq_lens[i]`` keys, expanded
    from the latent cache (module docstring)."""
    from lightwell.kernels.paged_attention import paged_attention

    nope, rope, v = dims
    heads, width = q.shape[1], cache_head_dim(kv_cache)
    if q.shape[2] != nope + rope or v > nope + rope or width != w_kvb.shape[1] + rope:
        raise ValueError(f"queries {tuple(q.shape)} / dims {dims} do not fit the cache {width}")
    block_size, elt, row = kv_cache.shape[2], q.element_size(), kv_cache.shape[-1]
    quantized = is_quantized(kv_cache.dtype)  # gathered 8-bit, then dequantized to q's dtype
    key_bytes = row * kv_cache.element_size() + (width * elt if quantized else 0)
    passes = plan_passes(meta, block_size, key_bytes, (2 * nope + v + rope) * elt,
                         heads, budget)  # fmt: skip
    blocks = kv_cache[0]  # [N, B, 1, row]
    if quantized:  # gathered as bytes (index_select may lack fp8 kernels)
        blocks = blocks.view(torch.uint8)
    out = torch.empty_like(q)
    for p in passes:
        gathered = blocks.index_select(0, p.blocks)
        if quantized:
            gathered = dequantize_blocks(gathered.view(kv_cache.dtype), q.dtype)
        latent = gathered.view(-1, width)  # [nb * B, rank + rope]
        (t0, t1), step = p.tokens, p.heads
        for h0 in range(0, heads, step):
            h1 = min(heads, h0 + step)
            k, v_view = expand_keys(latent, w_kvb, dims, (h0, h1), block_size)
            paged_attention(q[t0:t1, h0:h1], (k, v_view), p.meta, scale,
                            out=out[t0:t1, h0:h1], config=config)  # fmt: skip
    return out[..., :v]


def compile_variants(
    kv_cache: torch.Tensor,  # [1, N, B, 1, rank + rope]: a layer's real cache (block 0 read)
    w_kvb: torch.Tensor,  # [H * (nope + v), rank]
    dims: tuple[int, int, int],  # nope, rope, v
    num_heads: int,
) -> int:
    """Start-up: launch once each paged attention variant the expanded prefill can meet (a
    request within one query tile, one over several; single-token requests go to the decode
    kernel), so that no step compiles one mid-serving. Returns the launches made."""
    from lightwell.kernels.attention_tiles import default_config

    nope, rope, _ = dims
    dev, block_size = kv_cache.device, kv_cache.shape[2]
    block_q = default_config(nope + rope, decode=False).block_m  # (one query head per row)
    # seq_lens 16-byte aligned or not (Triton specialises on it): a step's prefill requests'
    # lengths are a slice of the step's, from wherever the decodes end
    cases = [(n, n, skip) for n in (2, block_q + 1) for skip in (0, 1)]
    for q_len, seq_len, skip in cases:
        lens = torch.tensor([seq_len] * (skip + 1), dtype=torch.int32, device=dev)[skip:]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=dev),
            seq_lens=lens,
            block_table=torch.zeros((1, -(-seq_len // block_size)), dtype=torch.int32, device=dev),
            slot_mapping=torch.empty(0, dtype=torch.int64, device=dev),
            max_query_len=q_len,
            max_seq_len=seq_len,
            query_start_loc_cpu=[0, q_len],
            seq_lens_cpu=[seq_len],
        )
        q = torch.zeros((q_len, num_heads, nope + rope), dtype=w_kvb.dtype, device=dev)
        expanded_prefill(q, kv_cache, meta, w_kvb, dims, 1.0)
    return len(cases)
