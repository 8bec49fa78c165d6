"""Reference attention in plain torch: the correctness oracle, and the CPU path.

Decodes (query_len 1) of a batch are served together by one padded gather over their block
tables and two batched matmuls; prefill chunks go one request at a time through
``scaled_dot_product_attention`` (causal, offset by the request's cached length). With a sliding
window, keys more than ``window - 1`` positions behind a query are masked (prefill chunks slice
them off first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightwell.attention.metadata import AttentionMetadata
from lightwell.quant.kv_cache import dequantize_blocks, dequantize_kv, quantize_kv, write_rows


def write_kv_cache(
    kv_cache: torch.Tensor,  # [2, N, B, Hkv, D'] (D' = D, or D + 4 for an 8-bit cache)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * B + offset
) -> None:
    """Store k/v in the cache's dtype and layout (``lightwell/quant/kv_cache.py``)."""
    for i, x in enumerate((k, v)):
        write_rows(kv_cache[i], x, slot_mapping)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes (index_copy_ / index_select have no fp8 kernels on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_kv(
    kv_cache: torch.Tensor,  # [2, N, B, Hkv, D']
    block_ids: torch.Tensor,  # [nb]
    length: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([L, Hkv, D], [L, Hkv, D]) in dtype
    """The first ``length`` cached tokens of one request, in order, dequantized to ``dtype``."""
    blocks = dequantize_blocks(_take_blocks(kv_cache, block_ids), dtype)  # [2, nb, B, Hkv, D]
    kv = blocks.flatten(1, 2)[:, :length]  # [2, L, Hkv, D]
    return kv[0], kv[1]


def _consecutive_start(blocks: torch.Tensor) -> int | None:  # blocks [1, nb]
    """The first block id if the ids are first, first+1, ... (fresh pools hand them out so)."""
    ids = blocks[0].tolist()
    return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None


def _take_blocks(
    kv_cache: torch.Tensor,  # [2, N, B, Hkv, D']
    block_ids: torch.Tensor,  # [*S] any shape
) -> torch.Tensor:  # [2, *S, B, Hkv, D'] whole blocks, in the cache's layout
    """Gather whole blocks with index_select (advanced indexing over dim 1 is ~10x slower)."""
    two, _, block_size, heads, dim = kv_cache.shape
    raw = _raw(kv_cache)
    flat = raw.view(two, kv_cache.shape[1], -1).index_select(1, block_ids.reshape(-1))
    flat = flat.view(kv_cache.dtype)
    return flat.view(two, *block_ids.shape, block_size, heads, dim)


@dataclass
class _StepPlan:
    """How one step's requests split, computed once per metadata and shared by all layers."""

    prefills: list[int]  # requests with query_len > 1
    decodes: list[int]  # requests with query_len == 1
    decode_rows: torch.Tensor | None  # [R_dec] their rows in block_table / seq_lens
    decode_tokens: torch.Tensor | None  # [R_dec] their token index in the flat batch
    max_decode_len: int
    decode_blocks: torch.Tensor | None = None  # [R_dec, nb] their block ids
    decode_pad: torch.Tensor | None = None  # [R_dec, L] True past a request's end; None: none
    decode_len: int = 0  # L: keys gathered per decode request
    decode_first_block: int | None = None  # one request on consecutive blocks: a view, no copy

    @classmethod
    def build(cls, meta: AttentionMetadata, device: torch.device, block_size: int) -> _StepPlan:
        qsl = meta.query_start_loc_cpu
        decodes = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        prefills = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] > 1]
        if not decodes:
            return cls(prefills, decodes, None, None, 0)
        rows = torch.tensor(decodes, device=device)
        tokens = torch.tensor([qsl[i] for i in decodes], device=device)
        lens = [meta.seq_lens_cpu[i] for i in decodes]
        max_len = max(lens)
        num_blocks = -(-max_len // block_size)
        blocks = meta.block_table[rows, :num_blocks]
        if all(n == max_len for n in lens):  # e.g. batch 1: slice, nothing to mask
            first = _consecutive_start(blocks) if len(decodes) == 1 else None
            return cls(prefills, decodes, rows, tokens, max_len, blocks, None, max_len, first)
        length = num_blocks * block_size
        key_pos = torch.arange(length, device=device)[None, :]
        pad = key_pos >= meta.seq_lens[rows, None]
        return cls(prefills, decodes, rows, tokens, max_len, blocks, pad, length)


class TorchAttentionBackend:
    name = "torch"
    # Host-side planning per step (and index_copy_ rejecting padded slots): eager only.
    supports_cuda_graphs = False

    @staticmethod
    def _plan_for(meta: AttentionMetadata, device: torch.device, block_size: int) -> _StepPlan:
        """Built by the first layer of a step, kept on the step's metadata for the others."""
        plan = meta.backend_cache.get("torch_plan")
        if plan is None:
            plan = meta.backend_cache["torch_plan"] = _StepPlan.build(meta, device, block_size)
        return plan

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
        _check_shapes(q, k, v, meta)
        out = torch.empty_like(q)
        window = sliding_window
        if kv_cache is None:
            _attend_without_cache(q, k, v, meta, scale, window, out)
            return out
        write_kv_cache(kv_cache, k, v, meta.slot_mapping)
        plan = self._plan_for(meta, q.device, kv_cache.shape[2])
        if plan.decodes:
            _attend_decodes(q, kv_cache, meta, plan, scale, window, out)
        for i in plan.prefills:
            _attend_prefill(q, k, v, kv_cache, meta, i, scale, window, out)
        return out


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q/k/v shapes disagree: {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"{q.shape[0]} tokens given, metadata describes {meta.num_tokens}")


def _sdpa(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D]
    v: torch.Tensor,  # [L, Hkv, D]
    num_cached: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [n, Hq, D]
    """Causal attention of n new queries over L = num_cached + n keys (the last ``window``
    of them per query, with a sliding window)."""
    n = q.shape[0]
    first = 0 if window is None else max(num_cached - window + 1, 0)  # first key in reach
    k, v = k[first:], v[first:]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gqa = qh.shape[0] != kh.shape[0]
    if num_cached == 0 and (window is None or window >= n):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        key_pos = torch.arange(first, num_cached + n, device=q.device)
        query_pos = torch.arange(num_cached, num_cached + n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, L - first]
        if window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)


