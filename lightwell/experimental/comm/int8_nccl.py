"""Experimental: ``int8``, an int8-quantized all-reduce over NCCL (hostmem-int8 is faster
wherever both were measured). Its torch ops are also the reference of kernels/int8_pack.py.

Int8-quantized all-reduce: about half the bytes of bf16 on the wire, for bandwidth-bound links.

    x [N] -> pad to n * C, view [n, C] (chunk j goes to rank j)
      quantize per group of GROUP elements (scale = absmax / 127, int8 values, fp32 scales)
      all_to_all: rank r receives chunk r of every rank            (reduce-scatter, int8)
      dequantize and sum in fp32 -> this rank's reduced chunk [C]
      requantize; all_gather every rank's reduced chunk              (all-gather, int8)
      dequantize -> [N] in x's dtype

NCCL and gloo have no "sum of int8 with scales", so the reduction is done by the ranks between
an all-to-all and an all-gather; int8 values and their scales travel packed in one uint8
buffer per chunk (C + 4 C / GROUP bytes), so each step is one collective. Every rank ends with
the same bytes, so results agree across ranks. Capturable in CUDA graphs (NCCL collectives and
elementwise kernels only); works over gloo on CPU.

Error: two roundings to a step of absmax/127 per group; each element is off by at most
(sum over ranks of its input group's absmax + its output group's absmax) / 254 (asserted in
tests/models/test_tensor_parallel_comm.py). Measured on 2 ranks, [64, 4096] fp32: Gaussian
inputs 0.9 % relative L2 error of the sum; with 8 outlier channels 50x larger, 2.2 % (the
outliers' groups get coarse steps).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from lightwell.distributed.comm.base import CommContext, is_exact_sum

GROUP = 128  # elements per scale
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float (C % GROUP == 0) -> (int8 [R, C], fp32 scales [R, C / GROUP])."""
    rows, cols = x.shape
    g = x.float().view(rows, cols // GROUP, GROUP)
    scales = g.abs().amax(dim=-1).clamp_min(1e-30) / 127.0  # [R, C / GROUP]
    q = torch.round(g / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(rows, cols), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [R, C], fp32 [R, C / GROUP] -> fp32 [R, C]."""
    rows, cols = q.shape
    g = q.view(rows, cols // GROUP, GROUP).float() * scales.unsqueeze(-1)
    return g.view(rows, cols)


def pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """-> uint8 [R, C + 4 C / GROUP]: a row's int8 values, then its scales' bytes."""
    rows = q.shape[0]
    return torch.cat([q.view(torch.uint8), scales.contiguous().view(torch.uint8).view(rows, -1)], 1)


def unpack(buf: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [R, C + 4 C / GROUP] -> (int8 [R, C], fp32 [R, C / GROUP])."""
    q = buf[:, :cols].view(torch.int8)
    scales = buf[:, cols:].contiguous().view(torch.float32)
    return q, scales


# The three local steps in torch ops, with lightwell.kernels.int8_pack's signatures (the CPU
# path; GPUs use the fused kernels).
def _quantize_pack(x: torch.Tensor, num_rows: int, cols: int) -> torch.Tensor:
    flat = x.reshape(-1)
    if flat.numel() != num_rows * cols:
        flat = torch.nn.functional.pad(flat, (0, num_rows * cols - flat.numel()))
    return pack(*quantize(flat.view(num_rows, cols)))


def _dequant_sum_requant(recv: torch.Tensor, cols: int) -> torch.Tensor:
    return pack(*quantize(dequantize(*unpack(recv, cols)).sum(dim=0, keepdim=True)))


def _unpack_dequant(gathered: torch.Tensor, cols: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(*unpack(gathered, cols)).view(-1)[:n].to(dtype)


_TORCH_OPS = SimpleNamespace(
    quantize_pack=_quantize_pack,
    dequant_sum_requant=_dequant_sum_requant,
    unpack_dequant=_unpack_dequant,
)


class Int8AllReduce:
    name = "int8"
    graph_safe = True

    def __init__(self, ctx: CommContext, fused: bool | None = None) -> None:
        """``fused``: quantize/pack, dequantize-sum-requantize and unpack/dequantize as one
        Triton kernel each (lightwell/kernels/int8_pack.py) instead of a dozen torch ops each
        way; default: on GPUs (several times faster than the torch ops), torch ops on CPU
        (where Triton only interprets). Tested against the torch ops on CPU and over gloo."""
        self.group = ctx.group
        self.size = ctx.size
        if fused is None:
            fused = ctx.device.type == "cuda"
        if fused:
            from lightwell.kernels import int8_pack as ops
        else:
            ops = _TORCH_OPS
        self.ops = ops

    @staticmethod
    def available(ctx: CommContext) -> bool:
        return True

    def supports(self, x: torch.Tensor) -> bool:
        return x.is_floating_point() and not is_exact_sum()  # (exact: the selector's NCCL)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        n, w = x.numel(), self.size
        cols = -(-n // (w * GROUP)) * GROUP  # elements per rank's chunk
        send = ops.quantize_pack(x.contiguous(), w, cols)  # [w, bytes per chunk]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        mine = ops.dequant_sum_requant(recv, cols)  # [1, bytes per chunk]
        gathered = torch.empty((w, mine.shape[1]), dtype=torch.uint8, device=x.device)
        _all_gather(gathered, mine, group=self.group)
        return ops.unpack_dequant(gathered, cols, n, x.dtype).view(x.shape)

    def close(self) -> None:
        pass
