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

Supported: ``LlamaModel`` with plain ``LlamaDecoderLayer`` layers (Llama, Mistral, Qwen2,
Qwen3: attention subclasses that keep ``LlamaAttention.forward``). Others run the plain forward.
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
from lightwell.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel


def supports_micro_batches(model: nn.Module) -> bool:
    """``model`` is a causal LM whose ``.model`` this module can run in micro-batches."""
    inner = getattr(model, "model", None)
    if type(inner) is not LlamaModel:
        return False
    return all(
        type(layer) is LlamaDecoderLayer
        and type(layer.mlp) is LlamaMLP
        and type(layer.self_attn).forward is LlamaAttention.forward
        for layer in inner.layers
    )


@dataclass
class _Stream:
    batch: MicroBatch
    pending: PendingAllReduce
    residual: torch.Tensor | None = None  # [Tm, H]


def _reduce_norm(
    comm: CommStream,
    pending: PendingAllReduce,
    norm: nn.Module,
    residual: torch.Tensor | None,  # [Tm, H]; None before the first layer
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalised [Tm, H], new residual [Tm, H])
    """A stage's input: the previous stage's sum through the residual add + norm (``pre_norm``),
    the sum itself fused into the norm where the all-reduce allows (hostmem-copy-int8)."""
    if residual is not None and isinstance(norm, RMSNorm):
        fused = comm.wait_add_rmsnorm(pending, residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
    return pre_norm(norm, comm.wait(pending), residual)


def _attention_stage(
    layer: LlamaDecoderLayer,
    positions: torch.Tensor,  # [Tm]
    hidden: torch.Tensor,  # [Tm, H]: normalised
) -> torch.Tensor:  # o_proj's partial sum [Tm, H]
    return layer.self_attn.partial(positions, hidden)


def _mlp_stage(
    layer: LlamaDecoderLayer,
    positions: torch.Tensor,  # [Tm]
    hidden: torch.Tensor,  # [Tm, H]: normalised
) -> torch.Tensor:  # down_proj's partial sum [Tm, H]
    return layer.mlp.partial(hidden)


def micro_batch_forward(
    model: nn.Module, batches: Sequence[MicroBatch], comm: CommStream
) -> torch.Tensor:  # [T, H]: the final-norm hidden states of the micro-batches in order
    try:
        outs = _forward(model.model, batches, comm)
    except BaseException:
        comm.abandon()  # the all-reduces in flight give their buffers back
        raise
    comm.end()
    return torch.cat(outs)


def _forward(
    inner: LlamaModel, batches: Sequence[MicroBatch], comm: CommStream
) -> list[torch.Tensor]:  # each micro-batch's final-norm hidden states [Tm, H]
    streams = []
    for mb in batches:  # the embedding's own all-reduce runs in place, on the main stream
        hidden = inner.embed(mb.input_ids)  # [Tm, H]
        streams.append(_Stream(mb, PendingAllReduce(hidden, None, None)))
    for layer in inner.layers:
        for norm, stage in (
            (layer.input_layernorm, _attention_stage),
            (layer.post_attention_layernorm, _mlp_stage),
        ):
            for st in streams:
                hidden, st.residual = _reduce_norm(comm, st.pending, norm, st.residual)
                with forward_context(st.batch.meta):
                    partial = stage(layer, st.batch.positions, hidden)
                st.pending = comm.launch(partial)
    return [_reduce_norm(comm, st.pending, inner.norm, st.residual)[0] for st in streams]
