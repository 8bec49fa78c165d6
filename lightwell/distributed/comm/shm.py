"""Shared host memory for the all-reduces that go through it: a file-backed buffer every rank
maps, page-locked for the GPU's copies, and the rank-order sum every rank computes alike."""

from __future__ import annotations

import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from lightwell.distributed.comm.base import CommContext


def rank_order_sum(terms: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The sum of ``terms`` (every rank's, in rank order) into ``out`` (which may be one of
    them), computed in fp32 and rounded once: the same bytes on every rank that adds the same
    terms."""
    if len(terms) == 2:  # element-wise in fp32, one rounding: what the fp32 sum gives
        return torch.add(terms[0], terms[1], out=out)
    acc = terms[0].float()
    for t in terms[1:]:
        acc += t
    return out.copy_(acc)


def map_shared(ctx: CommContext, nbytes: int) -> torch.Tensor:
    """A zeroed file-backed buffer mapped by every rank; the file is gone once all have it."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    names: list = [None]
    if ctx.rank == 0:
        # a sparse file larger than the free space maps fine and then kills the process with
        # SIGBUS when a page is touched: check first, and let every rank fail the same way
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize >= nbytes:
            names[0] = os.path.join(folder, f"lightwell-ar-{uuid.uuid4().hex}")
            with open(names[0], "wb") as f:
                f.truncate(nbytes)
    dist.broadcast_object_list(
        names, src=dist.get_global_rank(ctx.cpu_group, 0), group=ctx.cpu_group
    )
    if names[0] is None:
        raise RuntimeError(f"{folder} has less than the {nbytes} bytes free that it needs")
    memory = torch.from_file(names[0], shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier(group=ctx.cpu_group)
    if ctx.rank == 0:
        os.unlink(names[0])
    return memory


def pin(memory: torch.Tensor, flags: int = 0) -> bool:
    """Page-lock the mapping so device<->host copies run at full PCIe speed (``flags``:
    cudaHostRegister's; 3 = portable + mapped into the device's address space)."""
    err = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), flags)
    return int(getattr(err, "value", err)) == 0
