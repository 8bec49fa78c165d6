"""The process group's own all-reduce: NCCL on GPU, gloo on CPU; and gloo through the host."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightwell.distributed.comm.base import CommContext


class ProcessGroupAllReduce:
    """``torch.distributed.all_reduce`` on the device group (NCCL ring/tree; gloo on CPU).

    In place, capturable in CUDA graphs under NCCL."""

    name = "nccl"

    def __init__(self, ctx: CommContext) -> None:
        self.group = ctx.group
        self.graph_safe = ctx.device.type == "cuda"

    @staticmethod
    def available(ctx: CommContext) -> bool:
        return True

    def supports(self, x: torch.Tensor) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def close(self) -> None:
        pass


class GlooAllReduce:
    """All-reduce over the CPU (gloo) group; device tensors make a round trip through the host.
    A slow reference path on GPU, never captured in a CUDA graph."""

    name = "gloo"
    graph_safe = False

    def __init__(self, ctx: CommContext) -> None:
        self.group = ctx.cpu_group

    @staticmethod
    def available(ctx: CommContext) -> bool:
        return dist.is_gloo_available()

    def supports(self, x: torch.Tensor) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            dist.all_reduce(x, group=self.group)
            return x
        host = x.cpu()
        dist.all_reduce(host, group=self.group)
        return x.copy_(host)

    def close(self) -> None:
        pass
