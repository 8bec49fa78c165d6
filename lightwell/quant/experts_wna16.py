"""4-bit weight-only MoE experts: GPTQ (AutoGPTQ layout, symmetric or not, contiguous groups or
one group) and AWQ (AutoAWQ GEMM layout) per-expert checkpoint tensors, converted after loading
to the stacked K-contiguous layout of ``lightwell/quant/wna16.py``:

  ``w13_qweight`` [E, 2I, H / 8] int32, ``w13_scales`` / ``w13_zeros`` [E, 2I, ceil(H / g)],
  ``w2_qweight`` [E, H, I / 8] int32, ``w2_scales`` / ``w2_zeros`` [E, H, I / g]
  (``w = (q - zero) * scale``, input ``k`` in group ``k // g``; scales and zeros in the model
  dtype). The CPU loop dequantizes each used expert; on CUDA the fused MoE kernels unpack the
  words and apply the group scales in registers (weight-only: x stays 16-bit).

Checkpoint tensors per expert projection (K inputs, N outputs, G groups), as in gptq.py / awq.py:
GPTQ ``qweight`` [K / 8, N], ``qzeros`` [G, N / 8] (``zero - 1`` unless gptq_v2), ``scales``
[G, N], ``g_idx`` [K] (contiguous groups: not read); AWQ ``qweight`` [K, N / 8] and ``qzeros``
[G, N / 8] with AutoAWQ's interleaved nibbles, ``scales`` [G, N]. Act-order (``desc_act``) with
several groups is refused: each expert would need its own input permutation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightwell.quant.experts import add_expert_param
from lightwell.quant.utils import pack_int32, replace_params, unpack_int32
from lightwell.quant.wna16 import dequantize, group_index


def wna16_experts(method: Any) -> WNA16Experts:
    name = type(method).__name__
    if name == "AWQMethod":
        return WNA16Experts("awq", method.group_size)
    if method.bits != 4:
        raise ValueError(f"gptq: {method.bits}-bit expert weights are not supported (supported: 4)")
    if method.desc_act and method.group_size > 0:
        raise ValueError(
            "gptq: act-order (desc_act) expert weights are not supported (supported: desc_act "
            "false, or group_size -1)"
        )
    return WNA16Experts("gptq", method.group_size, method.v2)


class WNA16Experts:
    """GPTQ / AWQ 4-bit experts (module docstring)."""

    def __init__(self, fmt: str, group_size: int, v2: bool = False):
        self.fmt, self.group_size, self.v2 = fmt, group_size, v2
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

    def _canonical(self, qweight, qzeros, scales) -> tuple[torch.Tensor, ...]:
        """One expert's checkpoint tensors -> ([N, K / 8] words, [N, G] scales, [N, G] zeros)."""
        if self.fmt == "gptq":
            q = unpack_int32(qweight, 4, dim=0)  # [K, N]
            zeros = unpack_int32(qzeros, 4, dim=1) + (0 if self.v2 else 1)  # [G, N]
        else:
            from lightwell.quant.awq import unpack_awq

            q, zeros = unpack_awq(qweight), unpack_awq(qzeros)
        return pack_int32(q.t(), 4, dim=1), scales.t(), zeros.t().to(scales.dtype)

    def process_after_loading(self, layer: nn.Module) -> None:
        new = {}
        for proj in ("w13", "w2"):
            qweight, qzeros, scales = (getattr(layer, f"{proj}_{t}").data
                                       for t in ("qweight", "qzeros", "scales"))  # fmt: skip
            parts = [self._canonical(qweight[e], qzeros[e], scales[e]) for e in range(len(scales))]
            for i, name in enumerate(("qweight", "scales", "zeros")):
                new[f"{proj}_{name}"] = torch.stack([p[i] for p in parts]).contiguous()
        replace_params(layer, new, ("w13_qzeros", "w2_qzeros"))
        layer.quant_group_size = self.group_size

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k]
        ids: torch.Tensor,  # [T, k] local expert ids
        **options: Any,  # fused_moe's tile options (CUDA)
    ) -> torch.Tensor:  # [T, H]
        q13, q2 = layer.w13_qweight, layer.w2_qweight  # [E, 2I, H / 8], [E, H, I / 8]
        if x.is_cuda:
            from lightwell.kernels.fused_moe import fused_moe

            groups = self._groups(q13.shape[2] * 8)[0], self._groups(q2.shape[2] * 8)[0]
            int4 = (layer.w13_scales, layer.w13_zeros, layer.w2_scales, layer.w2_zeros, *groups)
            return fused_moe(x, q13, q2, weights, ids, int4=int4, **options)
        from lightwell.layers.moe import moe_loop_by

        g13 = group_index(q13.shape[2] * 8, self.group_size, x.device)
        g2 = group_index(q2.shape[2] * 8, self.group_size, x.device)

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            w13 = dequantize(q13[e], layer.w13_scales[e], layer.w13_zeros[e], g13, 4)
            w2 = dequantize(q2[e], layer.w2_scales[e], layer.w2_zeros[e], g2, 4)
            return w13.to(x.dtype), w2.to(x.dtype)

        return moe_loop_by(x, expert, q13.shape[0], weights, ids)
