"""AWQ checkpoints (AutoAWQ "gemm" layout): 4-bit weights with zero points.

Per linear (K inputs, N outputs, G = K / group_size groups):
  ``qweight`` [K, N / 8] int32, packed along the outputs,
  ``qzeros``  [G, N / 8] int32, packed the same way,
  ``scales``  [G, N] fp16;
``w = (q - z) * s``. AutoAWQ interleaves each word: nibble ``i`` (bits 4i..4i+3) holds output
column ``AWQ_ORDER[i]`` of its run of eight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightwell.quant.base import WeightLoader
from lightwell.quant.utils import add_param, check_divisible, unpack_int32
from lightwell.quant.wna16 import WNA16Method, finalize, group_index

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
CHECKPOINT_TENSORS = ("qweight", "qzeros", "scales")


def from_config(qc: dict[str, Any]) -> AWQMethod:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"awq: {bits}-bit weights are not supported (supported: 4)")
    if version != "gemm":
        raise ValueError(f"awq: version {version!r} is not supported (supported: gemm)")
    if not qc.get("zero_point", True):
        raise ValueError("awq: zero_point false is not supported (supported: zero_point true)")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size <= 0:
        raise ValueError(f"awq: group_size must be positive, got {group_size}")
    return AWQMethod(group_size)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:  # [R, C / 8] int32 -> [R, C] int32
    """AutoAWQ's interleaved 4-bit words -> values in column order."""
    nibbles = unpack_int32(words, 4, dim=1)  # [R, C]: nibble order within each word
    r, c = nibbles.shape
    order = torch.tensor(AWQ_ORDER, device=words.device)
    out = torch.empty_like(nibbles).view(r, c // 8, 8)
    out[:, :, order] = nibbles.view(r, c // 8, 8)
    return out.view(r, c)


class AWQMethod(WNA16Method):
    checkpoint_tensors = CHECKPOINT_TENSORS

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        k, n, gs = input_size_per_partition, sum(output_partition_sizes), self.group_size
        check_divisible(k, gs, "input features per rank", "awq")
        check_divisible(getattr(layer, "input_start", 0), gs, "input shard start", "awq")
        for size in output_partition_sizes:
            check_divisible(size, 8, "output features per rank", "awq")
        i32 = torch.int32
        add_param(layer, "qweight", (k, n // 8), i32, weight_loader, 1, 0, {1: 8})
        add_param(layer, "qzeros", (k // gs, n // 8), i32, weight_loader, 1, 0, {0: gs, 1: 8})
        add_param(layer, "scales", (k // gs, n), params_dtype, weight_loader, 1, 0, {0: gs})

    def process_after_loading(self, layer: nn.Module) -> None:
        q = unpack_awq(layer.qweight.data)  # [K, N]
        zeros = unpack_awq(layer.qzeros.data)  # [G, N]
        g_idx = group_index(q.shape[0], self.group_size, q.device)
        finalize(layer, q, layer.scales.data, zeros, g_idx, 4, ("qzeros",), self.group_size)
