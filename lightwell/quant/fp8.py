"""FP8 (E4M3) linears: W8A8 with per-channel weight scales (``--quantization fp8``: quantized
at load, activations per token at run time; compressed-tensors' FP8 checkpoints reuse the same
matmul), and HF's fine-grained FP8 checkpoints (``quant_method: fp8``: DeepSeek-V3/R1's format).

W8A8: ``y = (qx @ qw.T) * sx[t] * sw[n]`` through ``torch._scaled_mm`` on CUDA (row-wise scales),
in fp32 on CPU (whose ``_scaled_mm`` is a slow reference).
Fine-grained: ``weight`` [N, K] fp8 with ``weight_scale_inv`` [N / bn, K / bk] float32, one per
``weight_block_size`` = [bn, bk] block (``w = q * scale``); activations are quantized per token
and per group of ``bk`` inputs at run time (``activation_scheme: dynamic``), except on a GPU
for steps of at most ``FP8_BLOCK_GEMV_MAX_ROWS`` rows (decode), which take the weight-only
GEMV (kernels/fp8_block.py's ``fp8_block_gemv``: x in its own dtype).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.quant import utils as quant_utils
from lightwell.quant.base import QuantizedInput, UnquantizedLinearMethod, WeightLoader
from lightwell.quant.utils import add_param, check_divisible, replace_params

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows up to which a fine-grained FP8 linear on a GPU runs the weight-only GEMV instead of
# quantizing the activations for the block-scaled GEMM: faster on every DeepSeek-V3 shape at
# one and two rows, slower on the widest at four (kernels_fp8_block_gemv_h200.json).
FP8_BLOCK_GEMV_MAX_ROWS = 2


def from_config(qc: dict[str, Any]) -> Fp8BlockMethod:
    """HF fine-grained FP8 (``quant_method: fp8`` in config.json)."""
    scheme = qc.get("activation_scheme", "dynamic")
    block = qc.get("weight_block_size")
    if scheme != "dynamic":
        raise ValueError(f"fp8: activation_scheme {scheme!r} is not supported (supported: dynamic)")
    if not (isinstance(block, list | tuple) and len(block) == 2 and min(block) > 0):
        raise ValueError(
            f"fp8: weight_block_size {block!r} is not supported (supported: two positive "
            "integers, e.g. [128, 128])"
        )
    return Fp8BlockMethod(int(block[0]), int(block[1]))


def online(qc: dict[str, Any] | None = None) -> Fp8W8A8Method:
    """``--quantization fp8`` of a 16/32-bit checkpoint."""
    return Fp8W8A8Method()


def quantize_fp8(
    x: torch.Tensor,  # [R, C]
    scale: torch.Tensor | None = None,  # [R, 1] or broadcastable; None: per row, max|x| / 448
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] fp8, [R, 1] float32)
    """Per-row (or one static scale) fp8 quantization: one Triton launch on CUDA (bit-identical
    to the torch code below, the CPU path and the reference)."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and (scale is None or scale.numel() == 1):
        from lightwell.kernels.act_quant import act_quant

        return act_quant(x, FP8, scale)
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        # a tensor divisor: IEEE division on CUDA too (a python float is a rounded reciprocal)
        scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    scale = scale.float().expand(x.shape[0], 1).contiguous()
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_w8a8_linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N] float32
    input_scale: torch.Tensor | None,  # [] static, or None: dynamic per token
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N]
    static = None if input_scale is None else input_scale.reshape(1, 1)
    qx, sx = quantize_fp8(x, static)
    return fp8_w8a8_matmul(qx, sx, weight, weight_scale, bias, x.dtype)


