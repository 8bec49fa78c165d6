"""Per-step attention inputs, and the forward context that hands them to every layer.

The batch is flat: T tokens from R requests, request i owning tokens
``query_start_loc[i]:query_start_loc[i+1]``. Each request attends to its ``seq_lens[i]`` tokens:
the ``seq_lens[i] - query_len_i`` already cached (read through ``block_table``) plus its own
new tokens (causal). New K/V are written to ``slot_mapping`` (slot = block_id * block_size +
offset) before attention runs.

KV-cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R+1] int32, on device
    seq_lens: torch.Tensor  # [R] int32, on device: cached + new tokens
    block_table: torch.Tensor  # [R, max_blocks] int32, on device
    slot_mapping: torch.Tensor  # [T] int64, on device
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends (and the torch reference) that loop over requests.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int = 0  # requests with query_len == 1 come first in decode-heavy batches
    # A mixed-step CUDA graph's capture-time metadata: the host values above describe a
    # placeholder layout (only the token and request counts hold at replay), so code that
    # splits or reshapes the batch derives the rest on the device.
    static_layout: bool = False
    # Per-step scratch for backends: what the first layer derives from this metadata (a plan,
    # masks, gather indices) is kept here and reused by every other layer of the step.
    backend_cache: dict = field(default_factory=dict)
    # Context parallelism: this metadata describes this rank's chunk of the step; the whole
    # step's slot mapping [T_all] and token count, for storing every rank's keys and values.
    cp_slot_mapping: torch.Tensor | None = None
    cp_num_tokens: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


_CURRENT: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    """Make ``meta`` visible to every attention layer for the duration of one forward."""
    global _CURRENT
    prev, _CURRENT = _CURRENT, meta
    try:
        yield
    finally:
        _CURRENT = prev


def get_attention_metadata() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention layers run only inside forward_context(meta)")
    return _CURRENT
