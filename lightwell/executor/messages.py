"""What rank 0 and the worker processes say to each other: typed, picklable messages only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightwell.config import EngineConfig
from lightwell.scheduler.output import SchedulerOutput


class WorkerError(RuntimeError):
    """A tensor-parallel worker process failed (its traceback is in the message)."""


# ---- rank 0 -> workers --------------------------------------------------------------------
@dataclass(frozen=True)
class LoadModel:
    pass


@dataclass(frozen=True)
class DetermineNumBlocks:
    resolved: EngineConfig


@dataclass(frozen=True)
class InitKVCache:
    num_blocks: int
    resolved: EngineConfig


@dataclass(frozen=True)
class ExecuteModel:
    """Run one step; no reply (rank 0's output is the step's output)."""

    sched: SchedulerOutput


@dataclass(frozen=True)
class StageTimes:
    """Reply with the rank's pipeline-stage time counters (``PipelineStage.times``), or None."""


@dataclass(frozen=True)
class Shutdown:
    pass


Command = LoadModel | DetermineNumBlocks | InitKVCache | ExecuteModel | StageTimes | Shutdown


# ---- workers -> rank 0 --------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """The worker process is up (imports done) and about to join the process group."""

    rank: int


@dataclass(frozen=True)
class Ready:
    """The worker joined the process group and waits for commands."""

    rank: int


@dataclass(frozen=True)
class Result:
    rank: int
    value: Any


@dataclass(frozen=True)
class Failure:
    """The worker raised; it exits right after sending this."""

    rank: int
    traceback: str

    def error(self) -> WorkerError:
        return WorkerError(f"tensor-parallel worker rank {self.rank} failed:\n{self.traceback}")
