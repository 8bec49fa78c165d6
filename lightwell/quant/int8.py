"""int8 linears: weight-only per output channel (``--quantization int8``, quantized at load from
a 16/32-bit checkpoint), and W8A8 (int8 weights and per-token dynamic or static per-tensor int8
activations, as compressed-tensors' SmoothQuant/W8A8 checkpoints store them).

Weight-only: ``w = q * scale[n]``, ``q = round(w / scale)``, ``scale = max|w[n, :]| / 127``.
W8A8: ``y = (qx @ qw.T) * sx[t] * sw[n]`` with an exact int32 accumulation: on CUDA one Triton
GEMM with the scales and bias in its epilogue (kernels/int8_gemm.py) when K % 16 == 0, else
``torch._int_mm`` then the scaling in torch (also the CPU path and the reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.quant.base import UnquantizedLinearMethod
from lightwell.quant.utils import replace_params

INT8_MAX = 127.0


def from_config(qc: dict[str, Any]) -> Int8WeightOnlyMethod:
    return Int8WeightOnlyMethod()


def quantize_rows(
    w: torch.Tensor,  # [R, C]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] int8, [R] float32 scales)
    """Symmetric int8 per row: ``scale = max|row| / 127`` (1 for an all-zero row)."""
    amax = w.abs().amax(dim=1).float()
    # a tensor divisor: IEEE division on CUDA too (a python float is a rounded reciprocal)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, INT8_MAX), torch.ones_like(amax))
    q = torch.round(w.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8_weight_only_linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N] in x.dtype
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N]
    if x.device.type == "cpu" and x.dim() == 2:
        out = torch._weight_int8pack_mm(x.contiguous(), weight, scale.to(x.dtype))
    else:
        out = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


class Int8WeightOnlyMethod(UnquantizedLinearMethod):
    """Loads the checkpoint's 16/32-bit ``weight`` [N, K], then keeps it as int8 + [N] scales."""

    checkpoint_tensors = ("weight",)

    def process_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight.data)
        replace_params(layer, {"weight": q, "weight_scale": scale.to(layer.weight.dtype)}, ())

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        return int8_weight_only_linear(x, layer.weight, layer.weight_scale, bias)

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor, bias: Any) -> None:
        return None  # the fused GEMV reads 16-bit weights only


def quantize_activations(
    x: torch.Tensor,  # [T, K]
    static_scale: torch.Tensor | None,  # [] or None: dynamic per-token scales
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] int8, [T, 1] float32)
    """Per-token (or one static scale) int8 quantization: one Triton launch on CUDA, its torch
    reference (kernels/act_quant.py's ``act_quant_ref``, bit-identical) elsewhere."""
    from lightwell.kernels.act_quant import act_quant, act_quant_ref

    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
        return act_quant(x, torch.int8, static_scale)
    return act_quant_ref(x, torch.int8, static_scale)


def int8_w8a8_linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] float32
    input_scale: torch.Tensor | None,  # [] static, or None: dynamic per token
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N]
    qx, sx = quantize_activations(x, input_scale)
    return int8_w8a8_matmul(qx, sx, weight, weight_scale, bias, x.dtype)


def int8_w8a8_matmul(
    qx: torch.Tensor,  # [T, K] int8
    sx: torch.Tensor,  # [T, 1] float32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [T, N]
    if qx.is_cuda and qx.shape[1] % 16 == 0:
        from lightwell.kernels.int8_gemm import int8_gemm

        return int8_gemm(qx, weight, sx, weight_scale, out_dtype, bias)
    if qx.is_cuda and (qx.shape[0] <= 16 or qx.shape[1] % 8 or weight.shape[0] % 8):
        acc = (qx.float() @ weight.float().t()).to(torch.int32)  # _int_mm's CUDA limits
    else:
        acc = torch._int_mm(qx, weight.t())  # [T, N] int32
    out = (acc.float() * sx * weight_scale.float()[None, :]).to(out_dtype)
    return out if bias is None else out + bias
