"""``--quantization gguf`` (CPU): GGUF linears kept as the file's quantized blocks (Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K ...: whatever the ``gguf`` package dequantizes). Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K and Q6_K run on the CPU kernels of ``lightwell.quant.gguf_cpu`` (as do the token
embedding and LM head); other types are dequantized one layer at a time when it runs (with
gguf-py's numpy code: memory-lean, about 10x slower than weights dequantized at load).

The checkpoint hands a layer its tensors as the file stores them: a uint8 tensor [rows,
bytes per row] tagged with ``gguf_type`` (quantized), or a float tensor (F32/F16/BF16). A fused
layer (q/k/v, gate/up) keeps one part per shard, each in its own type. Under tensor parallelism
a column-parallel rank keeps its rows (rows are independent); a row-parallel rank keeps its
byte range of every row when its inputs start and end on block boundaries, else it dequantizes
that layer's slice at load.

On CUDA the blocks live on the GPU and run through Triton kernels (quant/gguf_cuda.py).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightwell.quant import gguf_cpu
from lightwell.quant.base import WeightLoader, set_weight_attrs


def raw_tensor(data: np.ndarray, qtype: int) -> torch.Tensor:
    """A GGUF tensor's stored blocks: uint8 [rows, bytes per row], tagged with its type. A
    read-only memory map (GGUFReader's) is shared, not copied: nothing writes into blocks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(np.asarray(data, dtype=np.uint8))
    t.gguf_type = int(qtype)
    return t


def dequantize_raw(raw: torch.Tensor, qtype: int) -> torch.Tensor:  # [R, B] -> [R, K] float32
    from gguf import GGMLQuantizationType, dequantize

    out = dequantize(raw.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def _block(qtype: int) -> tuple[int, int]:
    """(values, bytes) per block of a GGUF quantization type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


class GGUFLinearMethod:
    """Per layer: ``gguf_parts``, one ``(qtype or None, tensor)`` per output shard.
    ``int8_act`` (``--cpu-int8-activations``): the CPU kernels' small steps round the inputs of
    linears and LM head in blocks of 32 (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) to int8 (this
    model's layers only)."""

    checkpoint_tensors = ("weight (GGUF blocks)",)

    def __init__(self, int8_act: bool = False):
        self.int8_act = bool(int8_act)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        layer.gguf_parts = [None] * len(output_partition_sizes)
        weight = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": functools.partial(self.load, layer)})
        layer.register_parameter("weight", weight)

    def load(
        self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        fused = hasattr(layer, "_shard_index")
        if fused and shard_id is None:  # a file that stores the fused tensor
            sizes = layer._checkpoint_sizes()
            for i, part in enumerate(loaded.split(sizes, dim=0)):
                if hasattr(loaded, "gguf_type"):
                    part.gguf_type = loaded.gguf_type
                self.load(layer, param, part, i)
            return
        index = layer._shard_index(shard_id) if fused else 0
        rows = self._rows(layer, index, loaded.shape[0])
        part = loaded.narrow(0, *rows)
        qtype = getattr(loaded, "gguf_type", None)
        cols = self._cols(layer)
        if qtype is not None and cols is not None:
            part, qtype = self._slice_cols(part, qtype, cols)
        elif cols is not None:
            part = part.narrow(1, *cols)
        if qtype is None:
            part = part.to(param.dtype)
        if param.is_cuda:
            from lightwell.quant.gguf_cuda import to_device

            qtype, part = to_device(qtype, part, param)
        layer.gguf_parts[index] = (qtype, part.contiguous())

    @staticmethod
    def _rows(layer: nn.Module, index: int, total: int) -> tuple[int, int]:
        """(start, size) of this rank's output rows of shard ``index``."""
        if hasattr(layer, "_partition"):
            return layer._partition(index), layer.output_partition_sizes[index]
        if hasattr(layer, "output_size_per_partition"):
            size = layer.output_size_per_partition
            return layer.tp_rank * size, size
        return 0, total

    @staticmethod
    def _cols(layer: nn.Module) -> tuple[int, int] | None:
        """(start, size) of this rank's inputs when the layer splits them, else None."""
        if hasattr(layer, "input_start") and layer.input_size_per_partition != layer.input_size:
            return layer.input_start, layer.input_size_per_partition
        return None

    @staticmethod
    def _slice_cols(
        raw: torch.Tensor, qtype: int, cols: tuple[int, int]
    ) -> tuple[torch.Tensor, int | None]:
        values, nbytes = _block(qtype)
        start, size = cols
        if start % values == 0 and size % values == 0:
            return raw.narrow(1, start // values * nbytes, size // values * nbytes), qtype
        return dequantize_raw(raw.contiguous(), qtype).narrow(1, start, size), None

    def prepare_model(self, model: nn.Module) -> bool:
        """Before loading: the token embedding and LM head keep their blocks too (CPU);
        whether they were swapped for modules that take blocks."""
        return gguf_cpu.quantize_embeddings(model, self.int8_act)

    def process_after_loading(self, layer: nn.Module) -> None:
        if any(p is None for p in layer.gguf_parts):
            raise ValueError("GGUF: a shard of a fused layer had no tensor in the file")
        gguf_cpu.prepare_cpu(layer)

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        if x.is_cuda:  # the blocks on the GPU, read by Triton kernels
            from lightwell.quant.gguf_cuda import gguf_linear

            return gguf_linear(layer.gguf_parts, x, bias)
        if getattr(layer, "gguf_cpu", None) is not None:
            return gguf_cpu.apply_cpu(layer, x, bias, self.int8_act)
        parts = [p if q is None else dequantize_raw(p, q) for q, p in layer.gguf_parts]
        w = parts[0] if len(parts) == 1 else torch.cat(parts)  # [N, K], this call only
        return F.linear(x, w.to(x.dtype), bias)
