"""Helpers shared by the quantization methods: parameters with loading metadata, int32 bit
packing (the GPTQ / compressed-tensors order: value ``j`` of a word at bits ``[j*b, (j+1)*b)``),
and the checks that turn a layer size that a format cannot shard into a clear error."""

from __future__ import annotations

import torch
from torch import nn

from lightwell.quant.base import WeightLoader, set_weight_attrs


def silu_mul_fusable(gate_up: torch.Tensor) -> bool:
    """Whether a W8A8 method computes and quantizes ``silu(gate) * up`` from ``gate_up`` in one
    Triton launch (``quantize_silu_mul``): a CUDA tensor, 2-D, last dim contiguous. Elsewhere
    the caller runs the activation, then ``apply``."""
    return gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(1) == 1


def norm_quant_fusable(x: torch.Tensor) -> bool:
    """Whether an RMSNorm writes its output quantized for the W8A8 linear after it in one
    Triton launch (kernels/rmsnorm.py's ``rmsnorm_quant``): a CUDA tensor, 2-D, last dim
    contiguous. Elsewhere the norm writes its rows and the linear quantizes them."""
    return x.is_cuda and x.dim() == 2 and x.stride(1) == 1


def quantize_silu_mul(
    gate_up: torch.Tensor,  # [T, 2K] a gated MLP's [gate | up]
    dtype: torch.dtype,  # torch.int8 or torch.float8_e4m3fn
    input_scale: torch.Tensor | None,  # [] static, or None: dynamic per token
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] dtype, [T, 1] float32)
    """``silu_and_mul(gate_up)`` quantized per token as the W8A8 linears quantize their input,
    the same bits, in one launch (kernels/act_quant.py): the 16-bit activation is never
    written. For the down projection's ``apply_silu_mul``."""
    from lightwell.kernels.act_quant import act_quant

    return act_quant(gate_up, dtype, input_scale, silu_mul=True)


def add_param(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    weight_loader: WeightLoader,
    output_dim: int | None = None,
    input_dim: int | None = None,
    pack_factors: dict[int, int] | None = None,
    shard_indexed: bool = False,
) -> nn.Parameter:
    """Register an empty parameter with the attributes the layers' weight loaders read."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    attrs: dict = {"output_dim": output_dim, "input_dim": input_dim, "weight_loader": weight_loader}
    if pack_factors:
        attrs["pack_factors"] = dict(pack_factors)
    if shard_indexed:
        attrs["shard_indexed"] = True
    set_weight_attrs(param, attrs)
    layer.register_parameter(name, param)
    return param


def replace_params(layer: nn.Module, new: dict[str, torch.Tensor], drop: tuple[str, ...]) -> None:
    """Swap a layer's checkpoint-shaped parameters for the ones its ``apply`` reads."""
    for name in drop:
        if name in layer._parameters:
            del layer._parameters[name]
    for name, tensor in new.items():
        if name in layer._parameters:
            del layer._parameters[name]
        layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit integers [.., n, ..] -> int32 words [.., n * bits / 32, ..] along
    ``dim`` (value ``j`` of each run of ``32 / bits`` at bits ``[j*bits, (j+1)*bits)``)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)  # [.., n]
    if v.shape[-1] % per:
        raise ValueError(f"cannot pack {v.shape[-1]} values {per} to an int32")
    v = v.reshape(*v.shape[:-1], -1, per)
    shifts = torch.arange(per, device=v.device) * bits
    words = (v << shifts).sum(-1)  # [.., n / per] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of ``pack_int32``: int32 words -> unsigned values (int32) along ``dim``."""
    per = 32 // bits
    w = words.movedim(dim, -1).unsqueeze(-1)  # [.., m, 1]
    shifts = torch.arange(per, device=w.device, dtype=torch.int32) * bits
    v = (w >> shifts) & ((1 << bits) - 1)  # [.., m, per]
    return v.reshape(*v.shape[:-2], -1).movedim(-1, dim)


def check_divisible(size: int, factor: int, what: str, method: str) -> None:
    if factor > 0 and size % factor:
        raise ValueError(
            f"{method}: {what} ({size}) is not a multiple of {factor}: this layer's shard cannot "
            "be loaded (try another tensor-parallel size)"
        )


def input_sharded(layer: nn.Module, input_size_per_partition: int) -> bool:
    """Whether this rank holds a slice of the layer's inputs (a row-parallel layer at TP > 1)."""
    return input_size_per_partition != getattr(layer, "input_size", input_size_per_partition)


def per_channel(
    values: torch.Tensor,  # [S]: one value per fused shard
    partition_sizes: list[int],
) -> torch.Tensor:  # [N]: each shard's value repeated over its output channels
    sizes = torch.tensor(partition_sizes, device=values.device)
    return values.repeat_interleave(sizes)
