"""Attention through the Triton kernels: store the new K/V, then one paged flash-attention pass.

Runs wherever the kernels do: CUDA, or the CPU under ``TRITON_INTERPRET=1`` (tests). Without a
KV cache (profiling runs), every request must be a fresh prefill; the new k/v are then read in
place as a cache of one-token blocks, so the same kernel serves. The cache may be 8-bit (fp8 /
int8 with a scale per token and head, ``--kv-cache-dtype``): the store quantizes, attention
dequantizes (long prompt chunks through a copy of their blocks, kernels/kv_dequant.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from lightwell.attention.metadata import AttentionMetadata
from lightwell.kernels.attention_tiles import default_config
from lightwell.kernels.kv_dequant import copy_for_prefill
from lightwell.kernels.kv_quant import head_dim_of, is_quantized
from lightwell.kernels.kv_store import kv_store
from lightwell.kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True  # no host syncs; grid from capture-time metadata

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor | None,  # [2, N, B, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        if kv_cache is None:
            return _attend_without_cache(q, k, v, meta, scale, sliding_window)
        kv_store(k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta, scale, sliding_window=sliding_window)

    # The RoPE kernel stores the new keys/values too (kernels/rotary.py): one launch a layer
    # fewer; ``attend_stored`` then attends.
    stores_with_rope = True

    def attend_stored(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [2, N, B, Hkv, D], the step's keys/values already in it
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        return paged_attention(q, kv_cache, meta, scale, sliding_window=sliding_window)

    def compile_variants(
        self,
        num_heads: int,
        kv_cache: torch.Tensor,  # [2, N, B, Hkv, D]
        scale: float,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> int:
        """Start-up: compile every attention kernel variant serving can meet (on a scratch
        output; the cache is only read). Returns the launches made."""
        return compile_variants(num_heads, kv_cache, scale, dtype, sliding_window)


def _attend_without_cache(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [T, Hq, D]
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_reqs):
        if meta.seq_lens_cpu[i] != qsl[i + 1] - qsl[i]:
            raise ValueError("attention without a KV cache cannot serve cached tokens")
    # token t of the batch is "block" t of a cache with block_size 1
    offsets = torch.arange(max(meta.max_query_len, 1), dtype=torch.int32, device=q.device)
    block_table = meta.query_start_loc[:-1, None] + offsets[None, :]  # [R, max_query_len]
    flat = dataclasses.replace(meta, block_table=block_table.to(torch.int32))
    kv = (k.unsqueeze(1), v.unsqueeze(1))
    return paged_attention(q, kv, flat, scale, sliding_window=sliding_window)


def compile_variants(
    num_heads: int,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # a layer's real cache
    scale: float,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> int:
    """Launch, once, each variant of the kernel that serving can need for this layer's shapes:
    decode rows with and without split-KV (in each decode tile the cache's dtype uses), a
    prefill within one query tile and one over several (over an 8-bit cache: directly, and
    over the copy long prompt chunks read, kernels/kv_dequant.py). Each reads block 0 of
    ``kv_cache`` and writes a scratch output only. Start-up calls it (after warm-up), because
    CUDA-graph capture covers only the variants its own steps use, and an eager step (a mixed
    step that skips its graph) would otherwise compile the rest in the middle of serving.
    Returns the launches made."""
    k_cache, v_cache = (kv_cache[0], kv_cache[1]) if not isinstance(kv_cache, tuple) else kv_cache
    device, block_size, num_kv_heads = k_cache.device, *k_cache.shape[1:3]
    head_dim = head_dim_of(k_cache)
    quant = is_quantized(k_cache.dtype)
    gqa = num_heads // num_kv_heads
    cfg = default_config(head_dim, decode=False)
    block_q = max(cfg.block_m, triton.next_power_of_2(gqa)) // gqa
    cases = [  # (query length, splits, tiles, copy): decode split / unsplit, prefill 1 tile / more
        (1, 2, None, False),
        (1, 1, None, False),
        (min(2, block_q), 1, None, False),
        (block_q + 1, 1, None, False),
    ]
    wide = default_config(head_dim, True, quant, wide=True)
    if wide != default_config(head_dim, True, quant):
        cases += [(1, 2, wide, False), (1, 1, wide, False)]  # the tile of batches wider than SMs
    if quant:
        cases += [(min(2, block_q), 1, None, True), (block_q + 1, 1, None, True)]
    for q_len, splits, tiles, copy in cases:
        seq_len = max(q_len, 2 * splits)
        blocks = triton.cdiv(seq_len, block_size)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_table=torch.zeros((1, blocks), dtype=torch.int32, device=device),
            slot_mapping=torch.full((q_len,), -1, dtype=torch.int64, device=device),
            max_query_len=q_len,
            max_seq_len=seq_len,
            query_start_loc_cpu=[0, q_len],
            seq_lens_cpu=[seq_len],
            num_decodes=int(q_len == 1),
        )
        q = torch.zeros((q_len, num_heads, head_dim), dtype=dtype, device=device)
        kv = (k_cache, v_cache)
        if copy:  # what a long prompt chunk reads: the copy's kernel and the model-dtype kernel
            k, v, table = copy_for_prefill(k_cache, v_cache, meta, 0, 1, dtype, force=True)
            kv, meta = (k, v), dataclasses.replace(meta, block_table=table)
        paged_attention(
            q, kv, meta, scale, num_splits=splits, config=tiles, sliding_window=sliding_window
        )
    return len(cases)
