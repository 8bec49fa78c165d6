"""Join this process to the tensor-parallel group and set up its all-reduce strategies.

Called by each rank's worker (rank 0 in the engine's process, the others in their own):
NCCL for device tensors on GPU plus a gloo group for host-side handshakes; gloo alone on CPU.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from lightwell.distributed import context_parallel, pipeline
from lightwell.distributed import parallel_state as ps

# Set before the process group exists: never NVLink SHARP / multicast (NCCL's NVLS and torch
# symmetric memory's multimem), which the lent machines cannot use.
COMM_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
TIMEOUT = datetime.timedelta(minutes=10)


def init_distributed(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    pp_size: int = 1,
    cp_size: int = 1,
    shared_gpu: bool = False,
) -> None:
    """``init_process_group`` for global rank ``rank`` of ``size`` (= tp x pp) and record this
    rank's tensor-parallel group (its stage's ranks) and pipeline stage. ``shared_gpu``
    (--stages-share-gpu, tensor parallel size 1): pipeline ranks on one GPU, which NCCL
    refuses; the group is gloo and the activations pass through host memory."""
    import torch.distributed as dist

    os.environ.update(COMM_ENV)
    kw = dict(init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)
    if device.type == "cuda" and shared_gpu:
        torch.cuda.set_device(device)
        dist.init_process_group("gloo", **kw)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kw)
    else:
        dist.init_process_group("gloo", **kw)
    if cp_size > 1:  # every rank is a whole model (tp = pp = 1); the world splits tokens
        ps.init_tp_group(0, 1)
        context_parallel.init_cp(rank, cp_size)
        return
    tp = size // pp_size
    if pp_size == 1:
        cpu_group = dist.group.WORLD
        if device.type == "cuda":
            cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        ps.init_tp_group(rank, size, dist.group.WORLD, cpu_group)
        return
    group, cpu_group = _stage_groups(rank, tp, pp_size, device)
    ps.init_tp_group(rank % tp, tp, group, cpu_group)
    pipeline.init_pp(rank // tp, pp_size, rank, tp, via_host=shared_gpu and device.type == "cuda")


def _stage_groups(rank: int, tp: int, pp: int, device: torch.device) -> tuple[Any, Any]:
    """Every stage's tensor-parallel groups (each rank creates all of them, in the same
    order, as ``new_group`` requires); returns this rank's (device group, gloo group)."""
    import torch.distributed as dist

    mine: tuple[Any, Any] = (None, None)
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=TIMEOUT)
        cpu = group
        if device.type == "cuda":
            cpu = dist.new_group(ranks, backend="gloo", timeout=TIMEOUT)
        if rank in ranks:
            mine = (group, cpu)
    return mine


def init_all_reduce(
    device: torch.device, choice: str, custom_all_reduce: bool, max_bytes: int, phases: int = 0
) -> None:
    """Build the selector of ``lightwell.distributed.comm`` and route ``tp_all_reduce`` to it
    (a collective: every rank calls it at the same point); ``phases``: the selector's."""
    from lightwell.distributed.comm import CommContext
    from lightwell.distributed.comm.selector import AllReduceSelector

    if ps.get_tp_size() == 1 or ps.get_tp_all_reduce() is not None:
        return
    ctx = CommContext(
        ps.get_tp_rank(), ps.get_tp_size(), ps.get_tp_group(), ps.get_tp_cpu_group(), device
    )
    ps.set_tp_all_reduce(AllReduceSelector(ctx, choice, custom_all_reduce, max_bytes, phases))


def shutdown_distributed() -> None:
    """Close the strategies' buffers and leave the process group."""
    import gc

    import torch.distributed as dist

    strategy = ps.get_tp_all_reduce()
    if strategy is not None:
        strategy.close()
    ps.reset_tp_group()
    pipeline.reset_pp()
    context_parallel.reset_cp()
    # collect cycles that may still hold the group: a process group that outlives
    # destroy_process_group is torn down during interpreter exit, where gloo can abort
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_distributed() -> None:
    """Make pending collectives of this process fail now (a peer died): best effort."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
        except Exception:  # noqa: BLE001 - already failing; nothing better to do
            pass
