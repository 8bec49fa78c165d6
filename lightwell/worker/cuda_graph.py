"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up.

A decode-only batch of R requests replays the graph of the smallest captured size B >= R.
Rows R..B-1 are padding: token 0 at position 0, slot -1 (nothing stored), seq_len 1 reading
block 0 (finite garbage, discarded). The Triton attention wrapper picks its grid and split-KV
count from host-side metadata at capture (max_seq_len = the context length), and each split's
range is computed inside the kernel, so a replay is correct for any seq_lens up to that length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from lightwell.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class CudaGraphRunner:
    def __init__(
        self,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        forward_fn: Callable[..., torch.Tensor],
    ) -> None:
        """``forward_fn(input_ids, positions, meta) -> hidden``: what to capture (the runner's
        forward, which may split the batch for the dual-stream overlap)."""
        self.forward_fn = forward_fn
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        width = -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=i64, device=device)  # [B]
        self.positions = torch.zeros(b, dtype=i64, device=device)  # [B]
        self.seq_lens = torch.ones(b, dtype=i32, device=device)  # [B]
        self.block_table = torch.zeros(b, width, dtype=i32, device=device)  # [B, W]
        self.slot_mapping = torch.full((b,), -1, dtype=i64, device=device)  # [B]
        self.query_start_loc = torch.arange(b + 1, dtype=i32, device=device)  # [B+1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            num_decodes=size,
        )

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            args = (self.input_ids[:size], self.positions[:size], meta)
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self.forward_fn(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward_fn(*args)
            self.graphs[size] = graph
            self.outputs[size] = out
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            elapsed,
        )
        return elapsed

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            meta.max_query_len == 1
            and meta.num_reqs <= self.max_batch
            and meta.num_tokens == meta.num_reqs
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [R]
        positions: torch.Tensor,  # [R]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [R, H]
        r = meta.num_reqs
        size = next(s for s in self.sizes if s >= r)
        self.input_ids[:r].copy_(input_ids)
        self.positions[:r].copy_(positions)
        self.seq_lens[:r].copy_(meta.seq_lens)
        width = meta.block_table.shape[1]
        self.block_table[:r, :width].copy_(meta.block_table)
        self.slot_mapping[:r].copy_(meta.slot_mapping)
        if size > r:
            self.input_ids[r:size].zero_()
            self.positions[r:size].zero_()
            self.seq_lens[r:size].fill_(1)
            self.block_table[r:size].zero_()
            self.slot_mapping[r:size].fill_(-1)
        self.graphs[size].replay()
        return self.outputs[size][:r]
