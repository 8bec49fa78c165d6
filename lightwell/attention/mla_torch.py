"""Multi-head latent attention (DeepSeek's MLA) over a paged latent cache, in plain torch.

The cache of an MLA layer holds one entry per token: the compressed latent ``c`` (kv_lora_rank
values, after its RMSNorm) followed by the rotated shared RoPE key ``k_pe`` (rope dims), as
``[1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]``: one "head", no separate values
(an 8-bit cache, ``--kv-cache-dtype fp8 / int8``, stores each entry with one scale, in
quant/kv_cache.py's layout: ``[..., kv_lora_rank + rope_dim + 4]``).
The query comes absorbed: ``[q_nope @ W_UK | q_pe]`` per head (``[T, H, kv_lora_rank +
rope_dim]``), so a score is ``q . entry`` and the output is ``softmax(scores) @ c`` (``[T, H,
kv_lora_rank]``), which the layer maps through ``W_UV``. Prefill chunks and decodes take the
same path: one request at a time, causal over its cached prefix plus its new tokens. This is
the CPU path; on the kernels decodes run through ``kernels/mla_decode.py`` and prefill requests
in the expanded form (``attention/mla_prefill.py``), this path serving only a layer whose value
head dim exceeds its query head dim.
"""

from __future__ import annotations

import torch

from lightwell.attention.metadata import AttentionMetadata
from lightwell.quant.kv_cache import dequantize_blocks, is_quantized, write_rows


def write_latent(
    kv_cache: torch.Tensor,  # [1, N, B, 1, D] (8-bit: D + 4)
    entry: torch.Tensor,  # [T, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * B + offset
) -> None:
    if is_quantized(kv_cache.dtype):  # quant/kv_cache.py's layout: one scale a token
        write_rows(kv_cache[0], entry[:, None, :], slot_mapping)
        return
    dim = kv_cache.shape[-1]
    kv_cache.view(-1, dim).index_copy_(0, slot_mapping, entry.to(kv_cache.dtype))


def gather_latent(
    kv_cache: torch.Tensor,  # [1, N, B, 1, D] (8-bit: D + 4)
    block_ids: torch.Tensor,  # [nb]
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [length, D] in dtype
    """The first ``length`` cached entries of one request, in order (8-bit: dequantized)."""
    if is_quantized(kv_cache.dtype):  # (gathered as bytes: index_select may lack fp8)
        raw = kv_cache[0].view(torch.uint8).index_select(0, block_ids).view(kv_cache.dtype)
        blocks = dequantize_blocks(raw, dtype)
        return blocks.reshape(-1, blocks.shape[-1])[:length]
    _, num_blocks, block_size, _, dim = kv_cache.shape
    blocks = kv_cache.view(num_blocks, block_size * dim).index_select(0, block_ids)
    return blocks.view(-1, dim)[:length].to(dtype)


def attend_latent(
    q: torch.Tensor,  # [T, H, D]: absorbed queries, D = kv_lora_rank + rope_dim
    entry: torch.Tensor,  # [T, D]: the step's new latent entries
    kv_cache: torch.Tensor | None,  # [1, N, B, 1, D]; None: profiling, fresh prefills only
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    first_req: int = 0,  # requests before it are the caller's (written, not attended here)
    out: torch.Tensor | None = None,  # [T, H, kv_lora_rank]
) -> torch.Tensor:  # [T, H, kv_lora_rank]
    """Write the new entries at ``meta.slot_mapping`` (unless ``first_req``), then attend each
    request's queries causally over its ``seq_lens[i]`` entries."""
    if q.shape[0] != meta.num_tokens or entry.shape[0] != q.shape[0]:
        raise ValueError(f"{q.shape[0]} queries / {entry.shape[0]} entries for {meta.num_tokens}")
    if kv_cache is not None and first_req == 0:
        write_latent(kv_cache, entry, meta.slot_mapping)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    qsl = meta.query_start_loc_cpu
    for i in range(first_req, meta.num_reqs):
        s, e = qsl[i], qsl[i + 1]
        length = meta.seq_lens_cpu[i]
        if length == e - s and (kv_cache is None or not is_quantized(kv_cache.dtype)):
            keys = entry[s:e]  # nothing cached before this chunk (8-bit: read back, as the GPU)
        elif kv_cache is None:
            raise ValueError("latent attention without a cache cannot serve cached tokens")
        else:
            num_blocks = -(-length // kv_cache.shape[2])
            keys = gather_latent(kv_cache, meta.block_table[i, :num_blocks], length, q.dtype)
        out[s:e] = latent_sdpa(q[s:e], keys, length - (e - s), scale, kv_lora_rank)
    return out


SCORES_PER_CHUNK = 1 << 26  # fp32 scores held at once (256 MB): queries go in chunks


def latent_sdpa(
    q: torch.Tensor,  # [n, H, D]
    keys: torch.Tensor,  # [L, D]: num_cached + n entries
    num_cached: int,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [n, H, kv_lora_rank]
    """Causal attention of n absorbed queries over the entries, a chunk of queries at a time
    (a long prefill's [H, n, L] scores would not fit: 128 heads x 8K x 8K is 34 GB)."""
    n, heads = q.shape[0], q.shape[1]
    keys32 = keys.float()
    latent = keys32[:, :kv_lora_rank]
    key_pos = torch.arange(keys.shape[0], device=q.device)
    step = max(1, SCORES_PER_CHUNK // (heads * keys.shape[0]))
    out = q.new_empty(n, heads, kv_lora_rank)
    for s in range(0, n, step):
        e = min(s + step, n)
        scores = torch.einsum("nhd,ld->hnl", q[s:e].float(), keys32) * scale  # [H, e - s, L]
        query_pos = torch.arange(num_cached + s, num_cached + e, device=q.device)
        scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[s:e] = torch.einsum("hnl,lc->nhc", scores.softmax(-1), latent).to(q.dtype)
    return out
