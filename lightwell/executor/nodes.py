"""Ranks on several hosts: the rendezvous, the check that every node runs the same thing, and
the other nodes' side (``run_worker_node``).

Node n holds global ranks ``n * L .. n * L + L - 1`` (L = ranks a node). With
``--dist-init-addr HOST:PORT``: node 0's engine process hosts a torch.distributed ``TCPStore``
on PORT holding its fingerprint (version, model and every option but the node rank); the
process group meets at PORT + 1 (torch's TCP store rendezvous: NCCL across hosts on GPUs, gloo
on CPUs); node 0 listens on PORT + 2 for the other nodes' workers, which connect, say
``Started`` and then take the same typed commands over the socket that node 0's own workers
take over their pipes. Each other node also holds one idle connection of its own: node 0
learns that a node went away when it closes, and the node learns the same of node 0.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from lightwell.config import EngineConfig
from lightwell.executor.messages import Failure, Started, WorkerError

logger = logging.getLogger(__name__)

AUTHKEY = b"lightwell-nodes"
JOIN_TIMEOUT_S = 300.0  # how long node 0 waits for every other node's workers
STORE_TIMEOUT = datetime.timedelta(seconds=300)
FINGERPRINT_KEY = "lightwell/fingerprint"


@dataclasses.dataclass(frozen=True)
class NodeHello:
    """A node's idle connection to node 0: its closing means the node is gone."""

    node_rank: int


def addresses(config: EngineConfig) -> tuple[str, int]:
    """(host, base port) of ``--dist-init-addr``."""
    host, _, port = config.parallel.dist_init_addr.rpartition(":")
    return host.strip("[]"), int(port)


def ranks_per_node(config: EngineConfig) -> int:
    return config.parallel.world_size // config.parallel.nnodes


def fingerprint(config: EngineConfig) -> str:
    """What every node must agree on: Lightwell's version and every option but the node's."""
    from lightwell import __version__

    options = config.flat()
    options.pop("node_rank")
    options.pop("num_threads", None)  # a host's own
    text = json.dumps({"version": __version__, "options": options}, sort_keys=True, default=str)
    return f"{__version__}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _describe(config: EngineConfig) -> str:
    from lightwell import __version__

    p = config.parallel
    return (
        f"lightwell {__version__}, model {config.model.model!r}, tp {p.tensor_parallel_size} "
        f"x pp {p.pipeline_parallel_size} over {p.nnodes} nodes"
    )


def publish_fingerprint(config: EngineConfig) -> Any:
    """Node 0: host the store and put its fingerprint in it (keep the store alive)."""
    import torch.distributed as dist

    host, port = addresses(config)
    store = dist.TCPStore(host, port, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    store.set(FINGERPRINT_KEY, json.dumps([fingerprint(config), _describe(config)]))
    return store


def check_fingerprint(config: EngineConfig) -> None:
    """Another node: refuse to join node 0 unless the fingerprints match."""
    import torch.distributed as dist

    host, port = addresses(config)
    store = dist.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT)
    theirs, described = json.loads(store.get(FINGERPRINT_KEY))
    if theirs != fingerprint(config):
        raise WorkerError(
            f"node {config.parallel.node_rank} refused: node 0 runs {described} with "
            f"fingerprint {theirs}, this node {_describe(config)} with {fingerprint(config)} "
            "(start every node with the same version, model and options)"
        )


class RemoteRanks:
    """Node 0's side: the other nodes' worker connections, by global rank, and their nodes'
    idle connections."""

    def __init__(self, config: EngineConfig) -> None:
        host, port = addresses(config)
        self.listener = Listener((host, port + 2), authkey=AUTHKEY)
        self.first = ranks_per_node(config)  # the first remote rank
        self.world = self.first * config.parallel.nnodes
        self.conns: dict[int, Connection] = {}
        self.nodes: list[Connection] = []
        self.expected_nodes = config.parallel.nnodes - 1

    def accept_all(self) -> None:
        """Every other node's workers and idle connections, or a clear error."""
        done = threading.Event()
        timer = threading.Timer(JOIN_TIMEOUT_S, self._give_up, args=(done,))
        timer.daemon = True
        timer.start()
        try:
            while (
                len(self.conns) < self.world - self.first or len(self.nodes) < self.expected_nodes
            ):
                conn = self.listener.accept()
                self._admit(conn, conn.recv())
        except OSError as e:
            raise WorkerError(
                f"not every node joined within {JOIN_TIMEOUT_S:.0f} s ({len(self.conns)} of "
                f"{self.world - self.first} remote ranks)"
            ) from e
        finally:
            done.set()
            timer.cancel()

    def _admit(self, conn: Connection, hello: Any) -> None:
        if isinstance(hello, Failure):
            raise hello.error()
        if isinstance(hello, NodeHello):
            self.nodes.append(conn)
        elif isinstance(hello, Started) and self.first <= hello.rank < self.world:
            self.conns[hello.rank] = conn
        else:
            raise WorkerError(f"unexpected first message from another node: {hello!r}")

    def _give_up(self, done: threading.Event) -> None:
        if not done.is_set():
            self.listener.close()  # accept() raises OSError

    def close(self) -> None:
        for conn in [*self.conns.values(), *self.nodes]:
            conn.close()
        self.listener.close()


def remote_worker_main(
    config: EngineConfig, rank: int, init_method: str, address: tuple[str, int]
) -> None:
    """A worker process on another node: its command channel is a socket to node 0."""
    from lightwell.executor.worker_proc import worker_main

    conn = Client(address, authkey=AUTHKEY)
    worker_main(config, rank, init_method, conn)


def run_worker_node(config: EngineConfig) -> int:
    """``lightwell serve --node-rank R`` for R > 0: check the fingerprint, start this node's
    workers, hold the idle connection, and return when node 0 or a worker goes away (the
    exit code: 0 when node 0 shut the workers down, 1 otherwise)."""
    import torch.multiprocessing as mp

    p = config.parallel
    host, port = addresses(config)
    try:
        check_fingerprint(config)
    except WorkerError as e:
        with Client((host, port + 2), authkey=AUTHKEY) as conn:
            conn.send(Failure(p.node_rank * ranks_per_node(config), str(e)))
        raise
    idle = Client((host, port + 2), authkey=AUTHKEY)
    idle.send(NodeHello(p.node_rank))
    ctx = mp.get_context("spawn")
    first = p.node_rank * ranks_per_node(config)
    procs = [
        ctx.Process(
            target=remote_worker_main,
            args=(config, rank, f"tcp://{host}:{port + 1}", (host, port + 2)),
            name=f"lightwell-rank{rank}",
        )
        for rank in range(first, first + ranks_per_node(config))
    ]
    for proc in procs:
        proc.start()
    logger.info("node %d: ranks %d-%d started", p.node_rank, first, first + len(procs) - 1)
    return _wait_node(procs, idle)


def _wait_node(procs: list[Any], idle: Connection) -> int:
    """Until a worker ends or node 0 goes away; then stop the rest."""
    ready = wait([idle, *(proc.sentinel for proc in procs)])
    if idle in ready:
        logger.info("node 0 went away: stopping this node's workers")
    deadline = time.monotonic() + 10.0
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()  # (workers ignore SIGTERM)
            proc.join(2.0)
    idle.close()
    clean = all(proc.exitcode == 0 for proc in procs)
    if not clean:
        codes = [proc.exitcode for proc in procs]
        logger.error("this node's workers ended with exit codes %s", codes)
    return 0 if clean else 1
