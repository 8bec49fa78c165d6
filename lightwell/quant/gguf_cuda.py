"""``--quantization gguf`` on CUDA: a layer's shards stay on the GPU as the file's blocks
(lightwell/kernels/gguf_dequant.py reads Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; a shard of another
quantized type is dequantized once at load, to the model's dtype).

A step of at most ``GEMV_MAX_TOKENS`` tokens runs the GEMV kernel on each shard, dequantizing
in registers (each weight byte read once; the kernel takes up to its ``MAX_M`` rows, but its
time grows with the rows: ``benchmarks/kernels/gguf_cuda.py --crossover`` times both paths at
1-8 rows, and from 3 rows dequantizing is the faster). A larger step dequantizes the layer
into a buffer of this call only, [N, K] in the activation dtype, and multiplies with cuBLAS:
the caching allocator hands the same memory to every layer in turn (the largest layer's weight
is the peak, which the memory profile sees), and under CUDA graph capture the buffer comes from
the graphs' pool. No step reads a value back to the host, so every path can be captured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightwell.kernels.gguf_dequant import (
    BLOCKS,
    MAX_M,
    SUPPORTED,
    gguf_dequantize,
    gguf_gemv,
)

GEMV_MAX_TOKENS = min(2, MAX_M)  # steps up to this many tokens run the GEMV

Part = tuple[int | None, torch.Tensor]  # (GGUF type or None for a float tensor, its tensor)


def to_device(qtype: int | None, part: torch.Tensor, param: torch.Tensor) -> Part:
    """A shard's tensor on the parameter's device: blocks the kernels read stay blocks, other
    quantized types arrive dequantized to the parameter's dtype."""
    if qtype is not None and qtype not in SUPPORTED:
        from lightwell.quant.gguf import dequantize_raw

        part, qtype = dequantize_raw(part.contiguous(), qtype).to(param.dtype), None
    return qtype, part.to(param.device).contiguous()


def gguf_linear(
    parts: list[Part],  # one per output shard, [N_i, bytes per row] blocks or [N_i, K] float
    x: torch.Tensor,  # [T, K]
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N]
    x = x.contiguous()
    if x.shape[0] > GEMV_MAX_TOKENS:
        return F.linear(x, _weight(parts, x.dtype), bias)
    out = _gemv(parts, x)
    return out if bias is None else out.add_(bias)


def _gemv(parts: list[Part], x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
    n = sum(p.shape[0] for _, p in parts)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    start = 0
    for qtype, p in parts:
        view = out[:, start : start + p.shape[0]]  # this shard's columns
        if qtype is None:
            view.copy_(F.linear(x, p.to(x.dtype)))
        else:
            gguf_gemv(x, p, qtype, out=view)
        start += p.shape[0]
    return out


def _weight(parts: list[Part], dtype: torch.dtype) -> torch.Tensor:  # [N, K], this call only
    (qtype, p), k = parts[0], _in_features(parts[0])
    if len(parts) == 1:
        return p.to(dtype) if qtype is None else gguf_dequantize(p, qtype, dtype)
    n = sum(p.shape[0] for _, p in parts)
    w = torch.empty((n, k), dtype=dtype, device=p.device)
    start = 0
    for qtype, p in parts:
        rows = w[start : start + p.shape[0]]
        if qtype is None:
            rows.copy_(p)
        else:
            gguf_dequantize(p, qtype, out=rows)
        start += p.shape[0]
    return w


def _in_features(part: Part) -> int:
    qtype, p = part
    if qtype is None:
        return p.shape[1]
    values, nbytes = BLOCKS[qtype]
    return p.shape[1] // nbytes * values
