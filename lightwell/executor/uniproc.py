"""The single-process executor: the worker lives in the engine's own process."""

from __future__ import annotations

import gc

import torch

from lightwell.config import EngineConfig
from lightwell.scheduler.output import ModelRunnerOutput, SchedulerOutput
from lightwell.worker.pending_step import PendingStep
from lightwell.worker.worker import ModelInfo, Worker


class UniProcExecutor:
    defers_sampling = True  # the worker samples in this process

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, rank=0)

    def load_model(self) -> ModelInfo:
        return self.worker.load_model()

    def determine_num_blocks(self, resolved: EngineConfig) -> int:
        return self.worker.determine_num_blocks(resolved)

    def init_kv_cache(self, num_blocks: int, resolved: EngineConfig) -> None:
        self.worker.init_kv_cache(num_blocks, resolved)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def execute_model_async(self, sched: SchedulerOutput) -> PendingStep:
        """Launch the step and return at once; ``.result()`` is its ModelRunnerOutput."""
        return self.worker.launch(sched)

    def shutdown(self) -> None:
        """Free the model, KV cache and CUDA graphs now, so another engine fits on the device."""
        if self.worker is None:
            return
        on_cuda = self.worker.device.type == "cuda"
        self.worker.shutdown()
        self.worker = None
        gc.collect()  # the runner and its CUDA graphs reference each other
        if on_cuda:
            torch.cuda.empty_cache()
