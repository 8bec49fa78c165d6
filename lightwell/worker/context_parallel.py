"""Context parallelism in the model runner: a step of at least ``MIN_TOKENS_PER_RANK`` tokens
a rank is cut into contiguous chunks, one a rank (``distributed.context_parallel``); each rank
runs its chunk through the model, its attention layers gathering every chunk's keys and values
into the cache first (an all-gather of K/V), and the chunks' hidden states are gathered for
sampling. Smaller steps (decodes) run whole on every rank, as without context parallelism."""

from __future__ import annotations

import dataclasses

import torch

from lightwell.attention.metadata import AttentionMetadata
from lightwell.distributed import context_parallel as cp

MIN_TOKENS_PER_RANK = 16


def applies(meta: AttentionMetadata) -> bool:
    return cp.get_cp_size() > 1 and meta.num_tokens >= MIN_TOKENS_PER_RANK * cp.get_cp_size()


def local_metadata(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    """``meta`` for the flat tokens ``[lo, hi)`` only: each request's part of them, attending
    to everything before it (earlier chunks are in the cache by then)."""
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    rows, starts, seq_lens = [], [0], []
    for i in range(meta.num_reqs):
        a, b = max(qsl[i], lo), min(qsl[i + 1], hi)
        if a >= b:
            continue
        rows.append(i)
        starts.append(starts[-1] + b - a)
        seq_lens.append(lens[i] - (qsl[i + 1] - b))  # keys up to this part's last query
    dev = meta.query_start_loc.device
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    return dataclasses.replace(
        meta,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=meta.block_table[index],
        slot_mapping=meta.slot_mapping[lo:hi],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        num_decodes=0,
        backend_cache={},
        cp_slot_mapping=meta.slot_mapping,
        cp_num_tokens=meta.num_tokens,
    )


def forward(runner: object, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
    """The whole step's hidden states [T, H], this rank having computed its chunk."""
    lo, hi = cp.chunk_range(meta.num_tokens)
    local = local_metadata(meta, lo, hi)
    hidden = runner.forward(input_ids[lo:hi], positions[lo:hi], local, False)  # [hi - lo, H]
    return cp.all_gather_tokens(hidden, meta.num_tokens)
