"""Two "nodes" on one machine: two separate `lightwell serve` process trees with --nnodes 2
(pipeline stage 0 on node 0, stage 1 on node 1, gloo over 127.0.0.1) serve TP=1's greedy
text; killing node 1 makes node 0 exit non-zero with a clear error; a node started with other
options is refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from lightwell import LLM, SamplingParams

PROMPT = [3, 4, 5, 6, 7, 8, 40, 41, 42]  # token ids (the word-level tokenizer decodes them)
MAX_TOKENS = 8


def _free_base_port() -> int:
    """A port with the next two free too (store, process group, command channel)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000 and all(_free(port + i) for i in (1, 2)):
            return port
    raise RuntimeError("no three consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Node:
    def __init__(self, folder: str, rank: int, addr: str, *extra: str, http_port: int = 0):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "lightwell.cli",
            "serve",
            "--model",
            folder,
            "--num-threads",
            "1",
        ]
        cmd += ["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr]
        cmd += ["--pipeline-parallel-size", "2", "--num-kv-blocks", "32", "--device", "cpu"]
        cmd += ["--port", str(http_port), *extra]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def kill_tree(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _wait_ready(url: str, node: Node, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"node 0 exited early:\n{node.output()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"node 0 not ready:\n{node.output()}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tests.models.families import FAMILIES

    path = str(tmp_path_factory.mktemp("nodes") / "qwen2")
    FAMILIES["qwen2_yarn_window"].build(path, 3)
    return path


def test_two_nodes_serve_tp1_tokens_and_fail_when_node1_dies(folder):
    ref = LLM(folder, num_threads=1, num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = (
        ref.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].text
    )
    ref.engine.shutdown()
    addr = f"127.0.0.1:{_free_base_port()}"
    http = _free_base_port()
    node1 = Node(folder, 1, addr)
    node0 = Node(folder, 0, addr, http_port=http)
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_ready(url, node0)
        body = {"model": "qwen2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        body["ignore_eos"] = True
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        node1.kill_tree()
        t0 = time.time()
        code = node0.proc.wait(30)
        assert code != 0 and time.time() - t0 < 30
        assert "ended unexpectedly" in node0.output(), node0.output()[-2000:]
    finally:
        node0.kill_tree()
        node1.kill_tree()


def test_node_with_other_options_is_refused(folder):
    addr = f"127.0.0.1:{_free_base_port()}"
    node0 = Node(folder, 0, addr, http_port=_free_base_port())
    node1 = Node(folder, 1, addr, "--max-num-seqs", "7")
    try:
        assert node1.proc.wait(120) != 0
        assert node0.proc.wait(120) != 0
        assert "node 1 refused" in node1.output(), node1.output()[-2000:]
        assert "node 1 refused" in node0.output(), node0.output()[-2000:]
    finally:
        node0.kill_tree()
        node1.kill_tree()
