"""Weight-only integer linears (4 or 8 bit weights, 16/32-bit activations): the one layout every
checkpoint format (GPTQ, AWQ, compressed-tensors pack-quantized) is converted to after loading.

After ``finalize`` a layer holds one layout, K-contiguous (each output row's packed inputs
consecutive: what the batch-1 GEMV streams, and what the M > 4 GEMM reads too):
  ``qweight`` [N, K / (32 / bits)] int32: unsigned weights of one output row packed along the
  inputs (value ``j`` of a word at bits ``j * bits``, the GPTQ order),
  ``scales``  [N, G] and ``zeros`` [N, G] in the activation dtype: ``w = (q - zero) * scale``,
  ``g_idx``   [K] int32: the group of each input (``k // group_size`` unless act-order),
  ``quant_perm`` (attribute) [K] or None: act-order layers' inputs sorted by group, x's columns
  permuted to match at each call (so the kernels see contiguous groups),
and ``apply`` computes ``x @ W.T + bias``: on CPU by dequantizing this one layer's weight for
the call (never a resident dequantized copy), on CUDA through the W4A16 Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightwell.quant.base import UnquantizedLinearMethod
from lightwell.quant.utils import pack_int32, replace_params, unpack_int32


def finalize(
    layer: nn.Module,
    q: torch.Tensor,  # [K, N] unsigned integer weights
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] zero points (unsigned, same units as q)
    g_idx: torch.Tensor,  # [K] group of each input row
    bits: int,
    drop: tuple[str, ...],
    group_size: int,  # the format's group size (K for one group per channel)
    act_order: bool = False,  # g_idx comes from the checkpoint (rows in any group)
) -> None:
    """Replace the checkpoint's parameters by the canonical layout (see the module docstring).

    Act-order rows are sorted by group (``layer.quant_perm``: input k of the sorted layout is
    input ``perm[k]`` of x) when that makes the groups contiguous runs of ``group_size``; the
    kernels then compute the group (``layer.quant_group_size`` > 0). Otherwise (a row-parallel
    shard of an act-order layer) they gather ``g_idx`` (``quant_group_size`` 0)."""
    dtype = scales.dtype if scales.is_floating_point() else torch.get_default_dtype()
    layer.quant_bits, layer.quant_group_size, layer.quant_perm = bits, group_size, None
    if act_order:
        perm = torch.argsort(g_idx.long(), stable=True)
        contiguous = torch.arange(q.shape[0], device=q.device) // group_size
        if torch.equal(g_idx.long()[perm], contiguous):
            q, g_idx, layer.quant_perm = q[perm], contiguous, perm
        else:
            layer.quant_group_size = 0
    replace_params(
        layer,
        {
            "qweight": pack_int32(q.t(), bits, dim=1),  # [N, K / pack]
            "scales": scales.t().to(dtype).contiguous(),  # [N, G]
            "zeros": zeros.t().to(dtype).contiguous(),
            "g_idx": g_idx.to(torch.int32).contiguous(),
        },
        drop,
    )


def dequantize(
    qweight: torch.Tensor,  # [N, K / pack] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G]
    g_idx: torch.Tensor,  # [K]
    bits: int,
) -> torch.Tensor:  # [N, K] in scales.dtype
    q = unpack_int32(qweight, bits, dim=1).to(scales.dtype)  # [N, K]
    g = g_idx.long()
    return (q - zeros[:, g]) * scales[:, g]


def wna16_linear(
    layer: nn.Module,
    x: torch.Tensor,  # [T, K]
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N]
    if layer.quant_perm is not None:  # act-order rows sorted by group: x's columns follow
        x = x.index_select(1, layer.quant_perm)
    if x.is_cuda and layer.quant_bits == 4 and x.dtype in (torch.float16, torch.bfloat16):
        from lightwell.kernels.w4a16 import w4a16_matmul

        return w4a16_matmul(
            x.contiguous(), layer.qweight, layer.scales, layer.zeros, layer.g_idx, bias,
            group_size=layer.quant_group_size,
        )  # fmt: skip
    w = dequantize(layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits)
    return F.linear(x, w.to(x.dtype), bias)


class WNA16Method:
    """Base of the weight-only integer formats: subclasses create the checkpoint's parameters
    and convert them in ``process_after_loading`` with ``finalize``."""

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        return wna16_linear(layer, x, bias)


def group_index(k: int, group_size: int, device: torch.device) -> torch.Tensor:  # [k] int32
    """Input row -> group for contiguous groups (``group_size`` -1 or 0: one group)."""
    rows = torch.arange(k, device=device, dtype=torch.int32)
    return rows // group_size if group_size > 0 else torch.zeros_like(rows)


class DenseAfterLoading(UnquantizedLinearMethod):
    """A weight-only packed format (GPTQ, AWQ, compressed-tensors pack-quantized) loaded as
    published, then dequantized once into a plain ``weight`` [N, K] in the scales' dtype: for
    a layer whose consumer reads the weight itself (MLA's ``kv_b_proj``, absorbed by the
    attention). ``apply`` is then the unquantized method's."""

    def __init__(self, method: WNA16Method):
        self.method = method
        self.checkpoint_tensors = method.checkpoint_tensors

    def create_weights(self, layer: nn.Module, *args, **kwargs) -> None:
        self.method.create_weights(layer, *args, **kwargs)

    def process_after_loading(self, layer: nn.Module) -> None:
        self.method.process_after_loading(layer)
        w = dequantize(layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits)
        if layer.quant_perm is not None:  # input k of the sorted layout is input perm[k]
            w = torch.empty_like(w).index_copy_(1, layer.quant_perm, w)
        replace_params(layer, {"weight": w.contiguous()}, ("qweight", "scales", "zeros", "g_idx"))
        layer.quant_perm = None
