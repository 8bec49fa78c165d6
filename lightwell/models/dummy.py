"""Random weights of the model's shapes, drawn in place on the target device (benchmarks)."""

from __future__ import annotations

import torch
from torch import nn

from lightwell.layers.norm import LayerNorm, RMSNorm

DUMMY_STD = 0.02
_NORMS = (RMSNorm, LayerNorm, nn.LayerNorm)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Matrices and embeddings ~ N(0, std), norm weights 1, biases 0; seeded, on-device."""
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or param.is_meta:  # tied; shape-only (meta) models
                continue
            seen.add(id(param))
            if isinstance(module, _NORMS) and name == "weight":
                param.fill_(1.0)
            elif name == "bias" or param.ndim < 2:
                param.zero_()
            elif param.is_floating_point():
                gen = generators.get(param.device)
                if gen is None:
                    gen = generators[param.device] = torch.Generator(param.device)
                    gen.manual_seed(seed)
                param.normal_(0.0, std, generator=gen)
