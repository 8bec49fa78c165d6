"""Random weights of the model's shapes, drawn in place on the target device (benchmarks)."""

from __future__ import annotations

import torch
from torch import nn

from lightwell.layers.norm import LayerNorm, RMSNorm

DUMMY_STD = 0.02
_NORMS = (RMSNorm, LayerNorm, nn.LayerNorm)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Matrices and embeddings ~ N(0, std), norm weights 1, biases 0, quantized storage random;
    seeded, on-device."""
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
            else:
                gen = generators.get(param.device)
                if gen is None:
                    gen = generators[param.device] = torch.Generator(param.device)
                    gen.manual_seed(seed)
                _fill(param, std, gen)


def _fill(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """N(0, std) for 16/32-bit floats; quantized storage (packed int32 words, int8 and fp8
    weights) gets random bits (int) or N(0, 1) values (fp8): a quantized checkpoint's shapes."""
    if param.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        param.normal_(0.0, std, generator=gen)
    elif param.is_floating_point():  # fp8: drawn in fp32, converted
        param.copy_(torch.randn(param.shape, generator=gen, device=param.device))
    elif param.dtype in (torch.int32, torch.int8):
        info = torch.iinfo(param.dtype)
        param.random_(info.min, info.max, generator=gen)
