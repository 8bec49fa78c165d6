"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout), 2, 4 or 8 bit.

Per linear (K inputs, N outputs, G groups, P = 32 / bits values per int32):
  ``qweight`` [K / P, N] int32, packed along the inputs (value j of a word at bits j*bits),
  ``qzeros``  [G, N / P] int32, packed along the outputs,
  ``scales``  [G, N] fp16,
  ``g_idx``   [K] int32, the group of each input row (permuted under ``desc_act``).
``w = (q - z) * s``; ``checkpoint_format`` "gptq" (the default) stores ``z - 1``, "gptq_v2"
stores ``z``. ``group_size`` -1: one group (per channel). Under tensor parallelism the groups
shard with the inputs, except with ``desc_act`` on a row-parallel layer: then every rank holds
all groups (its rows point anywhere in them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightwell.quant.base import WeightLoader
from lightwell.quant.utils import add_param, check_divisible, input_sharded, unpack_int32
from lightwell.quant.wna16 import WNA16Method, finalize, group_index

BITS = (2, 4, 8)
FORMATS = ("gptq", "gptq_v2")
CHECKPOINT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def from_config(qc: dict[str, Any]) -> GPTQMethod:
    bits = int(qc.get("bits", 4))
    group_size = int(qc.get("group_size", 128))
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if bits not in BITS:
        raise ValueError(f"gptq: {bits}-bit weights are not supported (supported: 2, 4, 8)")
    if fmt not in FORMATS:
        raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported ({', '.join(FORMATS)})")
    if group_size == 0 or group_size < -1:
        raise ValueError(f"gptq: group_size must be -1 or positive, got {group_size}")
    if qc.get("lm_head"):
        raise ValueError("gptq: a quantized lm_head is not supported")
    return GPTQMethod(bits, group_size, bool(qc.get("desc_act", False)), fmt == "gptq_v2")


class GPTQMethod(WNA16Method):
    checkpoint_tensors = CHECKPOINT_TENSORS

    def __init__(self, bits: int, group_size: int, desc_act: bool, v2: bool):
        self.bits, self.group_size, self.desc_act, self.v2 = bits, group_size, desc_act, v2
        self.pack = 32 // bits

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        gs = self.group_size if self.group_size > 0 else k
        check_divisible(k, self.pack, "input features per rank", "gptq")
        for size in output_partition_sizes:
            check_divisible(size, self.pack, "output features per rank", "gptq")
        # groups shard with the inputs unless act-order rows index all of them
        full_groups = self.group_size < 0 or (self.desc_act and input_sharded(layer, k))
        if self.group_size > 0 and not full_groups:
            check_divisible(k, gs, "input features per rank", "gptq")
            check_divisible(getattr(layer, "input_start", 0), gs, "input shard start", "gptq")
        groups = 1 if self.group_size < 0 else -(-getattr(layer, "input_size", k) // gs)
        groups = groups if full_groups else -(-k // gs)
        group_dim = None if full_groups else 0
        p, i32 = self.pack, torch.int32
        add_param(layer, "qweight", (k // p, n), i32, weight_loader, 1, 0, {0: p})
        add_param(
            layer, "qzeros", (groups, n // p), i32, weight_loader, 1, group_dim, {0: gs, 1: p}
        )
        add_param(layer, "scales", (groups, n), params_dtype, weight_loader, 1, group_dim, {0: gs})
        add_param(layer, "g_idx", (k,), i32, weight_loader, None, 0)

    def process_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.qweight.data, self.bits, dim=0)  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1)  # [G, N]
        if not self.v2:
            zeros = zeros + 1
        k = q.shape[0]
        if self.desc_act:
            g_idx = layer.g_idx.data
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= zeros.shape[0]:
                raise ValueError("gptq: g_idx names a group the checkpoint has no scales for")
        else:
            g_idx = group_index(k, self.group_size, q.device)
        gs = self.group_size if self.group_size > 0 else k
        finalize(
            layer, q, layer.scales.data, zeros, g_idx, self.bits, ("qzeros",), gs, self.desc_act
        )
