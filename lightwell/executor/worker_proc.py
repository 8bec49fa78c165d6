"""The main loop of a tensor-parallel worker process (ranks 1..N-1).

Builds its ``Worker`` (joining the process group), then serves rank 0's commands from a pipe
in order. Any exception is sent back as a ``Failure`` and the process exits at once, so its
sockets close and the collectives that rank 0 is blocked in fail instead of hanging.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection, wait

import torch
from tqdm import tqdm

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
    StageTimes,
    Started,
)

CLOSE_WAIT_S = 10.0  # for the replies still queued at exit


def worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """Process entry point (spawned)."""
    from lightwell.worker.worker import Worker

    # Ctrl-C reaches the whole process group: rank 0 alone handles it (and shuts the workers
    # down), so an interrupted answer in `lightwell chat` leaves the workers serving. SIGTERM
    # too (systemd sends it to every process of the service): rank 0 stops the workers, and
    # a worker whose rank-0 process is gone, however it ended, exits at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    # tqdm's default lock is a multiprocessing semaphore, which a process ending by os._exit
    # leaves to the resource tracker (a "leaked semaphore" warning): a thread lock here
    tqdm.set_lock(threading.RLock())
    replies = _Replies(conn)
    try:
        conn.send(Started(rank))
        with torch.inference_mode():
            worker = Worker(config, rank, init_method)
            conn.send(Ready(rank))
            _serve(worker, rank, conn, replies)
    except (EOFError, KeyboardInterrupt):
        os._exit(0)  # rank 0 is gone: nothing to report to
    except BaseException:
        try:
            replies.close()  # what was replied before goes first
            conn.send(Failure(rank, traceback.format_exc()))
        finally:
            os._exit(1)
    replies.close()
    # Shut down cleanly: skip the interpreter's teardown, where the C++ side of a destroyed
    # process group can still abort the process ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent() -> None:
    """A thread that ends this process when its parent's does (even by SIGKILL, or while this
    one waits in a collective that would never return)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="lightwell-parent-watch", daemon=True).start()


class _Replies:
    """Replies sent from a thread of their own, in order: the last pipeline stage goes on to
    its next step while rank 0, busy sending that step's activations, has not read the last
    output yet (a large one would otherwise block both in a full pipe)."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.queue = conn, queue.Queue()
        self.thread = threading.Thread(target=self._run, name="lightwell-replies", daemon=True)
        self.thread.start()

    def send(self, msg: object) -> None:
        self.queue.put(msg)

    def _run(self) -> None:
        while (msg := self.queue.get()) is not None:
            try:
                self.conn.send(msg)
            except OSError:
                return  # rank 0 is gone

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(CLOSE_WAIT_S)


def _serve(worker: object, rank: int, conn: Connection, replies: _Replies) -> None:
    while True:
        msg: Command = conn.recv()
        if isinstance(msg, Shutdown):
            worker.shutdown()
            replies.send(Result(rank, None))
            return
        value = _handle(worker, msg)
        if not isinstance(msg, ExecuteModel) or worker.returns_output:
            replies.send(Result(rank, value))  # a step's: the last pipeline stage's output


def _handle(worker: object, msg: Command) -> object:
    if isinstance(msg, ExecuteModel):
        return worker.execute_model(msg.sched)
    if isinstance(msg, LoadModel):
        return worker.load_model()
    if isinstance(msg, DetermineNumBlocks):
        return worker.determine_num_blocks(msg.resolved)
    if isinstance(msg, StageTimes):
        return worker.runner.stage.snapshot() if worker.runner.stage else None
    if isinstance(msg, InitKVCache):
        return worker.init_kv_cache(msg.num_blocks, msg.resolved)
    raise TypeError(f"unknown command {type(msg).__name__}")
