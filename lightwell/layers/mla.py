"""DeepSeek's multi-head latent attention layer (MLA): projections, RoPE, latent cache.

Per token, ``kv_a_proj_with_mqa`` makes the latent ``c`` (kv_lora_rank, then RMSNorm) and one
RoPE key ``k_pe`` shared by every head; ``kv_b_proj`` would expand ``c`` into per-head keys
(``W_UK``) and values (``W_UV``). The cache stores only ``[c | rotated k_pe]`` (576 values a
token and layer for DeepSeek-V2/V3), and attention runs on it with the up-projections absorbed:
the query's no-RoPE part goes through ``W_UK`` into latent space, the latent output through
``W_UV`` to the heads' values (``lightwell/attention/mla_torch.py``). A decode-only step on the
kernels runs that work around the attention in two launches (``kernels/mla_prepare.py``:
the entry's norm, RoPE and store with the absorbed query and its RoPE; ``kernels/mla_output.py``:
the output through ``W_UV``) around the split-KV decode kernel; at one token the output kernel
also combines the decode's splits (no combine launch).
Any other step on the kernels runs its single-token requests the absorbed way and every other
request at once in the expanded form (``lightwell/attention/mla_prefill.py``: the cached
latents through ``kv_b_proj``, plain queries, the paged attention kernel); the output means the
same: per head, softmax-weighted values ``c @ W_UV^T``.

Tensor parallelism splits the heads (q / kv_b / o projections); the latent and its
projections are replicated. The query is plain (``q_proj``) or low-rank (``q_a_proj`` ->
RMSNorm -> ``q_b_proj``, when ``q_lora_rank`` is set). Its first projection and
``kv_a_proj_with_mqa`` read the same input: unquantized and without bias they are one matmul,
``fused_qkv_a_proj`` (this rank's query rows, then the whole latent rows).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightwell.attention.backend import get_attention_backend
from lightwell.attention.metadata import AttentionMetadata, get_attention_metadata
from lightwell.attention.mla_prefill import (
    compile_variants,
    expanded_prefill,
    leading_decodes,
    split_step,
)
from lightwell.attention.mla_torch import attend_latent
from lightwell.layers.attention import Attention
from lightwell.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    SplitReplicatedLinear,
)
from lightwell.layers.norm import DeferredNorm, RMSNorm
from lightwell.layers.rotary import RotaryEmbedding
from lightwell.quant.base import QuantMethod, is_unquantized


class LatentAttention(Attention):
    """Owns one layer's latent cache ``[1, N, B, 1, kv_lora_rank + rope_dim]``. On the
    kernels (``decode_kernel``: on CUDA by default) the step's single-token requests go
    through the split-KV Triton kernel (absorbed queries) and its prefill requests through the
    expanded prefill (``forward_expanded``); otherwise everything runs in torch
    (``attend_latent``).
    Steps with prefill tokens run eagerly: both prefill paths plan on the host."""

    decode_kernel: bool | None = None  # None: on CUDA
    # Decode-only steps through the kernel read no host metadata: CUDA graphs may capture
    # them; steps with prefill chunks must run eagerly (their paths plan on the host).
    cuda_graph_mode = "decode"

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        super().__init__(num_heads, kv_lora_rank + rope_dim, scale, num_kv_heads=1)
        self.kv_lora_rank = kv_lora_rank

    @property
    def backend(self) -> Any:  # the model runner's backend choice does not apply
        return get_attention_backend("torch")

    @backend.setter
    def backend(self, value: Any) -> None:
        pass

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1, num_blocks, block_size, 1, self.head_dim)

    def _kernel(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.decode_kernel is None else self.decode_kernel

    def decode_only(self, x: torch.Tensor) -> bool:
        """The step is all decodes and runs through the kernels (``MLAttention`` then fuses
        the work around the attention: kernels/mla_prepare.py)."""
        meta = get_attention_metadata()
        one_each = meta.num_decodes == meta.num_reqs == meta.num_tokens
        return self._kernel(x) and self.kv_cache is not None and one_each and meta.num_reqs > 0

    def expanded(self, x: torch.Tensor) -> bool:
        """The step runs through the kernels, not as all decodes (``forward_expanded``)."""
        meta = get_attention_metadata()
        return self._kernel(x) and self.kv_cache is not None and meta.num_reqs > 0

    def forward_expanded(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_pe: torch.Tensor,  # [T, H, rope]: rotated
        entry: torch.Tensor,  # [T, kv_lora_rank + rope]
        w_kvb: torch.Tensor,  # [H * (nope + v), kv_lora_rank]: kv_b_proj's weight
        dims: tuple[int, int, int],  # nope, rope, v
    ) -> torch.Tensor:  # [T, H, v]: the heads' values
        """Store the entries; the single-token requests absorbed through the decode kernel,
        the others expanded (attention/mla_prefill.py)."""
        from lightwell.kernels.mla_decode import mla_decode, pick_num_splits, store_latent

        meta, (nope, _, v) = get_attention_metadata(), dims
        split, heads = split_step(meta), q_nope.shape[1]
        store_latent(entry, self.kv_cache, meta.slot_mapping)
        out = q_nope.new_empty(q_nope.shape[0], heads, v)
        if split.num_decodes:
            w_uk, w_uv = w_kvb.view(heads, nope + v, -1).split([nope, v], dim=1)
            rows = split.decode_rows
            q_latent = torch.einsum("thn,hnr->thr", q_nope[rows], w_uk)  # [nd, H, rank]
            q = torch.cat([q_latent, q_pe[rows]], dim=-1)
            splits = pick_num_splits(split.num_decodes, heads, meta.max_seq_len)
            latent = mla_decode(q, self.kv_cache, split.decode_table, split.decode_lens,
                                self.scale, self.kv_lora_rank, splits)  # fmt: skip
            out[rows] = torch.einsum("thr,hvr->thv", latent, w_uv)
        if split.prefill is not None:
            rows = split.prefill_rows
            q = torch.cat([q_nope[rows], q_pe[rows]], dim=-1)  # [P, H, nope + rope]
            out[rows] = expanded_prefill(q, self.kv_cache, split.prefill, w_kvb, dims, self.scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [n, H, kv_lora_rank + rope]: absorbed, one token per request
        meta: AttentionMetadata,
        n: int,
        out: torch.Tensor | None = None,  # [n, H, kv_lora_rank]
    ) -> torch.Tensor:  # [n, H, kv_lora_rank]
        from lightwell.kernels.mla_decode import mla_decode, pick_num_splits

        splits = pick_num_splits(n, q.shape[1], meta.max_seq_len)
        return mla_decode(
            q.contiguous(), self.kv_cache, meta.block_table[:n], meta.seq_lens[:n],
            self.scale, self.kv_lora_rank, splits, out=out,
        )  # fmt: skip

    def decode_split(
        self,
        q: torch.Tensor,  # [n, H, kv_lora_rank + rope]: a decode-only step's absorbed queries
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # ([n, S, H, rank], [n, S, H]) float32
        """The split-KV decode's partial outputs and log-sum-exps, uncombined (their reader
        combines them), or None where the step takes one split."""
        from lightwell.kernels.mla_decode import mla_decode_split, pick_num_splits

        meta, n = get_attention_metadata(), q.shape[0]
        splits = pick_num_splits(n, q.shape[1], meta.max_seq_len)
        if splits < 2:
            return None
        return mla_decode_split(
            q.contiguous(), self.kv_cache, meta.block_table[:n], meta.seq_lens[:n],
            self.scale, self.kv_lora_rank, splits,
        )  # fmt: skip

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,  # [T, H, kv_lora_rank + rope_dim]
        entry: torch.Tensor | None,  # [T, kv_lora_rank + rope_dim]; None: already stored
    ) -> torch.Tensor:  # [T, H, kv_lora_rank]
        meta = get_attention_metadata()
        n = leading_decodes(meta)  # the first n requests, one token each
        if not self._kernel(q) or self.kv_cache is None or n == 0:
            return attend_latent(q, entry, self.kv_cache, meta, self.scale, self.kv_lora_rank)
        from lightwell.kernels.mla_decode import store_latent

        if entry is not None:
            store_latent(entry, self.kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], self.kv_lora_rank)
        self._decode(q[:n], meta, n, out[:n])
        if n < meta.num_reqs:
            attend_latent(q, entry, self.kv_cache, meta, self.scale, self.kv_lora_rank, n, out)
        return out


def mla_softmax_scale(config: Any, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
    scale = qk_head_dim**-0.5
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    m_all, factor = rope.get("mscale_all_dim"), rope.get("factor") or 1.0
    if kind != "default" and m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _kv_b_method(quant_method: QuantMethod | None) -> Any:
    """``kv_b_proj``'s method: the attention reads its weight itself, in the model dtype. A
    packed weight-only format loads as published and is dequantized after loading
    (``DenseAfterLoading``); an 8-bit one is dequantized as it loads
    (models/deepseek_v2.py); otherwise it is unquantized (None)."""
    from lightwell.quant.wna16 import DenseAfterLoading, WNA16Method

    return DenseAfterLoading(quant_method) if isinstance(quant_method, WNA16Method) else None


class MLAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_method: QuantMethod | None,
    ):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        qk_dim = self.nope + self.rope
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        self._make_input_projections(hidden, heads * qk_dim, bias, quant_method)
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, heads * qk_dim, False, quant_method=quant_method
            )
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.rank, heads * (self.nope + self.v_dim), False,
            quant_method=_kv_b_method(quant_method),
        )  # fmt: skip
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, quant_method=quant_method)
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.nope + self.v_dim)
        self.rotary_emb = rotary_emb
        scale = mla_softmax_scale(config, qk_dim)
        self.attn = LatentAttention(self.num_heads, self.rank, self.rope, scale)

    @property
    def takes_deferred_norm(self) -> bool:
        """Whether ``partial`` may take its input as a ``DeferredNorm`` (layers/norm.py): the
        first projection is the one unquantized ``fused_qkv_a_proj``."""
        return bool(self.packed_names)

    def _make_input_projections(
        self, hidden: int, q_size: int, bias: bool, quant_method: QuantMethod | None
    ) -> None:
        """The query's first projection (``q_proj``, or ``q_a_proj`` with q LoRA) and the
        latent one (``kv_a_proj_with_mqa``): unquantized and without bias, one matmul over both
        (``fused_qkv_a_proj``, its members in ``packed_names``), else two linears."""
        first = "q_a_proj" if self.q_lora_rank else "q_proj"
        latent = self.rank + self.rope
        self.packed_names = {"fused_qkv_a_proj": [first, "kv_a_proj_with_mqa"]}
        if is_unquantized(quant_method) and not bias:
            sizes, sharded = [self.q_lora_rank or q_size, latent], [not self.q_lora_rank, False]
            self.fused_qkv_a_proj = SplitReplicatedLinear(hidden, sizes, sharded, quant_method)
            return
        self.packed_names = {}
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, quant_method)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_size, False, quant_method=quant_method)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent, bias, quant_method)

    def _project(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> ([T, heads * qk_dim], [T, rank + rope])
        """The query (this rank's heads) and the latent projection, rows possibly strided;
        ``hidden`` may be a ``DeferredNorm`` (``takes_deferred_norm``)."""
        if self.packed_names:
            fused = self.fused_qkv_a_proj
            out = hidden.matmul(fused.weight) if isinstance(hidden, DeferredNorm) else fused(hidden)
            q, kv = out.split(fused.output_partition_sizes, dim=-1)
        else:
            q = (self.q_a_proj if self.q_lora_rank else self.q_proj)(hidden)
            kv = self.kv_a_proj_with_mqa(hidden)
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q, kv

    def attend(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
    ) -> torch.Tensor:  # [T, heads * v_dim / tp]
        if self.attn.decode_only(hidden):
            return self._attend_decodes(positions, hidden)
        num_tokens, heads = hidden.shape[0], self.num_heads
        q, kv = self._project(hidden)
        q_nope, q_pe = q.view(num_tokens, heads, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1
        )
        c, k_pe = kv.split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())  # [T, rank]
        q_pe, k_pe = self.rotary_emb(
            positions, q_pe.reshape(num_tokens, heads * self.rope), k_pe.contiguous()
        )
        q_pe, entry = q_pe.view(num_tokens, heads, self.rope), torch.cat([c, k_pe], dim=-1)
        if self.attn.expanded(hidden) and self.v_dim <= self.nope + self.rope:
            dims = (self.nope, self.rope, self.v_dim)
            out = self.attn.forward_expanded(q_nope, q_pe, entry, self.kv_b_proj.weight, dims)
            return out.reshape(num_tokens, heads * self.v_dim)
        w = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)  # [h, nope, rank], [h, v, rank]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, h, rank]
        out = self.attn(torch.cat([q_latent, q_pe], dim=-1), entry)  # [T, h, rank]
        return torch.einsum("thr,hvr->thv", out, w_uv).reshape(num_tokens, heads * self.v_dim)

    def _attend_decodes(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
    ) -> torch.Tensor:  # [T, heads * v_dim / tp]
        """``attend`` for a decode-only step after the projections: the entry and the query
        in one launch, the split-KV attention, the output through ``W_UV``."""
        # imported here: Triton kernels load on the kernel path only (the CPU image has no Triton)
        from lightwell.kernels.mla_output import FEW_TOKENS, absorb_output
        from lightwell.kernels.mla_prepare import prepare_decode

        rot, norm, w = self.rotary_emb, self.kv_a_layernorm, self.kv_b_proj.weight
        slots = get_attention_metadata().slot_mapping
        query, kv = self._project(hidden)
        dims = (self.nope, self.rope, self.v_dim)
        rope = (rot.cos_sin_cache, rot.is_neox_style)
        norm_eps = (norm.weight, norm.eps)
        q = prepare_decode(positions, query, kv, norm_eps, w, dims, rope, self.attn.kv_cache, slots)
        if q.shape[0] <= FEW_TOKENS and (split := self.attn.decode_split(q)) is not None:
            # the output kernel combines the splits as it reads them
            return absorb_output(split[0], w, (self.nope, self.v_dim), split[1])
        return absorb_output(self.attn(q, None), w, (self.nope, self.v_dim))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.o_proj(self.attend(positions, hidden))

    def compile_kernel_variants(self) -> int:
        """Start-up on CUDA: the expanded prefill's attention kernel variants
        (attention/mla_prefill.compile_variants), the decode kernel at each split-count
        variant (eager mixed steps pick splits by their batch) and the output's few-token
        kernel (kernels/mla_output.py) alone and combining each split count, compiled before
        serving. Returns the launches made."""
        cache, dims = self.attn.kv_cache, (self.nope, self.rope, self.v_dim)
        if cache is None or not self.attn._kernel(cache):
            return 0
        # (Triton: lazily)
        from lightwell.kernels.mla_decode import MAX_SPLITS, mla_decode
        from lightwell.kernels.mla_output import absorb_output

        dtype = self.kv_b_proj.weight.dtype  # the queries' (the cache may be 8-bit)
        q = torch.zeros(1, self.num_heads, self.rank + self.rope, dtype=dtype, device=cache.device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=cache.device)
        lens = torch.ones(1, dtype=torch.int32, device=cache.device)
        splits = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= MAX_SPLITS]
        for s in splits:
            mla_decode(q, cache, table, lens, 1.0, self.rank, s)
        latent = q.new_zeros(1, self.num_heads, self.rank)  # the output's few-token kernel
        absorb_output(latent, self.kv_b_proj.weight, (self.nope, self.v_dim))
        for s in splits[1:]:  # and its variants combining the decode's splits
            part = torch.zeros(1, s, self.num_heads, self.rank, device=cache.device)
            lse = torch.zeros(1, s, self.num_heads, device=cache.device)
            absorb_output(part, self.kv_b_proj.weight, (self.nope, self.v_dim), lse)
        launches = 2 * len(splits)
        if self.v_dim > self.nope + self.rope:
            return launches
        return launches + compile_variants(cache, self.kv_b_proj.weight, dims, self.num_heads)

    def partial(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H]: this rank's o_proj partial sum, not all-reduced."""
        return self.o_proj.partial(self.attend(positions, hidden))
