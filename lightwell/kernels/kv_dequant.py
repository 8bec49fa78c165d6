"""Prompt chunks over an 8-bit KV cache: a copy of their requests' blocks in the query dtype.

Paged attention can read an 8-bit cache directly (kernels/paged_attention.py), which pays off
in decode, where the keys' bytes are the cost. A prompt chunk's tiles instead reuse every key
for many query rows, and converting 8-bit tiles to 16 bits inside the kernel costs more than
the bytes it saves (the converted tile goes through registers before the tensor cores read it).
So a launch of prompt chunks with at least ``MIN_COPY_TOKENS`` query tokens first dequantizes
each request's blocks (a block two requests share, once for each; all of a request's blocks,
even those before a sliding window) into a scratch cache of the query dtype, then runs the
model-dtype kernel over it through a block table renumbered to the copy. The copy is skipped
(the direct path serves) for metadata whose host-side lengths are not the step's (CUDA graphs:
``static_layout``; capture), and when it would exceed ``MAX_COPY_BYTES``, the memory start-up
sets aside for it (``reserve_bytes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from lightwell.kernels.kv_quant import head_dim_of, is_quantized, scale_ptrs

if TYPE_CHECKING:  # (the metadata's type only: kernels sit below attention/)
    from lightwell.attention.metadata import AttentionMetadata

MIN_COPY_TOKENS = 128  # query tokens in a launch from which prompt chunks read a copy
MAX_COPY_BYTES = 256 << 20  # the copy's size (K and V) above which the direct path serves
_ROWS = 32  # (token, head) rows a program converts


@triton.jit
def _dequant_blocks_kernel(
    src_ptr,  # [N, B, Hkv, D + 4] 8-bit cache (K or V)
    ids_ptr,  # [M] int32: the blocks to copy
    dst_ptr,  # [M, B, Hkv, D] query dtype
    stride_src_blk,
    stride_dst_blk,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    i = tl.program_id(0)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    src = src_ptr + blk * stride_src_blk
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # rows token * Hkv + head
    d = tl.arange(0, BLOCK_D)
    r_ok = r < BLOCK_SIZE * NUM_KV_HEADS
    mask = r_ok[:, None] & (d[None, :] < HEAD_DIM)
    vals = tl.load(src + r[:, None] * HEAD_DIM + d[None, :], mask=mask)
    scale = tl.load(
        scale_ptrs(src, r // NUM_KV_HEADS, r % NUM_KV_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE),
        mask=r_ok,
        other=0.0,
    )
    out = vals.to(tl.float32) * scale[:, None]
    dst = dst_ptr + i.to(tl.int64) * stride_dst_blk
    tl.store(dst + r[:, None] * HEAD_DIM + d[None, :], out.to(dst_ptr.dtype.element_ty), mask=mask)


def dequantize_cache_blocks(
    k_cache: torch.Tensor,  # [N, B, Hkv, D + 4] 8-bit
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [M] int32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, B, Hkv, D], [M, B, Hkv, D]) in dtype
    """Blocks ``block_ids`` of K and V, dequantized (``quant/kv_cache.py``'s
    ``dequantize_blocks``, rounded once to ``dtype``)."""
    _, block_size, heads, _ = k_cache.shape
    head_dim = head_dim_of(k_cache)
    shape = (block_ids.numel(), block_size, heads, head_dim)
    # (two allocations: each copy starts aligned whatever M, so M specialises nothing)
    out = [torch.empty(shape, dtype=dtype, device=k_cache.device) for _ in range(2)]
    if block_ids.numel() == 0:
        return out[0], out[1]
    grid = (block_ids.numel(), triton.cdiv(block_size * heads, _ROWS))
    for src, dst in zip((k_cache, v_cache), out):
        _dequant_blocks_kernel[grid](
            src, block_ids, dst, src.stride(0), dst.stride(0),
            NUM_KV_HEADS=heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_D=triton.next_power_of_2(head_dim), ROWS=_ROWS, num_warps=4,
        )  # fmt: skip
    return out[0], out[1]


def copy_for_prefill(
    k_cache: torch.Tensor,  # [N, B, Hkv, D + 4]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    r0: int,
    r1: int,
    dtype: torch.dtype,
    force: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(K copy, V copy, block table [r1, nb]: rows r0:r1 renumbered into the copy) for the
    prompt chunks of requests ``r0:r1``, or None where the direct path serves (the module
    docstring says when; ``force`` skips the token threshold: start-up compiles)."""
    if not is_quantized(k_cache.dtype) or meta.static_layout:
        return None
    tokens = meta.query_start_loc_cpu[r1] - meta.query_start_loc_cpu[r0]
    if (tokens < MIN_COPY_TOKENS and not force) or _capturing(k_cache.device):
        return None
    block_size, heads = k_cache.shape[1:3]
    lens = meta.seq_lens_cpu[r0:r1]
    counts = [triton.cdiv(n, block_size) for n in lens]
    total = sum(counts)
    if 2 * total * block_size * heads * head_dim_of(k_cache) * dtype.itemsize > MAX_COPY_BYTES:
        return None
    key = ("kv_copy", r0, r1)
    plan = meta.backend_cache.get(key)
    if plan is None:  # once a step: the layers share it
        rows = range(r0, r1)
        ids = torch.cat([meta.block_table[r, :n] for r, n in zip(rows, counts)])
        table = torch.zeros((r1, max(counts)), dtype=torch.int32)
        first = 0
        for r, n in zip(rows, counts):
            table[r, :n] = torch.arange(first, first + n, dtype=torch.int32)
            first += n
        plan = meta.backend_cache[key] = (ids, table.to(k_cache.device, non_blocking=True))
    ids, table = plan
    k, v = dequantize_cache_blocks(k_cache, v_cache, ids, dtype)
    return k, v, table


def reserve_bytes(cache_dtype: torch.dtype, concurrent: int = 1) -> int:
    """Memory the copies may take at once (``concurrent`` attention calls in flight), outside
    the profiled peak of a forward without a cache."""
    return MAX_COPY_BYTES * concurrent if is_quantized(cache_dtype) else 0


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
