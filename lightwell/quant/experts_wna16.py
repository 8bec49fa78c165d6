"""4-bit weight-only MoE experts: GPTQ (AutoGPTQ layout, symmetric or not, contiguous groups or
one group), AWQ (AutoAWQ GEMM layout) and compressed-tensors pack-quantized per-expert tensors,
converted after loading to the stacked K-contiguous layout of ``lightwell/quant/wna16.py``:

  ``w13_qweight`` [E, 2I, H / 8] int32, ``w13_scales`` / ``w13_zeros`` [E, 2I, ceil(H / g)],
  ``w2_qweight`` [E, H, I / 8] int32, ``w2_scales`` / ``w2_zeros`` [E, H, I / g]
  (``w = (q - zero) * scale``, input ``k`` in group ``k // g``; scales and zeros in the model
  dtype). The CPU loop dequantizes each used expert; on CUDA the fused MoE kernels unpack the
  words and apply the group scales in registers (weight-only: x stays 16-bit).

Checkpoint tensors per expert projection (K inputs, N outputs, G groups), as in gptq.py / awq.py
/ compressed_tensors.py: GPTQ ``qweight`` [K / 8, N], ``qzeros`` [G, N / 8] (``zero - 1``
unless gptq_v2), ``scales`` [G, N], ``g_idx`` [K] (contiguous groups: not read); AWQ
``qweight`` [K, N / 8] and ``qzeros`` [G, N / 8] with AutoAWQ's interleaved nibbles, ``scales``
[G, N]; compressed-tensors pack-quantized ``weight_packed`` [N, K / 8], ``weight_scale`` [N, G],
``weight_zero_point`` [N / 8, G] when asymmetric (``weight_shape``: not read). Act-order with
several groups is refused: each expert would need its own input permutation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightwell.quant.experts import ExpertWeights, StackedExperts, add_expert_param
from lightwell.quant.utils import pack_int32, replace_params, unpack_int32
from lightwell.quant.wna16 import dequantize, group_index


def wna16_experts(method: Any) -> WNA16Experts:
    name = type(method).__name__
    if name == "AWQMethod":
        return WNA16Experts("awq", method.group_size)
    fmt = "gptq" if name == "GPTQMethod" else "compressed-tensors"
    if method.bits != 4:
        raise ValueError(
            f"{fmt}: {method.bits}-bit expert weights are not supported (supported: 4)"
        )
    act_order = method.desc_act if fmt == "gptq" else method.act_order
    if act_order and method.group_size > 0:
        raise ValueError(
            f"{fmt}: act-order expert weights are not supported (supported: contiguous groups, "
            "or one group per channel)"
        )
    if fmt == "gptq":
        return WNA16Experts(fmt, method.group_size, v2=method.v2)
    return WNA16Experts(fmt, method.group_size, symmetric=method.symmetric)


class WNA16Experts(StackedExperts):
    """GPTQ / AWQ 4-bit experts (module docstring)."""

    def __init__(self, fmt: str, group_size: int, v2: bool = False, symmetric: bool = False):
        self.fmt, self.group_size, self.v2, self.symmetric = fmt, group_size, v2, symmetric
        if fmt == "compressed-tensors":
            zeros = () if symmetric else ("weight_zero_point",)
            self.checkpoint_tensors = ("weight_packed", "weight_scale", *zeros)
        else:
            self.checkpoint_tensors = ("qweight", "qzeros", "scales")

    def _groups(self, k: int) -> tuple[int, int]:  # (group size, groups) over k inputs
        gs = self.group_size if self.group_size > 0 else k
        return gs, -(-k // gs)

    def create_weights(self, layer: nn.Module, hidden: int, inter: int, dtype: torch.dtype) -> None:
        gs = self.group_size
        if inter % 8 or hidden % 8 or (gs > 0 and inter % gs):
            raise ValueError(
                f"{self.fmt}: the expert intermediate size per rank ({inter}) or hidden size "
                f"({hidden}) does not hold whole 8-value words and groups of {gs} (try another "
                "tensor-parallel size, or expert parallelism)"
            )
        gh, gi = self._groups(hidden)[1], self._groups(inter)[1]
        if self.fmt == "compressed-tensors":
            return self._create_ct(layer, hidden, inter, dtype, gh, gi)
        i32, down_groups = torch.int32, (0, gs) if gs > 0 else (None, 1)
        if self.fmt == "gptq":  # qweight [K / 8, N]
            add_expert_param(layer, "w13_qweight", (hidden // 8, 2 * inter), i32, 1)
            add_expert_param(layer, "w2_qweight", (inter // 8, hidden), i32, 0, 8)
        else:  # awq: qweight [K, N / 8]
            add_expert_param(layer, "w13_qweight", (hidden, 2 * inter // 8), i32, 1, 8)
            add_expert_param(layer, "w2_qweight", (inter, hidden // 8), i32, 0)
        add_expert_param(layer, "w13_qzeros", (gh, 2 * inter // 8), i32, 1, 8)
        add_expert_param(layer, "w2_qzeros", (gi, hidden // 8), i32, *down_groups)
        add_expert_param(layer, "w13_scales", (gh, 2 * inter), dtype, 1)
        add_expert_param(layer, "w2_scales", (gi, hidden), dtype, *down_groups)

    def _create_ct(self, layer: nn.Module, hidden: int, inter: int, dtype, gh: int, gi: int):
        """compressed-tensors pack-quantized: ``weight_packed`` [N, K / 8] (GPTQ's value order,
        offset by 8), ``weight_scale`` [N, G], asymmetric: ``weight_zero_point`` [N / 8, G]."""
        i32, down_groups = torch.int32, (1, self.group_size) if self.group_size > 0 else (None, 1)
        add_expert_param(layer, "w13_weight_packed", (2 * inter, hidden // 8), i32, 0)
        add_expert_param(layer, "w2_weight_packed", (hidden, inter // 8), i32, 1, 8)
        add_expert_param(layer, "w13_weight_scale", (2 * inter, gh), dtype, 0)
        add_expert_param(layer, "w2_weight_scale", (hidden, gi), dtype, *down_groups)
        if not self.symmetric:
            add_expert_param(layer, "w13_weight_zero_point", (2 * inter // 8, gh), i32, 0, 8)
            add_expert_param(layer, "w2_weight_zero_point", (hidden // 8, gi), i32, *down_groups)

    def _canonical(self, qweight, qzeros, scales) -> tuple[torch.Tensor, ...]:
        """One expert's checkpoint tensors -> ([N, K / 8] words, [N, G] scales, [N, G] zeros)."""
        if self.fmt == "compressed-tensors":  # (weight_packed, zero points or None, scales)
            zeros = 8 + torch.zeros_like(scales) if qzeros is None else (
                unpack_int32(qzeros, 4, dim=0).to(scales.dtype))  # fmt: skip
            return qweight, scales, zeros
        if self.fmt == "gptq":
            q = unpack_int32(qweight, 4, dim=0)  # [K, N]
            zeros = unpack_int32(qzeros, 4, dim=1) + (0 if self.v2 else 1)  # [G, N]
        else:
            from lightwell.quant.awq import unpack_awq

            q, zeros = unpack_awq(qweight), unpack_awq(qzeros)
        return pack_int32(q.t(), 4, dim=1), scales.t(), zeros.t().to(scales.dtype)

    def process_after_loading(self, layer: nn.Module) -> None:
        new, ct = {}, self.fmt == "compressed-tensors"
        names = ("weight_packed", "weight_zero_point", "weight_scale") if ct else (
            "qweight", "qzeros", "scales")  # fmt: skip
        for proj in ("w13", "w2"):
            q, z, s = (getattr(layer, f"{proj}_{t}", None) for t in names)
            parts = [
                self._canonical(q[e], None if z is None else z[e], s[e]) for e in range(len(s))
            ]
            for i, name in enumerate(("qweight", "scales", "zeros")):
                new[f"{proj}_{name}"] = torch.stack([p[i] for p in parts]).contiguous()
        drop = tuple(f"{proj}_{t}" for proj in ("w13", "w2") for t in names)
        replace_params(layer, new, drop)
        layer.quant_group_size = self.group_size

    def kernel_inputs(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(w13, w2, fused_moe's keyword arguments) of the fused kernels."""
        q13, q2 = layer.w13_qweight, layer.w2_qweight
        groups = self._groups(q13.shape[2] * 8)[0], self._groups(q2.shape[2] * 8)[0]
        int4 = (layer.w13_scales, layer.w13_zeros, layer.w2_scales, layer.w2_zeros, *groups)
        return q13, q2, {"int4": int4}

    def expert_weights(self, layer: nn.Module, x: torch.Tensor) -> ExpertWeights:
        """Expert e's weights dequantized (``(q - zero) * scale`` per group) to x's dtype."""
        q13, q2 = layer.w13_qweight, layer.w2_qweight  # [E, 2I, H / 8], [E, H, I / 8]
        g13 = group_index(q13.shape[2] * 8, self.group_size, x.device)
        g2 = group_index(q2.shape[2] * 8, self.group_size, x.device)

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            w13 = dequantize(q13[e], layer.w13_scales[e], layer.w13_zeros[e], g13, 4)
            w2 = dequantize(q2[e], layer.w2_scales[e], layer.w2_zeros[e], g2, 4)
            return w13.to(x.dtype), w2.to(x.dtype)

        return expert
