"""Quantization strategies of the stacked MoE experts (``lightwell/layers/moe.py``'s
``FusedMoE``): what each expert weight is stored as, how HF's per-expert checkpoint tensors load
into it, and how the experts run.

A method registers, per projection (``w13``: gate rows then up rows; ``w2``: down), stacked
parameters ``{w13,w2}_{tensor}`` [E_local, ...], one per checkpoint tensor of a linear, each with
``inter_dim`` / ``inter_factor``: the dimension of the checkpoint tensor (without the expert
dimension) that holds the intermediate features and how many features one stored index covers
(1 for a weight row, the block size for a block scale, 8 for a packed int32 word, the group size
for a group scale); ``None``: not sliced (kept whole on every rank). ``FusedMoE.weight_loader``
slices the rank's intermediate features through these and places gate and up side by side.

- ``UnquantizedExperts``: ``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I] in the model dtype.
- ``Fp8BlockExperts`` (HF fine-grained FP8, DeepSeek-V3/R1): ``w13_weight`` fp8 [E, 2I, H] with
  ``w13_weight_scale_inv`` [E, 2I / bn, ceil(H / bk)] float32, ``w2_weight`` fp8 [E, H, I] with
  ``w2_weight_scale_inv`` [E, ceil(H / bn), I / bk]; the intermediate size per rank must be whole
  blocks. Weight-only: activations stay in the model dtype, each [bn, bk] block is dequantized
  (``q * scale``) where it is used: per used expert in the CPU loop, per K chunk in the kernels.
  compressed-tensors' block strategy is the same layout with ``weight_scale`` for the scales.
- ``ScaledExperts`` (compressed-tensors int8 / fp8 with channel or tensor scales): one scale
  per output row after loading; weight-only like the block FP8 experts (see the class).
- Running them: each strategy gives ``kernel_inputs`` (``fused_moe``'s weights and keyword
  arguments: the block scales for FP8) and ``expert_weights`` (expert e's weights in x's dtype,
  dequantized when asked); their shared ``StackedExperts.apply`` runs ``fused_moe`` on CUDA,
  ``moe_loop_by`` elsewhere, which asks only for the experts with tokens (one at a time).
W4A16 formats (GPTQ, AWQ) are in ``quant/experts_wna16.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightwell.quant.base import set_weight_attrs

ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # e -> ([2I, H], [H, I])


def add_expert_param(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...],  # without the expert dimension
    dtype: torch.dtype,
    inter_dim: int | None,
    inter_factor: int = 1,
) -> nn.Parameter:
    param = nn.Parameter(torch.empty(layer.num_stacked, *shape, dtype=dtype), False)
    attrs = {"inter_dim": inter_dim, "inter_factor": inter_factor}
    set_weight_attrs(param, {**attrs, "weight_loader": layer.weight_loader})
    layer.register_parameter(name, param)
    return param


class StackedExperts:
    """Every experts strategy's ``apply``, over the strategy's ``kernel_inputs(layer)`` (CUDA)
    or ``expert_weights(layer, x)`` (elsewhere), which each subclass gives."""

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k]
        ids: torch.Tensor,  # [T, k] local expert ids
        **options: Any,  # fused_moe's options (CUDA), num_shared, add
    ) -> torch.Tensor:  # [T, H]
        """``fused_moe`` on the format's kernel inputs on CUDA, elsewhere ``moe_loop_by`` over
        its per-expert weights (a quantized expert dequantized when it has tokens, one at a
        time). ``options``: fused_moe's tile options; ``num_shared``: the stack's shared
        experts; ``add``: [T, H] added to the output."""
        w13, w2, quant = self.kernel_inputs(layer)
        if x.is_cuda:
            from lightwell.kernels.fused_moe import fused_moe

            return fused_moe(x, w13, w2, weights, ids, **quant, **options)
        from lightwell.layers.moe import moe_loop_by  # layers.moe imports this module

        shared, add = options.get("num_shared", 0), options.get("add")
        out = moe_loop_by(x, self.expert_weights(layer, x), w13.shape[0], weights, ids, shared)
        return out if add is None else out + add


class UnquantizedExperts(StackedExperts):
    """Experts in the model dtype (``w13_weight``, ``w2_weight``)."""

    checkpoint_tensors = ("weight",)

    def create_weights(self, layer: nn.Module, hidden: int, inter: int, dtype: torch.dtype) -> None:
        add_expert_param(layer, "w13_weight", (2 * inter, hidden), dtype, 0)
        add_expert_param(layer, "w2_weight", (hidden, inter), dtype, 1)

    def process_after_loading(self, layer: nn.Module) -> None:
        return None

    def kernel_inputs(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(w13, w2, fused_moe's keyword arguments) of the fused kernels."""
        return layer.w13_weight, layer.w2_weight, {}

    def expert_weights(self, layer: nn.Module, x: torch.Tensor) -> ExpertWeights:
        w13, w2 = layer.w13_weight, layer.w2_weight
        return lambda e: (w13[e], w2[e])


