"""Executors drive the worker(s): one process per rank, rank 0 in the engine's process."""

from __future__ import annotations

from typing import Any, Protocol

from lightwell.config import EngineConfig
from lightwell.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def load_model(self): ...
    def determine_num_blocks(self, resolved: EngineConfig) -> int: ...
    def init_kv_cache(self, num_blocks: int, resolved: EngineConfig) -> None: ...
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...
    # Launch and return at once: a handle whose result() is the ModelRunnerOutput (the
    # engine's overlapped loop, --async-scheduling).
    def execute_model_async(self, sched: SchedulerOutput) -> Any: ...

    # Whether a step launched with ``sched.grammar_later`` holds its sampling back until the
    # handle's ``sample(grammar)`` (the sampling rank is this process's worker).
    defers_sampling: bool

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel.world_size == 1:
        from lightwell.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    from lightwell.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
