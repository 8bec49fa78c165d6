"""Tile shapes of the paged attention kernel (lightwell/kernels/paged_attention.py), and its
tile helpers: which request and query rows a program owns, a masked K/V tile load."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape of one launch: ``block_m`` rows = query tokens x query heads of a KV group."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


MAX_HEAD_DIM = 256


def default_config(
    head_dim: int, decode: bool, kv_quant: bool = False, wide: bool = False
) -> AttentionConfig:
    """Tile shape for decode (query_len 1: 16 rows hold the query heads of one group) or for
    prefill (128 rows), sized for Hopper's shared memory. Decode over an 8-bit cache reads
    128-key tiles (the bytes of a 64-key 16-bit tile) on 4 warps, two stages deep, or, ``wide``
    (at least a program per SM), 64-key tiles on 2 warps: more programs resident per SM, more
    bytes in flight; benchmarks/kernels/kv_quant.py times the alternatives."""
    if decode:
        if kv_quant and head_dim <= 128:
            return AttentionConfig(16, 64, 2, 3) if wide else AttentionConfig(16, 128, 4, 2)
        return AttentionConfig(16, 64 if head_dim <= 128 else 32, 4, 3)
    if head_dim <= 128:
        return AttentionConfig(128, 64, 8, 3)
    return AttentionConfig(64, 32, 4, 2)


@triton.jit
def _find_request(qsl_ptr, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request i with ``qsl[i] // BLOCK_Q + i <= tile_id``."""
    lo = tile_id * 0  # int32 tensors (an int argument equal to 1 is specialised to a constant)
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def locate_tile(
    qsl_ptr, tile_id, tile_base, num_reqs, BLOCK_Q: tl.constexpr, ONE_TILE: tl.constexpr
):
    """(request, first query index) of program ``tile_id``."""
    if ONE_TILE:
        req = tile_id
        t0 = tile_id * 0
    else:
        vid = tile_id + tile_base
        req = _find_request(qsl_ptr, vid, num_reqs, BLOCK_Q)
        first = tl.load(qsl_ptr + req) // BLOCK_Q + req
        num_slots = tl.load(qsl_ptr + req + 1) // BLOCK_Q + req + 1 - first
        t0 = (num_slots - 1 - (vid - first)) * BLOCK_Q  # last (longest) tiles launch first
    return req, t0


@triton.jit
def load_tile(ptrs, n_ok, d_ok, MASK_N: tl.constexpr, PAD_D: tl.constexpr):
    if MASK_N and PAD_D:
        x = tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif MASK_N:
        x = tl.load(ptrs, mask=n_ok[:, None], other=0.0)
    elif PAD_D:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x
