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
consuming it in the fused residual-add + RMSNorm. Every token sees the operations of the
plain forward, except that the plain forward may fuse that add + norm into the all-reduce
(``reduce_norm``, hostmem at decode sizes), which this one never does (the same values, the
norm within its last bit); only the row blocks the kernels run on differ.

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
from lightwell.layers.norm import pre_norm
from lightwell.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel


def supports_two_batch(model: nn.Module) -> bool:
    """``model`` is a causal LM whose ``.model`` this module can run in two micro-batches."""
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


def _attention_stage(
    layer: LlamaDecoderLayer,
    positions: torch.Tensor,  # [Tm]
    hidden: torch.Tensor,  # [Tm, H]: the reduced output of the previous stage
    residual: torch.Tensor | None,  # [Tm, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # (o_proj partial sum [Tm, H], residual [Tm, H])
    hidden, residual = pre_norm(layer.input_layernorm, hidden, residual)
    return layer.self_attn.partial(positions, hidden), residual


def _mlp_stage(
    layer: LlamaDecoderLayer,
    positions: torch.Tensor,  # [Tm]
    hidden: torch.Tensor,  # [Tm, H]
    residual: torch.Tensor,  # [Tm, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # (down_proj partial sum [Tm, H], residual [Tm, H])
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    return layer.mlp.partial(hidden), residual


def micro_batch_forward(
    model: nn.Module, batches: Sequence[MicroBatch], comm: CommStream
) -> torch.Tensor:  # [T, H]: the final-norm hidden states of the micro-batches in order
    inner: LlamaModel = model.model
    streams = []
    for mb in batches:  # the embedding's own all-reduce runs in place, on the main stream
        hidden = inner.embed(mb.input_ids)  # [Tm, H]
        streams.append(_Stream(mb, PendingAllReduce(hidden, None, None)))
    for layer in inner.layers:
        for stage in (_attention_stage, _mlp_stage):
            for st in streams:
                hidden = comm.wait(st.pending)
                with forward_context(st.batch.meta):
                    partial, st.residual = stage(layer, st.batch.positions, hidden, st.residual)
                st.pending = comm.launch(partial)
    outs = [inner.norm(comm.wait(st.pending), st.residual)[0] for st in streams]
    return torch.cat(outs)
