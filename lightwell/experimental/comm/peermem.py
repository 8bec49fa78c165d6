"""Experimental (not yet measured on two GPUs): ``peermem``, hostmem's low-latency kernel over
peer memory, for two GPUs with peer access.

The same one-kernel all-reduce as ``hostmem``'s ll lane (lightwell/kernels/hostmem_allreduce.py:
the epoch in the high half of every 8-byte word, the payload in the low half, the residual add
+ RMSNorm optionally in the same kernel), with the words pushed into the peer GPU's memory
instead of a host segment: each rank owns a buffer in its own device memory (torch symmetric
memory, mapped by the peer), writes its words into the peer's buffer (NVLink stores) and polls
its own buffer, a local read, for the peer's. hostmem's lane reads the peer's words back from
host memory over PCIe, a round trip per poll.

Two ranks only (a rank writes into one peer's buffer); exact (the fp32 sum in rank order,
rounded once, the same bytes on both ranks); CUDA-graph safe. Buffers are zeroed before either
rank writes, so no word carries an epoch before its first call. On CPU (the tests, under the
Triton interpreter) the two buffers are the halves of one shared-memory segment.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from lightwell import envs
from lightwell.distributed.comm.base import CommContext
from lightwell.distributed.comm.hostmem import LL_MAX_BYTES, HostMemAllReduce, map_pinned


class PeerMemAllReduce(HostMemAllReduce):
    name = "peermem"
    graph_safe = True

    def __init__(self, ctx: CommContext, max_bytes: int = LL_MAX_BYTES, **options: Any) -> None:
        """``max_bytes``: the largest message (default hostmem's ll lane's, 64 KB: batch-1 to
        8 decode at hidden 4,096); ``options``: HostMemAllReduce's ``max_programs``,
        ``block`` and ``fuse_norm``."""
        super().__init__(ctx, max_bytes=max_bytes, protocol="ll", **options)
        self.name = "peermem"

    @staticmethod
    def available(ctx: CommContext) -> bool:
        if ctx.size != 2:
            return False
        if ctx.device.type == "cuda":
            if not torch.cuda.is_available():
                return False
            try:
                importlib.import_module("torch.distributed._symmetric_memory")
            except ImportError:
                return False
            return True
        return envs.triton_interpret()

    def _segments(self, ctx: CommContext, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's buffer, the peer's), both ``nbytes``, zeroed, addressable here."""
        peer = 1 - ctx.rank
        if not self.on_gpu:
            both, self.registered = map_pinned(self, ctx, 2 * nbytes)  # (not pinned on CPU)
            self.memory = both
            return both.narrow(0, ctx.rank * nbytes, nbytes), both.narrow(0, peer * nbytes, nbytes)
        import torch.distributed._symmetric_memory as symm_mem

        own = symm_mem.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        own.zero_()
        handle = symm_mem.rendezvous(own, ctx.group.group_name)  # collective: maps the peer's
        theirs = handle.get_buffer(peer, (nbytes,), torch.uint8)
        torch.cuda.synchronize(ctx.device)
        dist.barrier(group=ctx.cpu_group)  # both zeroed before either rank writes
        self.memory, self.registered = own, False
        self._handle = handle
        self._release = _nothing
        return own, theirs

    def close(self) -> None:
        if self.on_gpu and self.bufs is not None:
            # the peer's words for our last call have arrived (our kernel saw them), and no
            # call of ours is left running once the device is idle
            torch.cuda.synchronize(self.bufs.epochs.device)
        self._handle = None
        super().close()


def _nothing() -> None:
    pass
