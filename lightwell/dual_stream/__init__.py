"""The dual-stream overlap (``--dual-stream``): a step runs as micro-batches
(``--dual-stream-micro-batches``, two by default) whose all-reduces go on a second CUDA stream
while the other micro-batches compute.

Everything about it lives in this package, behind ``DualStream`` (``create`` / ``applies`` /
``forward``), which the model runner calls for the steps it applies to:

- ``split``: one step's flat batch cut into micro-batches (metadata included);
- ``comm``: the second stream and the all-reduces launched on it;
- ``forward``: the forward over micro-batches, with each decoder layer as stages (the model
  files keep a plain forward; the stages of the families it supports are written here).

On only under tensor parallelism on GPU with ``--dual-stream``, for steps of at least
``--dual-stream-min-tokens`` tokens, for models ``forward`` supports; a no-op on CPU. Tests
build ``DualStream`` with ``stream=None`` to run the same split in order on CPU.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lightwell.attention.metadata import AttentionMetadata
from lightwell.config import ParallelConfig
from lightwell.distributed.parallel_state import get_tp_size
from lightwell.dual_stream.comm import CommStream
from lightwell.dual_stream.forward import micro_batch_forward, model_stages
from lightwell.dual_stream.split import can_split, split_batch

logger = logging.getLogger(__name__)


class DualStream:
    def __init__(
        self,
        model: nn.Module,
        min_tokens: int,
        stream: torch.cuda.Stream | None,
        micro_batches: int = 2,
    ):
        if micro_batches < 2:
            raise ValueError(f"micro_batches must be >= 2, got {micro_batches}")
        stages = model_stages(model)
        if stages is None:
            raise ValueError(f"{type(model).__name__} has no micro-batch forward")
        self.model, self.stages = model, stages
        self.parts = micro_batches
        self.min_tokens = max(2, min_tokens)
        self.comm = CommStream(stream)

    @classmethod
    def create(
        cls, model: nn.Module, parallel: ParallelConfig, device: torch.device
    ) -> DualStream | None:
        if not parallel.dual_stream or get_tp_size() == 1 or device.type != "cuda":
            return None
        if model_stages(model) is None:
            name = type(model).__name__
            logger.warning("--dual-stream: %s has no micro-batch forward; running it plain", name)
            return None
        # high priority: an all-reduce's programs are scheduled ahead of the other
        # micro-batch's queued compute, so the link starts moving bytes as early as possible
        stream = torch.cuda.Stream(device, priority=-1)
        return cls(
            model, parallel.dual_stream_min_tokens, stream, parallel.dual_stream_micro_batches
        )

    def applies(self, meta: AttentionMetadata) -> bool:
        return meta.num_tokens >= self.min_tokens and can_split(meta, self.parts)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        batches = split_batch(input_ids, positions, meta, self.parts)
        return micro_batch_forward(self.model, batches, self.comm, self.stages)
