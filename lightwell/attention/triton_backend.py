"""Attention through the Triton kernels: store the new K/V, then one paged flash-attention pass.

Runs wherever the kernels do: CUDA, or the CPU under ``TRITON_INTERPRET=1`` (tests). Without a
KV cache (profiling runs), every request must be a fresh prefill; the new k/v are then read in
place as a cache of one-token blocks, so the same kernel serves.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from lightwell.attention.metadata import AttentionMetadata
from lightwell.kernels.kv_store import kv_store
from lightwell.kernels.paged_attention import compile_variants, paged_attention


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
    # fewer; ``attend_stored`` then attends. W1 on llama-3-8b, H200 (tp_run11): 225.7 against
    # 224.0 tok/s at TP=1, 331.7 against 329.1 at TP=2, the same tokens.
    # LIGHTWELL_FUSED_ROPE_STORE=0 keeps them two kernels.
    stores_with_rope = os.environ.get("LIGHTWELL_FUSED_ROPE_STORE", "1") != "0"

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
