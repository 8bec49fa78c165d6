"""One pipeline stage's forward: the previous stage's activations in, its own out, and the
stage's time counters (busy and waiting) for utilisation figures.

On a GPU the host's time in a step says little about the stage's work (a stage before the
last returns once its kernels are queued; the last waits for its tokens, and so for the stages
before it), so each step is also timed on the device: an event when the step's input is there
(after the receive, which the stream waits for) and one after its last kernel is queued
(``end_step``: before the send to the next stage, or after the last stage's sampling);
``gpu_busy_s`` sums their intervals.

A step runs eagerly (``forward``) or replays the stage's CUDA graph (``replay``): either way
the point-to-point receive and send happen outside the model's forward, so a graph holds no
communication between stages. A graph of a stage after the first reads the received
``(hidden, residual)`` from its static buffer (in place of the input ids' embedding); a graph
of a stage before the last returns its ``(hidden, residual)`` (in place of the final hidden).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightwell.attention.metadata import AttentionMetadata, forward_context
from lightwell.distributed import pipeline as pp

if TYPE_CHECKING:
    from lightwell.worker.cuda_graph import CudaGraphRunner

StageOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class PipelineStage:
    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        # seconds in steps (less the wait for the previous stage's activations), seconds
        # waited for them, and steps run: a stage's utilisation is busy_s over wall time
        self.times = {"busy_s": 0.0, "recv_wait_s": 0.0, "steps": 0}
        self.on_gpu = device.type == "cuda"
        if self.on_gpu:
            self.times["gpu_busy_s"] = 0.0  # device time from each step's input to its end
        self._start: torch.cuda.Event | None = None  # the current step's
        self._timed: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
    ) -> torch.Tensor | None:  # [T, H] on the last stage; None (sent on) before it
        inter = self.receive(len(input_ids))  # [2, T, H] or None
        out = self.model(input_ids, positions, None if inter is None else (inter[0], inter[1]))
        return self.deliver(out)

    def replay(
        self,
        graphs: CudaGraphRunner,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        key: tuple[str, int],  # graphs.graph_for(meta)
        deferred: tuple[torch.Tensor, torch.Tensor] | None = None,  # as CudaGraphRunner.run's
    ) -> torch.Tensor | None:  # [T, H] on the last stage; None (sent on) before it
        """The step from the stage's graph ``key``: the received activations are copied into
        the graph's static buffer, its output sent on from the graph's output buffers."""
        inter = self.receive(len(input_ids))  # [2, T, H] or None
        return self.deliver(graphs.run(input_ids, positions, meta, key, inter, deferred))

    def graph_forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        inter: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, H], [T, H]) received
    ) -> StageOutput:  # [T, H] on the last stage; ([T, H], [T, H]) before it
        """What a stage's CUDA graph captures: the stage's layers, no send or receive."""
        with forward_context(meta):
            return self.model(input_ids, positions, inter)

    def graph_input(self) -> tuple[int, torch.dtype] | None:
        """``(hidden_size, dtype)`` of the activations a graph takes from the previous stage;
        None on the first stage (its graphs take the input ids)."""
        if pp.is_first_stage():
            return None
        return self.model.config.hidden_size, self.dtype

    def receive(self, num_tokens: int) -> torch.Tensor | None:  # [2, T, H]
        """The previous stage's ``(hidden, residual)``; None on the first stage. The step's
        device interval starts once they are there."""
        if pp.is_first_stage():
            self._mark_start()
            return None
        t0 = time.perf_counter()
        hidden_size = self.model.config.hidden_size
        inter = pp.recv_activations(num_tokens, hidden_size, self.dtype, self.device)
        self.times["recv_wait_s"] += time.perf_counter() - t0
        self._mark_start()
        return inter

    def _mark_start(self) -> None:
        if self.on_gpu:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end_step(self) -> None:
        """The step's work is queued (sampling included): its device interval ends here."""
        if self._start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timed.append((self._start, end))
        self._start = None
        self._add_timed(wait=False)

    def _add_timed(self, wait: bool) -> None:
        """Add the finished intervals (all of them with ``wait``) to ``gpu_busy_s``."""
        while self._timed and (wait or self._timed[0][1].query()):
            start, end = self._timed.popleft()
            end.synchronize()
            self.times["gpu_busy_s"] += start.elapsed_time(end) / 1e3

    def snapshot(self) -> dict:
        """The counters, every step's device time included."""
        self._add_timed(wait=True)
        return dict(self.times)

    def deliver(self, out: StageOutput) -> torch.Tensor | None:  # [T, H] on the last stage
        """The last stage's hidden states; before it, send ``(hidden, residual)`` on."""
        if pp.is_last_stage():
            return out
        self.end_step()  # (the send may wait for the next stage: not this stage's work)
        pp.send_activations(*out)
        return None

    def count_step(self, seconds: float, waited_before: float) -> None:
        """A step of ``seconds`` in all, begun when ``recv_wait_s`` was ``waited_before``."""
        self.times["busy_s"] += seconds - (self.times["recv_wait_s"] - waited_before)
        self.times["steps"] += 1