def fp8_w8a8_matmul(
    qx: torch.Tensor,  # [T, K] fp8
    sx: torch.Tensor,  # [T, 1] float32
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [T, N]
    sw = weight_scale.float().reshape(1, -1).contiguous()
    # CUDA's row-wise _scaled_mm wants K, N multiples of 16; CPU's is a slow reference
    if qx.is_cuda and qx.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0:
        out = scaled_mm_rowwise(qx, weight, sx, sw, out_dtype)
    else:
        out = ((qx.float() @ weight.float().t()) * sx * sw).to(out_dtype)
    return out if bias is None else out + bias


def scaled_mm_rowwise(
    qx: torch.Tensor,  # [T, K] fp8
    weight: torch.Tensor,  # [N, K] fp8
    sx: torch.Tensor,  # [T, 1] float32
    sw: torch.Tensor,  # [1, N] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [T, N]
    """``torch._scaled_mm`` with row-wise scales (bf16 out on CUDA, as it requires there)."""
    mm_dtype = torch.bfloat16 if qx.is_cuda else out_dtype
    out = torch._scaled_mm(qx, weight.t(), scale_a=sx, scale_b=sw, out_dtype=mm_dtype)
    return out.to(out_dtype)


class Fp8W8A8Method(UnquantizedLinearMethod):
    """Loads the 16/32-bit ``weight`` [N, K]; keeps fp8 [N, K] + [N] float32 scales."""

    checkpoint_tensors = ("weight",)

    def process_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_fp8(layer.weight.data)
        replace_params(layer, {"weight": q, "weight_scale": scale.reshape(-1)}, ())

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        return fp8_w8a8_linear(x, layer.weight, layer.weight_scale, None, bias)

    def input_quant(self, layer: nn.Module) -> tuple[torch.dtype, None]:
        """fp8 with per-row dynamic scales."""
        return FP8, None

    def apply_quantized(
        self, layer: nn.Module, x: QuantizedInput, bias: torch.Tensor | None
    ) -> torch.Tensor:  # [T, N]
        """``apply`` of rows the norm before quantized (``input_quant``)."""
        return fp8_w8a8_matmul(x.q, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:  # [T, N] on CUDA (activation quantized in one launch), else None
        if not quant_utils.silu_mul_fusable(gate_up):
            return None
        qx, sx = quant_utils.quantize_silu_mul(gate_up, FP8, None)
        return fp8_w8a8_matmul(qx, sx, layer.weight, layer.weight_scale, bias, gate_up.dtype)


def dequantize_blocks(
    weight: torch.Tensor,  # [N, K] fp8
    scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],
) -> torch.Tensor:  # [N, K] float32
    n, k = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * s[:n, :k]


class Fp8BlockMethod:
    """HF fine-grained FP8: ``weight`` fp8 and ``weight_scale_inv`` per [bn, bk] block."""

    def __init__(self, block_n: int, block_k: int, scale_name: str = "weight_scale_inv"):
        self.block, self.scale_name = (block_n, block_k), scale_name
        self.checkpoint_tensors = ("weight", scale_name)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        bn, bk = self.block
        if k != getattr(layer, "input_size", k):  # row-parallel shard: whole blocks only
            check_divisible(k, bk, "input features per rank", "fp8")
            check_divisible(getattr(layer, "input_start", 0), bk, "input shard start", "fp8")
        if len(output_partition_sizes) > 1 or n != getattr(layer, "output_size", n):
            for size in output_partition_sizes:
                check_divisible(size, bn, "output features per shard", "fp8")
        add_param(layer, "weight", (n, k), FP8, weight_loader, 0, 1)
        scale_shape = (-(-n // bn), -(-k // bk))
        factors = {0: bn, 1: bk}
        add_param(layer, self.scale_name, scale_shape, torch.float32, weight_loader, 0, 1, factors)

    def process_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        bk = self.block[1]
        scale = getattr(layer, self.scale_name)
        if x.is_cuda and x.shape[0] <= FP8_BLOCK_GEMV_MAX_ROWS:  # decode: weight-only GEMV
            from lightwell.kernels.fp8_block import fp8_block_gemv

            out = fp8_block_gemv(x, layer.weight, scale, self.block)
            return out if bias is None else out + bias
        from lightwell.kernels.act_quant import fp8_groups

        qx, sx = fp8_groups(x, bk)  # activations as the FP8 GEMM sees them
        if x.is_cuda:
            from lightwell.kernels.fp8_block import fp8_block_matmul

            out = fp8_block_matmul(qx.contiguous(), sx, layer.weight, scale, self.block, x.dtype)
            return out if bias is None else out + bias
        xd = qx.float() * sx.repeat_interleave(bk, dim=1)[:, : x.shape[1]]
        w = dequantize_blocks(layer.weight, scale, self.block)
        return F.linear(xd, w, None if bias is None else bias.float()).to(x.dtype)