def _attend_without_cache(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    out: torch.Tensor,  # [T, Hq, D]
) -> None:
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_reqs):
        s, e = qsl[i], qsl[i + 1]
        if meta.seq_lens_cpu[i] != e - s:
            raise ValueError("attention without a KV cache cannot serve cached tokens")
        out[s:e] = _sdpa(q[s:e], k[s:e], v[s:e], 0, scale, window)


def _attend_prefill(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, N, B, Hkv, D]
    meta: AttentionMetadata,
    i: int,
    scale: float,
    window: int | None,
    out: torch.Tensor,  # [T, Hq, D]
) -> None:
    s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
    length = meta.seq_lens_cpu[i]
    num_cached = length - (e - s)
    if num_cached == 0:  # nothing before this chunk: the new k/v are the whole sequence
        keys, values = _as_stored(k[s:e], kv_cache.dtype), _as_stored(v[s:e], kv_cache.dtype)
        out[s:e] = _sdpa(q[s:e], keys, values, 0, scale, window)
        return
    block_size = kv_cache.shape[2]
    num_blocks = -(-length // block_size)
    keys, values = gather_kv(kv_cache, meta.block_table[i, :num_blocks], length, q.dtype)
    out[s:e] = _sdpa(q[s:e], keys, values, num_cached, scale, window)


def _as_stored(
    x: torch.Tensor,  # [n, Hkv, D]
    cache_dtype: torch.dtype,
) -> torch.Tensor:  # [n, Hkv, D]
    """``x`` as the cache gives it back: an 8-bit cache's round trip, so a fresh prompt sees the
    keys/values a later chunk, a decode or a prefix-cache hit reads (the Triton kernels too)."""
    return dequantize_kv(*quantize_kv(x, cache_dtype), x.dtype)


def _attend_decodes(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, N, B, Hkv, D]
    meta: AttentionMetadata,
    plan: _StepPlan,
    scale: float,
    window: int | None,
    out: torch.Tensor,  # [T, Hq, D]
) -> None:
    """All query_len-1 requests at once: gather their blocks padded to the longest (keys out
    of the window are masked like the padding)."""
    device = q.device
    num_kv_heads, head_dim = kv_cache.shape[-2], q.shape[-1]
    tokens, num_reqs = plan.decode_tokens, len(plan.decodes)
    owned = plan.decode_first_block is None  # False: kv is a view into the cache
    if not owned:  # [2, 1, nb, B, Hkv, D']
        nb = plan.decode_blocks.shape[1]
        kv = kv_cache[:, None, plan.decode_first_block : plan.decode_first_block + nb]
    else:
        kv = _take_blocks(kv_cache, plan.decode_blocks)  # [2, R, nb, B, Hkv, D']
    if kv.dtype != q.dtype:
        kv, owned = dequantize_blocks(kv, q.dtype), True
    kv = kv.flatten(2, 3)[:, :, : plan.decode_len]  # [2, R, L, Hkv, D]
    pad = plan.decode_pad  # [R, L] or None
    if window is not None:  # the query sits at seq_len - 1
        key_pos = torch.arange(kv.shape[2], device=device)[None, :]
        out_of_window = key_pos <= meta.seq_lens[plan.decode_rows, None] - 1 - window
        pad = out_of_window if pad is None else pad | out_of_window
    group = q.shape[1] // num_kv_heads
    qd = q[tokens].view(num_reqs, -1, 1, head_dim)  # [R, Hq, 1, D]
    mask = None
    if pad is not None:
        if not owned:
            kv = kv.clone()  # never write into the cache
        # Zero the keys/values past each request's end (they may hold anything, even NaN),
        # then mask them: one fused attention kernel for the whole padded batch.
        kv.masked_fill_(pad[None, :, :, None, None], 0)
        mask = ~pad[:, None, None, :]  # [R, 1, 1, L] True = attend
    kh, vh = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [R, Hkv, L, D]
    o = F.scaled_dot_product_attention(
        qd, kh, vh, attn_mask=mask, scale=scale, enable_gqa=group > 1
    )  # [R, Hq, 1, D]
    out[tokens] = o.reshape(num_reqs, -1, head_dim)
