"""When a step runs as two micro-batches with their all-reduces on a second CUDA stream.

On only under tensor parallelism on GPU with ``--dual-stream``, for steps of at least
``--dual-stream-min-tokens`` tokens, for models ``lightwell.models.two_batch`` supports;
a no-op on CPU. Tests build it with ``stream=None`` to run the same split in order on CPU.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lightwell.attention.metadata import AttentionMetadata
from lightwell.attention.micro_batch import split_batch
from lightwell.config import ParallelConfig
from lightwell.distributed.overlap import CommStream
from lightwell.distributed.parallel_state import get_tp_size
from lightwell.models.two_batch import supports_two_batch, two_batch_forward

logger = logging.getLogger(__name__)


class TwoBatchOverlap:
    def __init__(self, model: nn.Module, min_tokens: int, stream: torch.cuda.Stream | None):
        self.model = model
        self.min_tokens = max(2, min_tokens)
        self.comm = CommStream(stream)

    @classmethod
    def create(
        cls, model: nn.Module, parallel: ParallelConfig, device: torch.device
    ) -> TwoBatchOverlap | None:
        if not parallel.dual_stream or get_tp_size() == 1 or device.type != "cuda":
            return None
        if not supports_two_batch(model):
            logger.warning(
                "--dual-stream: %s has no two-batch forward; running it plain", type(model).__name__
            )
            return None
        # high priority: an all-reduce's programs are scheduled ahead of the other
        # micro-batch's queued compute, so the link starts moving bytes as early as possible
        stream = torch.cuda.Stream(device, priority=-1)
        return cls(model, parallel.dual_stream_min_tokens, stream)

    def applies(self, meta: AttentionMetadata) -> bool:
        if meta.num_tokens < self.min_tokens:
            return False
        return meta.max_query_len > 1 or meta.num_reqs >= 2

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        return two_batch_forward(self.model, split_batch(input_ids, positions, meta), self.comm)
