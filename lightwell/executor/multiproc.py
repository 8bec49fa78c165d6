"""The tensor-parallel executor: one process per rank, rank 0 in the engine's process.

Rank r > 0 runs ``worker_proc.worker_main`` in a spawned process and takes typed commands
(``messages``) from a pipe; rank 0 sends each command to every worker, runs it itself, and
collects the replies. Steps (``ExecuteModel``) get no reply: the ranks meet in the model's
collectives, and rank 0's sampled tokens are the step's output (only rank 0 samples).

Failures: a worker that raises sends its traceback and exits; a monitor thread notices any
worker process ending and, under NCCL, aborts rank 0's process group so a collective blocked on
the dead peer fails (gloo fails on its own when the peer's sockets close). Rank 0 then raises a
``WorkerError`` carrying the worker's traceback instead of hanging. At start-up rank 0 joins the
process group only once every worker has reported ``Started`` (so a worker that cannot even
import, e.g. a script without the ``if __name__ == "__main__"`` guard that spawn needs, fails
fast instead of leaving rank 0 in the rendezvous).

Stopping: ``shutdown()`` sends every worker ``Shutdown`` and waits for it; it also runs at the
interpreter's exit, and a default SIGTERM becomes ``SystemExit(143)`` while the executor lives
(``sigterm``). Workers of a command that Ctrl-C or SIGTERM cut short (at start-up, or in a
collective rank 0 left) are killed instead: they may never read the message.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from lightwell.config import EngineConfig
from lightwell.executor import sigterm
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
    WorkerError,
)
from lightwell.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 2.0  # after rank 0 fails: how long a worker has to show it failed too
FAILURE_WAIT_S = 10.0  # how long to wait for a dead worker's traceback
SHUTDOWN_WAIT_S = 15.0


class _LocalPending:
    """Rank 0's launched step; a worker's failure surfaces from ``result()`` as a WorkerError."""

    def __init__(self, executor: MultiprocExecutor, pending: Any) -> None:
        self.executor = executor
        self.pending = pending

    def result(self) -> ModelRunnerOutput:
        return self.executor._run_local(self.pending.result)

    def sample(self, grammar: Any) -> None:
        """A step launched with ``grammar_later``: rank 0 samples it with this mask."""
        self.executor._run_local(lambda: self.pending.sample(grammar))


class _StageOutput:
    """A step launched into the pipeline: ``result()`` waits for the last stage's output
    (steps come back in launch order)."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self.executor = executor

    def result(self) -> ModelRunnerOutput:
        return self.executor._recv_output()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    defers_sampling = False  # set once the ranks are up: whether rank 0 samples

    def __init__(self, config: EngineConfig) -> None:
        import torch.multiprocessing as mp

        _check_devices(config)
        self.config = config
        self.worker = None
        self.closing = False
        self.failure: str | None = None  # set by the monitor when a worker or node goes away
        par = config.parallel
        init_method, self.store, self.remote = _rendezvous(config)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        # SIGTERM: an orderly exit (code 143) through shutdown(); shutdown() also runs at exit
        # before multiprocessing's own exit hook (registered earlier), which would terminate
        # the workers first
        self.sigterm = sigterm.install()
        atexit.register(self.shutdown)
        self.interrupted = False  # Ctrl-C / SIGTERM left a command half done
        try:
            self._spawn(ctx, init_method)
            self._wait_started()
            if self.remote is not None:
                self.remote.accept_all()
                self.conns += [self.remote.conns[r] for r in sorted(self.remote.conns)]
            # pipeline stages: the last stage's tensor rank 0 samples and returns the output
            out_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
            self.output_conn = self.conns[out_rank - 1] if out_rank > 0 else None
            self.defers_sampling = self.output_conn is None  # rank 0 samples, in this process
            threading.Thread(target=self._watch, name="lightwell-monitor", daemon=True).start()
            self.worker = self._run_local(lambda: _make_worker(config, init_method))
            for conn in self.conns:
                self._recv(conn, Ready)
        except BaseException as e:
            self.interrupted |= isinstance(e, (KeyboardInterrupt, SystemExit))
            self.shutdown()
            raise

    def _spawn(self, ctx: Any, init_method: str) -> None:
        from lightwell.executor.worker_proc import worker_main

        par = self.config.parallel
        for rank in range(1, par.world_size // par.nnodes):  # this node's; the others connect
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(self.config, rank, init_method, child),
                name=f"lightwell-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    # ---- the Executor interface ---------------------------------------------------------------
    def load_model(self) -> Any:
        info, _ = self._call(LoadModel(), self.worker.load_model)
        return info

    def determine_num_blocks(self, resolved: EngineConfig) -> int:
        """The smallest count over the ranks: every rank must hold every block."""
        mine, theirs = self._call(
            DetermineNumBlocks(resolved), lambda: self.worker.determine_num_blocks(resolved)
        )
        return min([mine, *theirs])

    def init_kv_cache(self, num_blocks: int, resolved: EngineConfig) -> None:
        self._call(
            InitKVCache(num_blocks, resolved),
            lambda: self.worker.init_kv_cache(num_blocks, resolved),
        )

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._send_all(ExecuteModel(sched))
        out = self._run_local(lambda: self.worker.execute_model(sched))
        return out if self.output_conn is None else self._recv_output()

    def execute_model_async(self, sched: SchedulerOutput) -> _LocalPending:
        """Launch the step on every rank; ``.result()`` waits for rank 0's tokens."""
        self._send_all(ExecuteModel(sched))
        if self.output_conn is not None:  # stage 0 runs here now; the output comes later
            self._run_local(lambda: self.worker.execute_model(sched))
            return _StageOutput(self)
        return _LocalPending(self, self._run_local(lambda: self.worker.launch(sched)))

    def stage_times(self) -> list[dict]:
        """Every rank's step time counters, in rank order (benchmarks: stage utilisation)."""
        mine, theirs = self._call(
            StageTimes(),
            lambda: self.worker.runner.stage.snapshot() if self.worker.runner.stage else None,
        )
        return [mine, *theirs]

    def shutdown(self) -> None:
        if self.closing:
            return
        self.closing = True
        try:
            self._stop_workers()
        finally:
            atexit.unregister(self.shutdown)
            if self.sigterm:
                sigterm.uninstall()

    def _stop_workers(self) -> None:
        if self.interrupted:  # they may be starting, or waiting in a collective rank 0 left
            for proc in self.procs:
                proc.kill()
        for conn in self.conns:
            try:
                conn.send(Shutdown())
            except OSError:
                pass
        worker, self.worker = self.worker, None
        if worker is not None:
            # Leaving the process group can block in NCCL teardown: never let it hang exit.
            done = threading.Thread(target=worker.shutdown, name="lightwell-tp-exit", daemon=True)
            done.start()
            done.join(SHUTDOWN_WAIT_S)
            if done.is_alive():
                logger.warning(
                    "rank 0 did not leave the process group within %.0f s", SHUTDOWN_WAIT_S
                )
        for proc, conn in zip(self.procs, self.conns):
            proc.join(SHUTDOWN_WAIT_S)
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop: killing it", proc.name)
                proc.kill()  # (workers ignore SIGTERM)
                proc.join(2.0)
            conn.close()
        if self.remote is not None:
            self.remote.close()

    # ---- plumbing -----------------------------------------------------------------------------
    def _wait_started(self) -> None:
        """A worker that cannot start fails here, not later inside the group's rendezvous."""
        try:
            for conn in self.conns:
                self._recv(conn, Started)
        except WorkerError as e:
            raise WorkerError(
                f"{e}. A tensor-parallel worker could not start: workers are spawned, so a "
                "script that builds the engine must do so under `if __name__ == '__main__':`"
            ) from e

    def _call(self, msg: Command, local: Callable[[], Any]) -> tuple[Any, list[Any]]:
        """Send ``msg`` to every worker, run ``local`` here, then collect the workers' replies."""
        self._send_all(msg)
        mine = self._run_local(local)
        return mine, [self._recv(conn, Result).value for conn in self.conns]

    def _send_all(self, msg: Command) -> None:
        for conn in self.conns:
            try:
                conn.send(msg)
            except OSError as e:
                raise self._worker_failure() or WorkerError("a worker process is gone") from e

    def _run_local(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (KeyboardInterrupt, SystemExit):
            self.interrupted = True
            raise
        except Exception as e:
            failure = self._worker_failure()
            if failure is None:
                raise
            raise failure from e

    def _recv(self, conn: Connection, kind: type) -> Any:
        try:
            reply = conn.recv()
        except (KeyboardInterrupt, SystemExit):
            self.interrupted = True
            raise
        except (EOFError, OSError) as e:
            raise self._worker_failure() or WorkerError("a worker process died") from e
        if isinstance(reply, Failure):
            raise reply.error()
        if not isinstance(reply, kind):
            raise WorkerError(f"expected {kind.__name__} from a worker, got {reply!r}")
        return reply

    def _recv_output(self) -> ModelRunnerOutput:
        """The last pipeline stage's output; any worker ending first raises instead."""
        ready = wait([self.output_conn, *self._watched()])
        if self.output_conn not in ready:
            raise self._worker_failure() or WorkerError("a worker process ended mid-step")
        return self._recv(self.output_conn, Result).value

    def _worker_failure(self) -> WorkerError | None:
        """The first failed worker's error, waiting briefly for it to arrive; None if every
        worker stays alive and silent (the failure was rank 0's own)."""
        if not wait([*self.conns, *self._watched()], timeout=FAILURE_GRACE_S):
            return None
        for i, conn in enumerate(self.conns):
            proc = self.procs[i] if i < len(self.procs) else None  # None: another node's
            gone = proc is not None and not proc.is_alive()
            try:
                if conn.poll(FAILURE_WAIT_S if gone else 0.0):
                    msg = conn.recv()
                    if isinstance(msg, Failure):
                        return msg.error()
            except (EOFError, OSError):
                gone = True  # its end of the pipe closed: it is exiting
            if gone and proc is None:
                return WorkerError(f"rank {i + 1} (on another node) is gone")
            if gone:
                proc.join(FAILURE_WAIT_S)
                return WorkerError(f"worker {proc.name} exited with code {proc.exitcode}")
        if self.failure is not None:
            return WorkerError(self.failure)
        return None

    def _watched(self) -> list[Any]:
        """What ends when a worker or node goes away: local process sentinels and the other
        nodes' idle connections."""
        nodes = self.remote.nodes if self.remote is not None else []
        return [*(p.sentinel for p in self.procs), *nodes]

    def _watch(self) -> None:
        """Monitor thread: when a worker process ends unexpectedly, unblock rank 0."""
        watched = self._watched()
        if not watched:
            return
        wait(watched)
        if self.closing:
            return
        self.failure = "a worker process or node ended unexpectedly"
        logger.error(self.failure)
        if self.worker is not None and self.worker.device.type == "cuda":
            self.worker.abort_collectives()


def _rendezvous(config: EngineConfig) -> tuple[str, Any, Any]:
    """(the process group's init method, node 0's fingerprint store, the other nodes'
    connections): a free port on 127.0.0.1 without --dist-init-addr."""
    from lightwell.executor import nodes

    if config.parallel.dist_init_addr is None:
        return f"tcp://127.0.0.1:{free_port()}", None, None
    host, port = nodes.addresses(config)
    if config.parallel.nnodes == 1:
        return f"tcp://{host}:{port + 1}", None, None
    return f"tcp://{host}:{port + 1}", nodes.publish_fingerprint(config), nodes.RemoteRanks(config)


def _make_worker(config: EngineConfig, init_method: str) -> Any:
    from lightwell.worker.worker import Worker

    return Worker(config, 0, init_method)


def _check_devices(config: EngineConfig) -> None:
    """Every rank needs its own GPU (checked here: a rank failing later would do so while
    rank 0 waits in the group's rendezvous); --stages-share-gpu: the first one."""
    import torch

    p, device = config.parallel, config.device.device
    ranks = 1 if p.stages_share_gpu else p.world_size // p.nnodes  # this node's
    if device == "cpu" or not torch.cuda.is_available():
        return
    if ranks > torch.cuda.device_count():
        raise ValueError(
            f"this node's {ranks} ranks (world / nnodes) need {ranks} GPUs, "
            f"{torch.cuda.device_count()} visible"
        )
