"""Quantization strategy protocol for linear layers, and the unquantized default.

A linear layer owns a ``QuantMethod``: the method creates the layer's parameters (their
shapes, dtypes and loading attributes), post-processes them once the checkpoint is loaded
(repacking, transposing for a kernel ...), and runs the matmul. Layers never branch on the
quantization type.

Parameter attributes the layers' weight loaders read (set with ``set_weight_attrs``):
  ``output_dim``: the dimension that holds output features (sharded by column-parallel layers),
  ``input_dim``: the dimension that holds input features (sharded by row-parallel layers),
  ``packed_dim`` / ``pack_factor``: a dimension stored packed (``pack_factor`` logical values per
  stored element); weight loaders divide logical offsets along it by ``pack_factor``,
  ``pack_factors``: the same for several dimensions at once (``{dim: factor}``: a GPTQ ``qzeros``
  is packed 8 to an int32 along the outputs and holds one row per group of inputs),
  ``shard_indexed``: a 1-D parameter with one entry per fused shard (a per-tensor scale of each of
  q, k and v); a fused layer's loader writes shard ``i``'s checkpoint scalar at index ``i``,
  ``weight_loader``: the layer's ``weight_loader(param, loaded_weight, shard_id=None)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

WeightLoader = Callable[..., None]


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading metadata to a parameter (never overwriting an existing attribute)."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


class QuantizedInput(NamedTuple):
    """A linear's input already quantized per row as its method would (``input_quant``), by
    the kernel before it (kernels/rmsnorm.py's ``rmsnorm_quant``): the linear runs
    ``apply_quantized`` on it."""

    q: torch.Tensor  # [T, K] int8 or fp8
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the 16/32-bit dtype of the rows it replaces (the output's dtype)


def input_quant(method: Any, layer: nn.Module) -> tuple[torch.dtype, torch.Tensor | None] | None:
    """What a W8A8 method quantizes ``layer``'s input to, (int8 or fp8, the static scale or
    None for per-row dynamic scales), where it takes a ``QuantizedInput``; None otherwise."""
    spec = getattr(method, "input_quant", None)
    return spec(layer) if spec is not None else None


@runtime_checkable
class QuantMethod(Protocol):
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register this rank's parameters on ``layer`` (``layer.weight`` at least).

        ``output_partition_sizes`` lists the output features of each packed shard on this rank
        (one entry for a plain linear; [q, k, v] or [gate, up] for fused layers).
        """
        ...

    def process_after_loading(self, layer: nn.Module) -> None:
        """Called once after every weight is loaded (repack for a kernel, drop scratch ...)."""
        ...

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, in_per_partition]
        bias: torch.Tensor | None,  # [out_per_partition]
    ) -> torch.Tensor:  # [T, out_per_partition]
        ...

    # W8A8 methods also have ``input_quant(layer)`` (the dtype and static scale they quantize
    # the input to, or None) and ``apply_quantized(layer, x: QuantizedInput, bias)``, so the
    # norm before a column-parallel linear can write its input quantized.


class UnquantizedLinearMethod:
    """Plain ``weight [out, in]`` in the model dtype; ``F.linear``."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        out = sum(output_partition_sizes)
        weight = nn.Parameter(
            torch.empty(out, input_size_per_partition, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def process_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, in]
        bias: torch.Tensor | None,  # [out]
    ) -> torch.Tensor:  # [T, out]
        return dense_linear(x, layer.weight, bias)

    def apply_silu_mul(
        self,
        layer: nn.Module,
        gate_up: torch.Tensor,  # [T, 2 * in]: a gated MLP's [gate | up]
        bias: torch.Tensor | None,  # [out]
    ) -> torch.Tensor | None:  # [T, out], or None: not fused for this input
        """``(silu(gate) * up) @ W.T`` in one kernel where ``dense_linear`` would take the
        skinny GEMM (batch-1 decode on the GPU); None elsewhere (the caller runs the activation
        and ``apply``)."""
        if not _skinny(gate_up, layer.weight):
            return None
        from lightwell.kernels.gemv import gemv

        return gemv(gate_up, layer.weight, bias, silu_mul=True)


def is_unquantized(method: Any) -> bool:
    """Whether a layer with linear method ``method`` keeps plain model-dtype weights (None or
    ``UnquantizedLinearMethod`` itself; its subclasses quantize online)."""
    return method is None or type(method) is UnquantizedLinearMethod


# A CUDA bf16/fp16 matmul of at most SKINNY_GEMM_MAX_ROWS rows (batch-1 decode) runs on
# kernels/gemv.py instead of cuBLAS: faster than cuBLAS at one row on every llama-3-8b shape
# (TP=1 and TP=2, the LM head included); even or slower at 2 rows and much slower at 4.
SKINNY_GEMM_MAX_ROWS = 1


def dense_linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [T, out]
    if _skinny(x, weight):
        from lightwell.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= SKINNY_GEMM_MAX_ROWS
        and x.is_cuda
        and x.dtype != torch.float32
        and weight.dtype == x.dtype  # plain 16-bit weights (a quantized layer's are not)
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )
