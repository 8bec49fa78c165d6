"""compressed-tensors checkpoints as llm-compressor writes them (``quant_method:
compressed-tensors``, ``quantization_status: compressed``), one scheme for every linear but
the ignored LM head:

- ``pack-quantized`` int 4/8-bit weights (W4A16, W8A16): ``weight_packed`` [N, K / P] int32
  packed along the inputs (values offset by 2^(bits-1) to unsigned), ``weight_scale`` [N, G]
  (group) or [N, 1] (channel), ``weight_shape`` [2], ``weight_zero_point`` [N / P, G] packed
  along the outputs when asymmetric, ``weight_g_idx`` [K] under group act-order;
- ``int-quantized`` int8 W8A8 (SmoothQuant / W8A8 recipes): ``weight`` [N, K] int8,
  ``weight_scale`` [N, 1] (channel) or [1] (tensor), activations per token (dynamic) or per
  tensor (static ``input_scale`` [1]); with no activation scheme, int8 weight-only;
- ``float-quantized`` FP8 W8A8: ``weight`` [N, K] fp8 with the same scales and activations
  (block strategy: ``weight_scale`` [N / bn, K / bk], activations per token-group).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lightwell.quant import utils as quant_utils
from lightwell.quant.base import QuantizedInput, WeightLoader
from lightwell.quant.fp8 import FP8, Fp8BlockMethod, fp8_w8a8_linear, fp8_w8a8_matmul
from lightwell.quant.int8 import int8_w8a8_linear, int8_w8a8_matmul, int8_weight_only_linear
from lightwell.quant.utils import (
    add_param,
    check_divisible,
    input_sharded,
    per_channel,
    replace_params,
    unpack_int32,
)
from lightwell.quant.wna16 import WNA16Method, finalize, group_index

NAME = "compressed-tensors"
SUPPORTED = (
    "pack-quantized int 4/8-bit weights (group or channel, sym or asym, group act-order); "
    "int-quantized int8 weights (channel or tensor) with dynamic per-token or static per-tensor "
    "int8 activations, or none; float-quantized fp8 weights (channel, tensor or block) with "
    "fp8 activations"
)


def _refuse(why: str) -> ValueError:
    return ValueError(f"{NAME}: {why}; supported: {SUPPORTED}")


# An ignore entry naming MoE routers only (llm-compressor's MoE recipes leave them unquantized:
# "re:.*block_sparse_moe.gate", "re:.*mlp.gate$", "re:.*shared_expert_gate$"): a name or pattern
# ending in a module called ``gate`` or ``shared_expert_gate``. Routers load unquantized anyway.
_ROUTER = re.compile(r"(^|[.*])(shared_expert_)?gate\$?$")


def _router(entry: str) -> bool:
    return bool(_ROUTER.search(entry.removeprefix("re:")))


def _scheme(qc: dict[str, Any]) -> tuple[str, dict, dict | None]:
    """(format, weight args, input activation args) of the one scheme the config uses."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status {status!r} (only compressed checkpoints load)")
    if qc.get("kv_cache_scheme"):
        raise _refuse("a kv_cache_scheme (use --kv-cache-dtype instead)")
    if (qc.get("sparsity_config") or {}).get("format") not in (None, "dense"):
        raise _refuse("a sparsity_config")
    ignore = [i for i in qc.get("ignore") or [] if "lm_head" not in i and not _router(i)]
    if ignore:
        raise _refuse(
            f"ignore names layers other than lm_head and MoE routers ({', '.join(ignore[:4])})"
        )
    schemes = {
        repr((g.get("format") or qc.get("format"), g.get("weights"), g.get("input_activations")))
        for g in (qc.get("config_groups") or {}).values()
    }
    if len(schemes) != 1:
        raise _refuse(f"{len(schemes)} different schemes in config_groups (one is supported)")
    group = next(iter(qc["config_groups"].values()))
    fmt = group.get("format") or qc.get("format")
    if group.get("weights") is None:
        raise _refuse("a scheme without weight quantization")
    return fmt, group["weights"], group.get("input_activations")


def from_config(qc: dict[str, Any]) -> Any:
    fmt, w, a = _scheme(qc)
    wtype, bits = w.get("type", "int"), int(w.get("num_bits", 8))
    strategy, symmetric = w.get("strategy"), w.get("symmetric", True)
    if fmt == "pack-quantized" and wtype == "int" and bits in (4, 8) and a is None:
        if strategy not in ("group", "channel"):
            raise _refuse(f"pack-quantized with strategy {strategy!r}")
        group = int(w.get("group_size") or -1) if strategy == "group" else -1
        return PackedMethod(bits, group, symmetric, w.get("actorder") == "group")
    if not symmetric:
        raise _refuse(f"asymmetric {fmt} weights")
    if fmt in ("int-quantized", "naive-quantized") and wtype == "int" and bits == 8:
        if strategy not in ("channel", "tensor"):
            raise _refuse(f"int8 weights with strategy {strategy!r}")
        return ScaledMethod(torch.int8, strategy, _activations(a, "int"))
    if fmt == "float-quantized" and wtype == "float" and bits == 8:
        if strategy == "block":
            bn, bk = w.get("block_structure") or (128, 128)
            if a is not None and not a.get("dynamic"):
                raise _refuse("block fp8 weights with static activations")
            return Fp8BlockMethod(int(bn), int(bk), scale_name="weight_scale")
        if strategy not in ("channel", "tensor"):
            raise _refuse(f"fp8 weights with strategy {strategy!r}")
        return ScaledMethod(FP8, strategy, _activations(a, "float"))
    raise _refuse(f"format {fmt!r} with {bits}-bit {wtype} weights, activations {a!r}")


def _activations(a: dict | None, wtype: str) -> str:
    """'none', 'dynamic' (per token) or 'static' (per tensor)."""
    if a is None:
        if wtype == "float":
            raise _refuse("fp8 weights without activation quantization")
        return "none"
    if a.get("type", "int") != wtype or int(a.get("num_bits", 8)) != 8:
        raise _refuse(f"activations {a!r} with {wtype} 8-bit weights")
    if not a.get("symmetric", True):
        raise _refuse("asymmetric activations")
    if a.get("dynamic") and a.get("strategy") in ("token", "tensor"):
        return "dynamic"
    if not a.get("dynamic") and a.get("strategy") == "tensor":
        return "static"
    raise _refuse(f"activations with strategy {a.get('strategy')!r}, dynamic {a.get('dynamic')}")


class PackedMethod(WNA16Method):
    """pack-quantized weights, converted to the canonical weight-only layout after loading."""

    checkpoint_tensors = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, bits: int, group_size: int, symmetric: bool, act_order: bool):
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.act_order, self.pack = act_order, 32 // bits

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        k, n, p = input_size_per_partition, sum(output_partition_sizes), self.pack
        gs = self.group_size if self.group_size > 0 else k
        check_divisible(k, p, "input features per rank", NAME)
        full = self.group_size < 0 or (self.act_order and input_sharded(layer, k))
        if not full:
            check_divisible(k, gs, "input features per rank", NAME)
            check_divisible(getattr(layer, "input_start", 0), gs, "input shard start", NAME)
        groups = 1 if self.group_size < 0 else -(-getattr(layer, "input_size", k) // gs)
        groups, gdim = (groups, None) if full else (-(-k // gs), 1)
        add_param(layer, "weight_packed", (n, k // p), torch.int32, weight_loader, 0, 1, {1: p})
        add_param(layer, "weight_scale", (n, groups), params_dtype, weight_loader, 0, gdim, {1: gs})
        add_param(layer, "weight_shape", (2,), torch.int64, weight_loader)
        if not self.symmetric:
            for size in output_partition_sizes:
                check_divisible(size, p, "output features per shard", NAME)
            zshape, zf = (n // p, groups), {0: p, 1: gs}
            add_param(layer, "weight_zero_point", zshape, torch.int32, weight_loader, 0, gdim, zf)
        if self.act_order:
            add_param(layer, "weight_g_idx", (k,), torch.int32, weight_loader, None, 0)

    def process_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.weight_packed.data, self.bits, dim=1).t()  # [K, N]
        scales = layer.weight_scale.data.t()  # [G, N]
        if self.symmetric:
            zeros = torch.full_like(scales, 1 << (self.bits - 1))
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, self.bits, dim=0).t()  # [G, N]
        if self.act_order:
            g_idx = layer.weight_g_idx.data
        else:
            g_idx = group_index(q.shape[0], self.group_size, q.device)
        drop = (
            "weight_packed",
            "weight_scale",
            "weight_shape",
            "weight_zero_point",
            "weight_g_idx",
        )
        k = q.shape[0]
        gs = self.group_size if self.group_size > 0 else k
        finalize(layer, q, scales, zeros, g_idx, self.bits, drop, gs, self.act_order)


class ScaledMethod:
    """8-bit weights with channel or tensor scales; activations int8/fp8 per token (dynamic),
    per tensor (static), or not quantized (int8 weight-only)."""

    checkpoint_tensors = ("weight", "weight_scale")

    def __init__(self, dtype: torch.dtype, strategy: str, activations: str):
        self.dtype, self.strategy, self.activations = dtype, strategy, activations

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        k, n, shards = input_size_per_partition, sum(output_partition_sizes), None
        layer.quant_partition_sizes = list(output_partition_sizes)
        add_param(layer, "weight", (n, k), self.dtype, weight_loader, 0, 1)
        f32 = torch.float32
        if self.strategy == "channel":
            add_param(layer, "weight_scale", (n, 1), f32, weight_loader, 0)
        else:
            shards = len(output_partition_sizes)
            add_param(layer, "weight_scale", (shards,), f32, weight_loader, shard_indexed=True)
        if self.activations == "static":
            shards = len(output_partition_sizes)
            add_param(layer, "input_scale", (shards,), f32, weight_loader, shard_indexed=True)

    def process_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data.reshape(-1)
        if self.strategy == "tensor":
            scale = per_channel(scale, layer.quant_partition_sizes)
        new = {"weight_scale": scale.float()}
        if self.activations == "static":  # one input, one scale: the largest of the shards'
            new["input_scale"] = layer.input_scale.data.amax()
        replace_params(layer, new, ())

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        static = layer.input_scale if self.activations == "static" else None
        if self.dtype == FP8:
            return fp8_w8a8_linear(x, layer.weight, layer.weight_scale, static, bias)
        if self.activations == "none":
            return int8_weight_only_linear(x, layer.weight, layer.weight_scale, bias)
        return int8_w8a8_linear(x, layer.weight, layer.weight_scale, static, bias)

    def input_quant(self, layer: nn.Module) -> tuple[torch.dtype, torch.Tensor | None] | None:
        """W8A8: (int8 or fp8, the static input scale or None); weight-only: None."""
        if self.dtype != FP8 and self.activations == "none":
            return None
        return self.dtype, layer.input_scale if self.activations == "static" else None

    def apply_quantized(
        self, layer: nn.Module, x: QuantizedInput, bias: torch.Tensor | None
    ) -> torch.Tensor:  # [T, N]
        """``apply`` of rows the norm before quantized as ``input_quant`` says."""
        matmul = fp8_w8a8_matmul if self.dtype == FP8 else int8_w8a8_matmul
        return matmul(x.q, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:  # [T, N]; None: the caller runs the activation, then ``apply``
        """W8A8 on CUDA: the activation computed and quantized in one launch, the same bits as
        the activation kernel then ``apply``; weight-only and CPU: None."""
        if not quant_utils.silu_mul_fusable(gate_up):
            return None
        if self.dtype != FP8 and self.activations == "none":
            return None  # int8 weight-only
        static = layer.input_scale if self.activations == "static" else None
        qx, sx = quant_utils.quantize_silu_mul(gate_up, self.dtype, static)
        matmul = fp8_w8a8_matmul if self.dtype == FP8 else int8_w8a8_matmul
        return matmul(qx, sx, layer.weight, layer.weight_scale, bias, gate_up.dtype)
