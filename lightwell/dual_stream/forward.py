"""Micro-batch forward of Llama-family models: one micro-batch's all-reduce runs on the comm
stream while the others compute.

Per decoder layer, with A and B the two halves of the step (``dual_stream.split``):

    main stream: attn(A) | attn(B) | norm+mlp(A) | norm+mlp(B) | attn(A) of the next layer ...
    comm stream:          AR(A)    | AR(B)       | AR(A)       | AR(B) ...

With three or more micro-batches (``--dual-stream-micro-batches``) each all-reduce has the
stages of all the others to hide under, not one: two halves leave a gap wherever one
micro-batch's attention stage is shorter than the other's all-reduce.

Each stage ends with a row-parallel partial sum (o_proj, down_proj) whose all-reduce is launched
on the comm stream; the next stage of the same micro-batch starts by waiting for it and
consuming it in the fused residual-add + RMSNorm. Every token
sees the operations of the plain forward, except that the plain forward may fuse that add +
norm into the all-reduce kernel (``reduce_norm``, hostmem at decode sizes), which this one
does not (the same values, the norm within its last bit); only the row blocks the kernels
run on differ.

Supported: ``LlamaModel`` and its subclasses that keep its ``forward``, whose decoder layers'
``forward`` this module knows as stages (``STAGES``, keyed by the class that defines the
layer's ``forward``): Llama, Mistral, Qwen2, Qwen3 (two stages a layer), MiniCPM (the same,
each all-reduced output scaled) and Command-R (one stage a layer: its parallel block's
attention + MLP partial sums under one all-reduce). Model files know nothing of this: a family
whose layer has another ``forward`` runs the plain forward until a stage builder for it is
added here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightwell.attention.metadata import forward_context
from lightwell.dual_stream.comm import CommStream, PendingAllReduce
from lightwell.dual_stream.split import MicroBatch
from lightwell.layers.norm import pre_norm
from lightwell.models.cohere import CohereDecoderLayer
from lightwell.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from lightwell.models.minicpm import MiniCPMDecoderLayer


@dataclass
class LayerStage:
    """One stage of a decoder layer in micro-batches: ``norm`` (with the residual add) of the
    previous stage's all-reduced output times its ``scale``, then ``fn(positions, normed)``,
    this rank's partial sum [T, H] (all-reduced by the overlap)."""

    norm: nn.Module
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scale: float = 1.0  # on the all-reduced output (MiniCPM's residual scale)


def _llama_stages(layer: LlamaDecoderLayer, scale: float = 1.0) -> list[LayerStage] | None:
    """Attention, then MLP, each ending in its row-parallel partial sum; None where the
    layer's attention or MLP is not Llama's (no partial-sum form known here)."""
    if type(layer.mlp) is not LlamaMLP or type(layer.self_attn).forward is not (
        LlamaAttention.forward
    ):
        return None
    mlp = layer.mlp
    return [
        LayerStage(layer.input_layernorm, layer.self_attn.partial, scale),
        LayerStage(layer.post_attention_layernorm, lambda _pos, h: mlp.partial(h), scale),
    ]


def _minicpm_stages(layer: MiniCPMDecoderLayer) -> list[LayerStage] | None:
    """Llama's stages, each all-reduced output times the residual scale."""
    return _llama_stages(layer, layer.residual_scale)


def _cohere_stages(layer: CohereDecoderLayer) -> list[LayerStage]:
    """One stage a layer: the parallel block's attention + MLP partial sums, summed before
    their single all-reduce."""

    def block(positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return layer.self_attn(positions, hidden) + layer.mlp(hidden)  # (both partial)

    return [LayerStage(layer.input_layernorm, block)]


# The class that defines a decoder layer's ``forward`` -> the stages that run that forward.
STAGES: dict[type, Callable[[nn.Module], list[LayerStage] | None]] = {
    LlamaDecoderLayer: _llama_stages,
    MiniCPMDecoderLayer: _minicpm_stages,
    CohereDecoderLayer: _cohere_stages,
}


def model_stages(model: nn.Module) -> list[list[LayerStage]] | None:
    """Every decoder layer's stages, in order; None where ``model`` (a causal LM) has no
    micro-batch forward. Worked out once per model (``DualStream``), not per step."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel) or type(inner).forward is not LlamaModel.forward:
        return None
    stages = [_stages(layer) for layer in inner.layers]
    return None if any(st is None for st in stages) else stages


def supports_micro_batches(model: nn.Module) -> bool:
    """``model`` is a causal LM whose ``.model`` this module can run in micro-batches."""
    return model_stages(model) is not None


def _stages(layer: nn.Module) -> list[LayerStage] | None:
    """The layer's stages, where this module knows its ``forward`` (``STAGES``)."""
    builder = STAGES.get(_owner(type(layer), "forward"))
    return None if builder is None else builder(layer)


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
    norm (``pre_norm``)."""
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
