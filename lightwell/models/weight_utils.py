"""Route checkpoint tensors to parameters: packed names, per-parameter loaders, completeness.

Models call ``load_packed_weights`` from their ``load_weights``; the layers' own
``weight_loader`` attributes do the copying and sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole (replicated) tensor, converting dtype and device."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"shape mismatch: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def _route(name: str, packed: dict[str, list[str]]) -> tuple[str, int | None, str | None]:
    """``...q_proj.weight`` -> (``...qkv_proj.weight``, 0, "qkv_proj"); others unchanged."""
    for fused, members in packed.items():
        for index, member in enumerate(members):
            token = f".{member}."
            if token in name:
                return name.replace(token, f".{fused}."), index, fused
    return name, None, None


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: dict[str, list[str]],
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load ``(checkpoint name, tensor)`` pairs; return the names of fully loaded parameters.

    A fused parameter counts as loaded once every member (q, k and v ...) arrived, or once a
    checkpoint tensor under the fused name itself did. Unknown names raise ``ValueError``.
    """
    from lightwell.models.pipeline import skip_missing

    skip = skip_missing(model, skip)  # tensors of the layers other pipeline stages hold
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shards: dict[str, set[int]] = {}
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard_id, fused = _route(name, packed_modules_mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r}: the model has no parameter {target!r}")
        loader = getattr(param, "weight_loader", None)
        if shard_id is None:
            (loader or default_weight_loader)(param, tensor)
            loaded.add(target)
            continue
        if loader is None:
            raise ValueError(f"parameter {target!r} is fused but has no weight_loader")
        loader(param, tensor, shard_id)
        seen = shards.setdefault(target, set())
        seen.add(shard_id)
        if len(seen) == len(packed_modules_mapping[fused]):
            loaded.add(target)
    return loaded
