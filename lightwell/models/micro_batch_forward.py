"""Micro-batch forward of Llama-family models: one micro-batch's all-reduce runs on the comm
stream while the others compute.

Per decoder layer, with A and B the two halves of the step (``lightwell.attention.micro_batch``):

    main stream: attn(A) | attn(B) | norm+mlp(A) | norm+mlp(B) | attn(A) of the next layer ...
    comm stream:          AR(A)    | AR(B)       | AR(A)       | AR(B) ...

With three or more micro-batches (``--dual-stream-micro-batches``) each all-reduce has the
stages of all the others to hide under, not one: two halves leave a gap wherever one
micro-batch's attention stage is shorter than the other's all-reduce.

Each stage ends with a row-parallel partial sum (o_proj, down_proj) whose all-reduce is launched
on the comm stream; the next stage of the same micro-batch starts by waiting for it and
consuming it in the fused residual-add + RMSNorm (``hostmem-copy-int8`` can sum the peers'
int8 copies inside that norm: ``CommStream.wait_add_rmsnorm``, off by default). Every token
sees the operations of the plain forward, except that the plain forward may fuse that add +
norm into the all-reduce kernel (``reduce_norm``, hostmem at decode sizes), which this one
does not (the same values, the norm within its last bit); only the row blocks the kernels
run on differ.

Supported: ``LlamaModel`` and its subclasses that keep its ``forward``, whose layers describe
themselves as stages (``micro_batch_stages``): Llama, Mistral, Qwen2, Qwen3 (two stages a
layer), MiniCPM (the same, each all-reduced output scaled) and Command-R (one stage a layer:
its parallel block's attention + MLP partial sums under one all-reduce). Others run the plain
forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightwell.attention.metadata import forward_context
from lightwell.attention.micro_batch import MicroBatch
from lightwell.distributed.overlap import CommStream, PendingAllReduce
from lightwell.layers.norm import RMSNorm, pre_norm
from lightwell.models.llama import LayerStage, LlamaModel


def model_stages(model: nn.Module) -> list[list[LayerStage]] | None:
    """Every decoder layer's stages, in order; None where ``model`` (a causal LM) has no
    micro-batch forward. Worked out once per model (``MicroBatchOverlap``), not per step."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel) or type(inner).forward is not LlamaModel.forward:
        return None
    stages = [_stages(layer) for layer in inner.layers]
    return None if any(st is None for st in stages) else stages


def supports_micro_batches(model: nn.Module) -> bool:
    """``model`` is a causal LM whose ``.model`` this module can run in micro-batches."""
    return model_stages(model) is not None


def _stages(layer: nn.Module) -> list[LayerStage] | None:
    """The layer's stages, where they describe its ``forward``: the class that defines
    ``micro_batch_stages`` must be the one that defines ``forward``."""
    stages_fn = getattr(layer, "micro_batch_stages", None)
    if stages_fn is None or _owner(type(layer), "forward") is not _owner(
        type(layer), "micro_batch_stages"
    ):
        return None
    return stages_fn()


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


@dataclass
class _Stream:
    batch: MicroBatch
    pending: PendingAllReduce
    residual: torch.Tensor | None = None  # [Tm, H]
    scale: float = 1.0  # on the pending all-reduce's output (its stage's)


def _reduce_norm(
    comm: CommStream,
    st: _Stream,
    norm: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalised [Tm, H], new residual [Tm, H])
    """A stage's input: the previous stage's sum (times its scale) through the residual add +
    norm (``pre_norm``), the sum itself fused into the norm where the all-reduce allows
    (hostmem-copy-int8, unscaled sums)."""
    if st.residual is not None and isinstance(norm, RMSNorm) and st.scale == 1.0:
        fused = comm.wait_add_rmsnorm(st.pending, st.residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
    total = comm.wait(st.pending)
    if st.scale != 1.0:
        total = total * st.scale
    return pre_norm(norm, total, st.residual)


def micro_batch_forward(
    model: nn.Module,
    batches: Sequence[MicroBatch],
    comm: CommStream,
    stages: list[list[LayerStage]] | None = None,  # model_stages(model), worked out before
) -> torch.Tensor:  # [T, H]: the final-norm hidden states of the micro-batches in order
    if stages is None:
        stages = model_stages(model)
        if stages is None:
            raise ValueError(f"{type(model).__name__} has no micro-batch forward")
    try:
        outs = _forward(model.model, stages, batches, comm)
    except BaseException:
        comm.abandon()  # the all-reduces in flight give their buffers back
        raise
    comm.end()
    return torch.cat(outs)


def _forward(
    inner: LlamaModel,
    stages: list[list[LayerStage]],
    batches: Sequence[MicroBatch],
    comm: CommStream,
) -> list[torch.Tensor]:  # each micro-batch's final-norm hidden states [Tm, H]
    streams = []
    for mb in batches:  # the embedding's own all-reduce runs in place, on the main stream
        hidden = inner.embed(mb.input_ids)  # [Tm, H]
        streams.append(_Stream(mb, PendingAllReduce(hidden, None, None)))
    for layer_stages in stages:
        for stage in layer_stages:
            for st in streams:
                hidden, st.residual = _reduce_norm(comm, st, stage.norm)
                with forward_context(st.batch.meta):
                    partial = stage.fn(st.batch.positions, hidden)
                st.pending, st.scale = comm.launch(partial), stage.scale
    return [_reduce_norm(comm, st, inner.norm)[0] for st in streams]
