"""Pipeline-parallel state: this process's stage, the stage split of the layers, and the
point-to-point sends of the activations between stages.

Ranks are laid out tensor-parallel first: global rank = stage * tp + tp_rank, so a stage's
tensor-parallel group is a contiguous block of ranks and tp rank t of stage s sends its
activations to tp rank t of stage s + 1 (each rank sends its own partial sum; the next stage's
first norm all-reduces it, as it would between two layers of one stage). Set once per process
by the worker (``init_pp``) before the model is built; without it there is one stage.
With ``via_host`` (stages sharing one GPU, for testing: ``--stages-share-gpu``) the group is
gloo and the activations travel as host copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _PPState:
    rank: int = 0  # this process's stage
    size: int = 1  # stages
    prev: int | None = None  # global rank this stage receives from (None on the first stage)
    next: int | None = None  # global rank this stage sends to (None on the last stage)
    via_host: bool = False  # send and receive host copies (a gloo group on GPU ranks)


_STATE = _PPState()


def init_pp(
    stage: int, stages: int, global_rank: int, tp_size: int, via_host: bool = False
) -> None:
    """Record this process's stage and its neighbours' global ranks."""
    global _STATE
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"invalid pipeline stage {stage} for {stages} stages")
    prev = global_rank - tp_size if stage > 0 else None
    nxt = global_rank + tp_size if stage < stages - 1 else None
    _STATE = _PPState(stage, stages, prev, nxt, via_host)


def reset_pp() -> None:
    global _STATE
    _STATE = _PPState()


def get_pp_rank() -> int:
    return _STATE.rank


def get_pp_size() -> int:
    return _STATE.size


def is_first_stage() -> bool:
    return _STATE.rank == 0


def is_last_stage() -> bool:
    return _STATE.rank == _STATE.size - 1


def stage_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Each stage's ``[start, end)`` layers: contiguous, as even as possible, the earlier
    stages taking the extra layers (the last stage also runs the final norm and LM head)."""
    if num_layers < stages:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def stage_layers(num_layers: int) -> tuple[int, int]:
    """This process's ``[start, end)`` layers."""
    return stage_split(num_layers, _STATE.size)[_STATE.rank]


def describe_split(num_layers: int, stages: int) -> str:
    """One line for the start-up log: which layers each stage runs."""
    parts = [
        f"stage {s}: layers {a}-{b - 1} ({b - a})"
        for s, (a, b) in enumerate(stage_split(num_layers, stages))
    ]
    return f"pipeline parallel, {stages} stages over {num_layers} layers: " + ", ".join(parts)


def send_activations(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """Send ``[T, H]`` hidden (this rank's partial sum under TP) and residual to the next
    stage, as one ``[2, T, H]`` message."""
    import torch.distributed as dist

    buf = torch.stack([hidden, residual])  # [2, T, H]
    dist.send(buf.cpu() if _STATE.via_host else buf, dst=_STATE.next)


def recv_activations(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:  # [2, T, H]
    """The previous stage's ``(hidden, residual)`` as one ``[2, T, H]`` tensor."""
    import torch.distributed as dist

    where = torch.device("cpu") if _STATE.via_host else device
    buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=where)
    dist.recv(buf, src=_STATE.prev)
    return buf.to(device)
