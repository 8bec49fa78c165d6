"""Test utility: run a model through the paged KV cache the way a model runner does.

    runner = PagedRunner(model, block_size=4, num_blocks=64)
    logits = runner.step([("a", prompt_ids, 0), ("b", other_ids, 0)])    # prefill, 2 requests
    logits = runner.step([("a", [tok_a], len(prompt_ids)), ...])        # decode: 1 new token

Each request gets scattered, non-contiguous block ids (shuffled), so indexing bugs show.
The steps a model runner takes are all here: allocate one [2, N, B, Hkv, D] cache per
Attention layer, bind it (``layer.kv_cache = t``), build ``AttentionMetadata`` (query_start_loc,
seq_lens, block_table, slot_mapping and their host copies), run under ``forward_context``.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from lightwell.attention.metadata import AttentionMetadata, forward_context
from lightwell.layers.attention import Attention


def bind_kv_caches(
    model: nn.Module,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> list[torch.Tensor]:
    from lightwell.quant.kv_cache import cache_dtype, stored_head_size

    caches = []
    kv_dtype = cache_dtype(kv_cache_dtype, dtype)
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        shape = list(layer.kv_cache_shape(num_blocks, block_size))
        shape[-1] = stored_head_size(kv_dtype, shape[-1])
        # Poison the cache: unwritten slots must never be read (NaN would propagate; an int8
        # cache gets -128 codes and NaN scales).
        if kv_dtype == torch.int8:
            layer.kv_cache = torch.full(shape, -1, dtype=kv_dtype, device=device)
            layer.kv_cache[..., :-4] = -128
        else:
            layer.kv_cache = torch.full(shape, float("nan"), dtype=kv_dtype, device=device)
        caches.append(layer.kv_cache)
    return caches


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The step's AttentionMetadata and positions [T] for requests with these lengths."""
    starts, slots, positions = [0], [], []
    for q, s, blocks in zip(query_lens, seq_lens, block_tables):
        starts.append(starts[-1] + q)
        for pos in range(s - q, s):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(b) for b in block_tables)
    table = [b + [0] * (width - len(b)) for b in block_tables]
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1

    def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    meta = AttentionMetadata(
        query_start_loc=t(starts, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_table=t(table, torch.int32).reshape(len(table), width),
        slot_mapping=t(slots, torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        num_decodes=num_decodes,
    )
    return meta, t(positions, torch.int64)


class PagedRunner:
    def __init__(
        self,
        model: nn.Module,
        block_size: int = 4,
        num_blocks: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        kv_cache_dtype: str = "auto",
    ):
        self.model, self.block_size = model, block_size
        self.device = torch.device(device)
        self.caches = bind_kv_caches(
            model, num_blocks, block_size, dtype, self.device, kv_cache_dtype
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}

    def _reserve(self, req_id: str, new_len: int) -> list[int]:
        blocks = self.blocks.setdefault(req_id, [])
        while len(blocks) * self.block_size < new_len:
            blocks.append(self.free.pop())
        return blocks

    @torch.no_grad()
    def step(self, batch: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """Run ``(req_id, new_token_ids, num_cached_tokens)`` requests in one forward; return
        each request's logits [query_len, V] (float32)."""
        query_lens, seq_lens, tables, ids = [], [], [], []
        for req_id, new_ids, num_cached in batch:
            if num_cached > self.num_tokens.get(req_id, 0):
                raise ValueError(f"{req_id}: {num_cached} cached tokens claimed, fewer written")
            seq_len = num_cached + len(new_ids)
            tables.append(self._reserve(req_id, seq_len))
            self.num_tokens[req_id] = seq_len
            query_lens.append(len(new_ids))
            seq_lens.append(seq_len)
            ids.extend(new_ids)
        meta, positions = build_metadata(query_lens, seq_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)  # [T, H]
        logits = self.model.compute_logits(hidden)  # [T, V]
        return list(logits.split(query_lens))
