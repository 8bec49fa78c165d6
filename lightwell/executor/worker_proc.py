"""The main loop of a tensor-parallel worker process (ranks 1..N-1).

Builds its ``Worker`` (joining the process group), then serves rank 0's commands from a pipe
in order. Any exception is sent back as a ``Failure`` and the process exits at once, so its
sockets close and the collectives that rank 0 is blocked in fail instead of hanging.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from lightwell.config import EngineConfig
from lightwell.executor.messages import (
    Command,
    DetermineNumBlocks,
    ExecuteModel,
    Failure,
    InitKVCache,
    LoadModel,
    Ready,
    Result,
    Shutdown,
    Started,
)


def worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """Process entry point (spawned)."""
    from lightwell.worker.worker import Worker

    # Ctrl-C reaches the whole process group: rank 0 alone handles it (and shuts the workers
    # down), so an interrupted answer in `lightwell chat` leaves the workers serving
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send(Started(rank))
        with torch.inference_mode():
            worker = Worker(config, rank, init_method)
            conn.send(Ready(rank))
            _serve(worker, rank, conn)
    except (EOFError, KeyboardInterrupt):
        os._exit(0)  # rank 0 is gone: nothing to report to
    except BaseException:
        try:
            conn.send(Failure(rank, traceback.format_exc()))
        finally:
            os._exit(1)
    # Shut down cleanly: skip the interpreter's teardown, where the C++ side of a destroyed
    # process group can still abort the process ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(worker: object, rank: int, conn: Connection) -> None:
    while True:
        msg: Command = conn.recv()
        if isinstance(msg, Shutdown):
            worker.shutdown()
            conn.send(Result(rank, None))
            return
        value = _handle(worker, msg)
        if not isinstance(msg, ExecuteModel):
            conn.send(Result(rank, value))


def _handle(worker: object, msg: Command) -> object:
    if isinstance(msg, ExecuteModel):
        return worker.execute_model(msg.sched)
    if isinstance(msg, LoadModel):
        return worker.load_model()
    if isinstance(msg, DetermineNumBlocks):
        return worker.determine_num_blocks(msg.resolved)
    if isinstance(msg, InitKVCache):
        return worker.init_kv_cache(msg.num_blocks, msg.resolved)
    raise TypeError(f"unknown command {type(msg).__name__}")
