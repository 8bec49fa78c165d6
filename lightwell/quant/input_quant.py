"""A W8A8 linear's input handed over already quantized.

A linear method whose ``apply`` quantizes its input per token (or with one static scale) to
fp8 e4m3 or int8 says so through ``input_quant(layer)`` (``QuantizedInputMethod``); the op that
produces that input (RMSNorm, SiLU-and-mul) then writes the 8-bit values and their scales
itself, in its own kernel, as a ``QuantizedInput``, and the linear's ``apply_quantized`` skips
its own quantization. The values are those of the unfused path (the op's output in the model
dtype, then ``act_quant``) bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class InputQuant:
    """The input a linear takes pre-quantized."""

    dtype: torch.dtype  # torch.float8_e4m3fn or torch.int8
    static_scale: torch.Tensor | None = None  # one element: the per-tensor scale; None: per token


@dataclass(frozen=True)
class QuantizedInput:
    """An activation quantized per token (row) for a W8A8 linear."""

    q: torch.Tensor  # [T, K] int8 / float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32: x ~ q * scale
    dtype: torch.dtype  # the activation's dtype before quantization (the linear's output dtype)


@runtime_checkable
class QuantizedInputMethod(Protocol):
    """A linear method that can take its input pre-quantized."""

    def input_quant(self, layer: nn.Module) -> InputQuant | None:
        """The quantized input ``apply_quantized`` takes for ``layer``, or None: none."""
        ...

    def apply_quantized(
        self,
        layer: nn.Module,
        x: QuantizedInput,  # [T, in]
        bias: torch.Tensor | None,  # [out]
    ) -> torch.Tensor:  # [T, out] in x.dtype
        ...


def quantize_input(
    x: torch.Tensor,  # [T, K]
    quant: InputQuant,
) -> QuantizedInput:
    """The unfused quantization, the very call the linear methods' ``apply`` makes
    (``act_quant`` on CUDA, its torch reference elsewhere)."""
    if quant.dtype == torch.int8:
        from lightwell.quant.int8 import quantize_activations

        q, scale = quantize_activations(x, quant.static_scale)
    else:
        from lightwell.quant.fp8 import quantize_fp8

        static = None if quant.static_scale is None else quant.static_scale.reshape(1, 1)
        q, scale = quantize_fp8(x, static)
    return QuantizedInput(q, scale, x.dtype)