class Fp8BlockExperts(UnquantizedExperts):
    """Block-scaled FP8 experts: fp8 weights and one float32 scale per [bn, bk] block (HF
    fine-grained FP8 names it ``weight_scale_inv``; compressed-tensors' block strategy
    ``weight_scale``: the checkpoint's name is kept). On a GPU the grouped path runs W8A8
    (activations in fp8 per token and bk inputs, as the model's block-FP8 linears; fp8 dots
    need bk >= 32, else weight-only), the few-token GEMV path weight-only; on the CPU
    weight-only."""

    def __init__(self, block_n: int, block_k: int, scale_name: str = "weight_scale_inv"):
        self.block = (block_n, block_k)
        self.checkpoint_tensors = ("weight", scale_name)
        self.scale = scale_name

    def create_weights(self, layer: nn.Module, hidden: int, inter: int, dtype: torch.dtype) -> None:
        bn, bk = self.block
        if inter % bn or inter % bk:
            raise ValueError(
                f"fp8: the expert intermediate size per rank ({inter}) is not a multiple of the "
                f"weight block {list(self.block)}: its block scales cannot be sliced or stacked "
                "(try another tensor-parallel size, or expert parallelism)"
            )
        fp8, f32 = torch.float8_e4m3fn, torch.float32
        add_expert_param(layer, "w13_weight", (2 * inter, hidden), fp8, 0)
        add_expert_param(layer, f"w13_{self.scale}", (2 * inter // bn, -(-hidden // bk)), f32,
                         0, bn)  # fmt: skip
        add_expert_param(layer, "w2_weight", (hidden, inter), fp8, 1)
        add_expert_param(layer, f"w2_{self.scale}", (-(-hidden // bn), inter // bk), f32, 1, bk)

    def scales(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(layer, f"w13_{self.scale}"), getattr(layer, f"w2_{self.scale}")

    def kernel_inputs(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(w13, w2, fused_moe's keyword arguments) of the fused kernels."""
        s13, s2 = self.scales(layer)
        quant = {"scales": (s13, s2, self.block), "w8a8": self.block[1] >= 32}
        return layer.w13_weight, layer.w2_weight, quant

    def expert_weights(self, layer: nn.Module, x: torch.Tensor) -> ExpertWeights:
        """Expert e's weights dequantized (``q * scale`` per block) to x's dtype."""
        from lightwell.quant.fp8 import dequantize_blocks

        w13, w2 = layer.w13_weight, layer.w2_weight
        s13, s2 = self.scales(layer)

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            gate_up = dequantize_blocks(w13[e], s13[e], self.block).to(x.dtype)  # [2I, H]
            return gate_up, dequantize_blocks(w2[e], s2[e], self.block).to(x.dtype)  # [H, I]

        return expert


def kernels_take(inter: int) -> bool:
    """The fp8 expert kernels take row-scaled experts of this intermediate size per rank."""
    return inter % 16 == 0


class ScaledExperts(UnquantizedExperts):
    """compressed-tensors 8-bit experts (int-quantized int8, float-quantized fp8) with channel
    or tensor scales: ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] in int8 / fp8,
    ``weight_scale`` per output row ([E, 2I, 1], [E, H, 1]) or per tensor ([E, 2]: gate's and
    up's, [E, 1]); a static ``input_scale`` is read and dropped. After loading the scales
    become one per output row (``w13_row_scale`` [E, 2I], ``w2_row_scale`` [E, H]). fp8
    experts on a GPU (I per rank a multiple of 16) take the fused kernels with them as
    ``fused_moe.ROW`` blocks: the few-token GEMV path runs weight-only; the grouped path (more
    tokens) runs W8A8: x and the activation before down quantized to fp8 per token (dynamic,
    whatever the checkpoint's activation scheme), fp8 dots. int8 experts on a GPU are
    dequantized to the model dtype at load (no int8 expert kernel). On the CPU the experts run
    weight-only, each expert with tokens dequantized when used."""

    def __init__(self, dtype: torch.dtype, strategy: str, activations: str):
        self.dtype, self.strategy, self.activations = dtype, strategy, activations
        extra = ("input_scale",) if activations == "static" else ()
        self.checkpoint_tensors = ("weight", "weight_scale", *extra)

    def create_weights(self, layer: nn.Module, hidden: int, inter: int, dtype: torch.dtype) -> None:
        f32, full = torch.float32, layer.full_inter
        add_expert_param(layer, "w13_weight", (2 * inter, hidden), self.dtype, 0)
        add_expert_param(layer, "w2_weight", (hidden, inter), self.dtype, 1)
        if self.strategy == "channel":
            add_expert_param(layer, "w13_weight_scale", (2 * inter, 1), f32, 0)
            add_expert_param(layer, "w2_weight_scale", (hidden, 1), f32, None)
        else:  # one value per checkpoint tensor: an index covering all intermediate features
            add_expert_param(layer, "w13_weight_scale", (2,), f32, 0, full)
            add_expert_param(layer, "w2_weight_scale", (1,), f32, 0, full)
        if self.activations == "static":
            add_expert_param(layer, "w13_input_scale", (2,), f32, 0, full)
            add_expert_param(layer, "w2_input_scale", (1,), f32, 0, full)

    def process_after_loading(self, layer: nn.Module) -> None:
        s13, s2 = layer.w13_weight_scale.data, layer.w2_weight_scale.data
        num, two_inter, hidden = layer.w13_weight.shape
        if self.strategy == "channel":
            s13, s2 = s13[..., 0], s2[..., 0]  # [E, 2I], [E, H]
        else:
            s13 = s13.repeat_interleave(two_inter // 2, dim=1)  # gate's, then up's
            s2 = s2.expand(num, hidden)
        for name in ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        self.row_scaled(layer, s13, s2)

    def row_scaled(self, layer: nn.Module, s13: torch.Tensor, s2: torch.Tensor) -> None:
        """Finish loading 8-bit ``w13_weight`` / ``w2_weight`` with one scale per output row
        (``s13`` [E, 2I], ``s2`` [E, H]): the row scales kept (int8 on a GPU: dequantized)."""
        two_inter = layer.w13_weight.shape[1]
        gpu = layer.w13_weight.is_cuda
        if gpu and self.dtype == torch.int8:  # no int8 expert kernel: the model dtype
            act = layer.act_dtype
            for name, scale in (("w13_weight", s13), ("w2_weight", s2)):
                deq = (getattr(layer, name).data.float() * scale[..., None].float()).to(act)
                setattr(layer, name, nn.Parameter(deq, requires_grad=False))
            return
        layer.w13_row_scale = nn.Parameter(s13.float().contiguous(), requires_grad=False)
        layer.w2_row_scale = nn.Parameter(s2.float().contiguous(), requires_grad=False)
        if gpu and not kernels_take(two_inter // 2):
            raise ValueError(
                f"fp8 experts with {self.strategy} scales: the GPU kernels need the expert "
                f"intermediate size per rank ({two_inter // 2}) to be a multiple of 16"
            )

    def in_model_dtype(self, layer: nn.Module) -> bool:
        """The experts were left in (or dequantized to) the model dtype at load."""
        return layer.w13_weight.dtype != self.dtype

    def kernel_inputs(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(w13, w2, fused_moe's keyword arguments) of the fused kernels (off a GPU the
        weights alone: ``apply`` reads their shape)."""
        if self.in_model_dtype(layer) or not layer.w13_weight.is_cuda:
            return layer.w13_weight, layer.w2_weight, {}
        from lightwell.kernels.fused_moe import ROW

        scales = (layer.w13_row_scale[..., None], layer.w2_row_scale[..., None], ROW)
        return layer.w13_weight, layer.w2_weight, {"scales": scales, "w8a8": True}

    def expert_weights(self, layer: nn.Module, x: torch.Tensor) -> ExpertWeights:
        """Expert e's weights dequantized (``q * row scale``) to x's dtype."""
        w13, w2 = layer.w13_weight, layer.w2_weight
        if self.in_model_dtype(layer):
            return lambda e: (w13[e], w2[e])
        s13, s2 = layer.w13_row_scale, layer.w2_row_scale

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            gate_up = (w13[e].float() * s13[e][:, None]).to(x.dtype)  # [2I, H]
            return gate_up, (w2[e].float() * s2[e][:, None]).to(x.dtype)  # [H, I]

        return expert


class OnlineScaledExperts(ScaledExperts):
    """``--quantization fp8 / int8`` of a 16/32-bit checkpoint: its experts load in the model
    dtype, then each expert is quantized per output row (the dense linears' rules:
    ``quantize_fp8``, ``quantize_rows``) and runs as ``ScaledExperts``. On a GPU, int8 experts,
    and fp8 ones whose intermediate size per rank is not a multiple of 16, stay in the model
    dtype instead (no kernel takes them: rounding them would cost accuracy and save nothing)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__(dtype, "channel", "none")
        self.checkpoint_tensors = ("weight",)

    def create_weights(self, layer: nn.Module, hidden: int, inter: int, dtype: torch.dtype) -> None:
        UnquantizedExperts.create_weights(self, layer, hidden, inter, dtype)

    def process_after_loading(self, layer: nn.Module) -> None:
        from lightwell.quant.fp8 import quantize_fp8
        from lightwell.quant.int8 import quantize_rows

        inter = layer.w13_weight.shape[1] // 2
        if layer.w13_weight.is_cuda and (self.dtype == torch.int8 or not kernels_take(inter)):
            return  # no kernel takes them: left in the model dtype
        rows = {}
        for name in ("w13_weight", "w2_weight"):
            w = getattr(layer, name).data
            q = torch.empty(w.shape, dtype=self.dtype, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):  # an expert at a time: no float copy of the stack
                if self.dtype == torch.int8:
                    q[e], scale[e] = quantize_rows(w[e])
                else:
                    q[e], row = quantize_fp8(w[e].contiguous())
                    scale[e] = row[:, 0]
            rows[name] = scale
            setattr(layer, name, nn.Parameter(q, requires_grad=False))
        self.row_scaled(layer, rows["w13_weight"], rows["w2_weight"])


# linear methods whose experts stay in the model dtype: a GGUF file's linears (its experts arrive
# dequantized)
FLOAT_EXPERTS = ("UnquantizedLinearMethod", "GGUFLinearMethod")
# online quantization (--quantization fp8 / int8): the experts quantized per row after loading
ONLINE_EXPERTS = {"Fp8W8A8Method": torch.float8_e4m3fn, "Int8WeightOnlyMethod": torch.int8}


def experts_method(linear_method: Any) -> Any:
    """The experts' strategy for a model whose linears use ``linear_method`` (None:
    unquantized); a one-line refusal naming the method when its experts are not supported."""
    name = type(linear_method).__name__
    if linear_method is None or name in FLOAT_EXPERTS:
        return UnquantizedExperts()
    if name in ONLINE_EXPERTS:
        return OnlineScaledExperts(ONLINE_EXPERTS[name])
    if name == "Fp8BlockMethod":
        return Fp8BlockExperts(*linear_method.block, linear_method.scale_name)
    if name == "ScaledMethod":  # compressed-tensors int8 / fp8, channel or tensor scales
        m = linear_method
        return ScaledExperts(m.dtype, m.strategy, m.activations)
    if name in ("GPTQMethod", "AWQMethod", "PackedMethod"):
        from lightwell.quant.experts_wna16 import wna16_experts

        return wna16_experts(linear_method)
    raise ValueError(
        f"quantized expert weights: {name} is not supported for MoE experts (supported: "
        "unquantized, HF fine-grained fp8, gptq, awq, compressed-tensors pack-quantized, "
        "int-quantized and float-quantized)"
    )
