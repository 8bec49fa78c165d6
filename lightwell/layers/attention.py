"""The attention layer: holds its KV-cache tensor and hands the work to a backend.

The model runner allocates one cache per layer after the model is built and binds it:
``for layer in (m for m in model.modules() if isinstance(m, Attention)): layer.kv_cache = t``
(in ``model.modules()`` order, which is layer order). Each forward reads the step's
``AttentionMetadata`` from ``forward_context``.

``sliding_window`` (Mistral, Qwen2's upper layers): a query at position ``i`` sees only keys
``j`` with ``i - window < j <= i`` (HF transformers' convention: ``window`` keys, itself
included). Every key stays in the cache; backends skip the ones out of reach.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightwell.attention.backend import get_attention_backend
from lightwell.attention.metadata import get_attention_metadata


class Attention(nn.Module):
    kv_cache: torch.Tensor | None  # [2, num_blocks, block_size, num_kv_heads, head_dim]

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        backend_name: str = "torch",
        *,
        sliding_window: int | None = None,
    ):
        """``num_heads`` / ``num_kv_heads`` are this rank's heads (after tensor parallelism)."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {num_kv_heads} KV heads")
        self.head_dim = head_dim
        self.scale = scale
        self.backend = get_attention_backend(backend_name)
        self.kv_cache = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq * D]
        k: torch.Tensor,  # [T, Hkv * D]
        v: torch.Tensor,  # [T, Hkv * D]
        rope: tuple[Any, torch.Tensor] | None = None,  # (RotaryEmbedding, positions [T])
    ) -> torch.Tensor:  # [T, Hq * D]
        """Attend; with ``rope``, q and k are rotated first (in place), and where the backend
        can (``stores_with_rope``: the Triton kernels), the rotation and the KV-cache store
        are one kernel launch."""
        meta = get_attention_metadata()
        num_tokens = q.shape[0]
        if meta.cp_slot_mapping is not None and self.kv_cache is not None:
            q, k = self._store_all_chunks(meta, q, k, v, rope)
            rope = None  # rotated; the backend stores this chunk again and attends
        if rope is not None:
            rotary, positions = rope
            if self.kv_cache is not None and getattr(self.backend, "stores_with_rope", False):
                rotary.rotate_and_store(positions, q, k, v, self.kv_cache, meta.slot_mapping)
                out = self.backend.attend_stored(
                    q.view(num_tokens, self.num_heads, self.head_dim),
                    self.kv_cache,
                    meta,
                    self.scale,
                    sliding_window=self.sliding_window,
                )
                return out.reshape(num_tokens, self.num_heads * self.head_dim)
            q, k = rotary(positions, q, k)
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _store_all_chunks(
        self,
        meta: Any,
        q: torch.Tensor,  # [T, Hq * D], this rank's chunk
        k: torch.Tensor,  # [T, Hkv * D]
        v: torch.Tensor,  # [T, Hkv * D]
        rope: tuple[Any, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallelism: rotate this chunk's q/k, gather every rank's keys and values
        and store them all, so this chunk's queries see the whole step (all-gather of K/V)."""
        from lightwell.attention.torch_backend import write_kv_cache
        from lightwell.distributed.context_parallel import all_gather_tokens

        if rope is not None:
            rotary, positions = rope
            q, k = rotary(positions, q, k)
        kv = all_gather_tokens(torch.stack([k, v], dim=1), meta.cp_num_tokens)  # [T_all, 2, .]
        shape = (meta.cp_num_tokens, self.num_kv_heads, self.head_dim)
        write_kv_cache(
            self.kv_cache, kv[:, 0].view(shape), kv[:, 1].view(shape), meta.cp_slot_mapping
        )
        return q, k

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend.name}"
        ) + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
