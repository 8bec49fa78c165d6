"""Tile shapes of the paged attention kernel (lightwell/kernels/paged_attention.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape of one launch: ``block_m`` rows = query tokens x query heads of a KV group."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


MAX_HEAD_DIM = 256


def default_config(head_dim: int, decode: bool) -> AttentionConfig:
    """Tile shape for decode (query_len 1: 16 rows hold the query heads of one group) or for
    prefill (128 rows), sized for Hopper's shared memory."""
    if decode:
        return AttentionConfig(16, 64 if head_dim <= 128 else 32, 4, 3)
    if head_dim <= 128:
        return AttentionConfig(128, 64, 8, 3)
    return AttentionConfig(64, 32, 4, 2)
