"""Attention backend protocol and registry (backends are imported only when chosen)."""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import torch

from lightwell.attention.metadata import AttentionMetadata


@runtime_checkable
class AttentionBackend(Protocol):
    name: str
    supports_cuda_graphs: bool  # may a decode step through it be captured in a CUDA graph?

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write the new k/v into ``kv_cache`` at ``meta.slot_mapping``, then attend: request i's
        queries see its ``seq_lens[i]`` tokens causally (cached prefix + new tokens so far);
        with ``sliding_window`` w, a query at position p sees only keys p - w < j <= p.
        With ``kv_cache=None`` (profiling runs) every request is a fresh causal prefill."""
        ...


# name -> (module, class); a backend's optional dependencies load only when it is chosen.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("lightwell.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("lightwell.attention.triton_backend", "TritonAttentionBackend"),
}
_INSTANCES: dict[str, AttentionBackend] = {}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """The (stateless, shared) backend registered as ``name``."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (available: {', '.join(available_backends())})"
        )
    if name not in _INSTANCES:
        module, cls = _BACKENDS[name]
        _INSTANCES[name] = getattr(importlib.import_module(module), cls)()
    return _INSTANCES[name]
