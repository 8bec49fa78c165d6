"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.quant.input_quant import InputQuant, QuantizedInput, quantize_input


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` (the fused gate_up projection's output)."""

    def forward(
        self,
        x: torch.Tensor,  # [T, 2*I]
        quant: InputQuant | None = None,  # the consuming linear's input quantization
    ) -> torch.Tensor | QuantizedInput:  # [T, I]
        if quant is not None:
            return self._forward_quant(x, quant)
        if x.is_cuda:
            from lightwell.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def _forward_quant(
        self,
        x: torch.Tensor,  # [T, 2*I]
        quant: InputQuant,
    ) -> QuantizedInput:  # [T, I]: one kernel on CUDA, the values of quantizing after
        if not (x.is_cuda and x.dim() == 2):
            return quantize_input(self.forward(x), quant)
        from lightwell.kernels.act_quant_fused import silu_and_mul_quant

        q, scale = silu_and_mul_quant(x, quant.dtype, quant.static_scale)
        return QuantizedInput(q, scale, x.dtype)
