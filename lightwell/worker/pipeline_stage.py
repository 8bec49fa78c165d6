"""One pipeline stage's forward: the previous stage's activations in, its own out, and the
stage's time counters (busy and waiting) for utilisation figures."""

from __future__ import annotations

import time

import torch
from torch import nn

from lightwell.distributed import pipeline as pp


class PipelineStage:
    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        # seconds in steps (less the wait for the previous stage's activations), seconds
        # waited for them, and steps run: a stage's utilisation is busy_s over wall time
        self.times = {"busy_s": 0.0, "recv_wait_s": 0.0, "steps": 0}

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
    ) -> torch.Tensor | None:  # [T, H] on the last stage; None (sent on) before it
        inter = None
        if not pp.is_first_stage():
            t0 = time.perf_counter()
            hidden_size = self.model.config.hidden_size
            inter = pp.recv_activations(len(input_ids), hidden_size, self.dtype, self.device)
            self.times["recv_wait_s"] += time.perf_counter() - t0
        out = self.model(input_ids, positions, inter)
        if pp.is_last_stage():
            return out
        pp.send_activations(*out)
        return None

    def count_step(self, seconds: float, waited_before: float) -> None:
        """A step of ``seconds`` in all, begun when ``recv_wait_s`` was ``waited_before``."""
        self.times["busy_s"] += seconds - (self.times["recv_wait_s"] - waited_before)
        self.times["steps"] += 1
