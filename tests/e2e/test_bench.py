"""`lightwell bench serve | throughput | latency` end to end.

`bench serve` runs against a stub OpenAI server (aiohttp, in a thread) that streams tokens at
known times, and against the real `lightwell serve` when ``lightwell.server.api_server`` exists.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from aiohttp import web

from lightwell.cli import main

FIRST_S = 0.05  # the stub's time to first token
GAP_S = 0.02  # and between tokens
API_KEY = "sk-bench-test"


def _chunk(body: dict, i: int, n: int, chat: bool) -> dict:
    finish = "length" if i == n - 1 else None
    if chat:
        delta = {"content": " the"} if i else {"role": "assistant", "content": " the"}
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return {"choices": [{"index": 0, "text": " the", "finish_reason": finish}]}


class StubServer:
    """Streams max_tokens chunks: the first after FIRST_S, then one every GAP_S. The chat route
    sends no usage, so the client must count tokens itself (" the" is one token)."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {API_KEY}"

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "stub-model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        self.received.append(body)
        chat = request.path.endswith("chat/completions")
        n = body.get("max_completion_tokens" if chat else "max_tokens")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(FIRST_S)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP_S)
            await resp.write(f"data: {json.dumps(_chunk(body, i, n, chat))}\n\n".encode())
        if not chat and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stub():
    server = StubServer()
    yield server
    server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench(url: str, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "r.json"
    argv = [
        "bench",
        "serve",
        "--base-url",
        url,
        "--num-prompts",
        "8",
        "--input-len",
        "32",
        "--output-len",
        "8",
        "--result-json",
        str(out),
        "--no-progress",
        *extra,
    ]
    rc = main(argv)
    rows = json.loads(out.read_text()) if out.exists() else []
    return rc, {(r["request_rate"], r["metric"]): r for r in rows}


def test_serve_against_stub_timings(stub, tmp_path, capsys):
    url = f"http://127.0.0.1:{stub.port}"
    png = tmp_path / "p.png"
    rc, by = _bench(
        url,
        tmp_path,
        "--api-key",
        API_KEY,
        "--request-rate",
        "20,inf",
        "--ignore-eos",
        "--plot",
        str(png),
        "--goodput",
        "ttft:10000",
    )
    assert rc == 0
    assert png.stat().st_size > 10_000
    body = stub.received[-1]
    assert body["model"] == "stub-model" and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8
    from lightwell.bench.serve import load_tokenizer

    assert len(load_tokenizer(None, None).encode(body["prompt"])) == 32
    for rate in ("20", "inf"):
        assert by[(rate, "request_s")]["completed"] == 8
        assert by[(rate, "ttft_ms_p50")]["value"] == pytest.approx(FIRST_S * 1e3, abs=40)
        assert by[(rate, "tpot_ms_p50")]["value"] == pytest.approx(GAP_S * 1e3, abs=25)
        assert by[(rate, "itl_ms_p50")]["value"] == pytest.approx(GAP_S * 1e3, abs=25)
        e2e = (FIRST_S + 7 * GAP_S) * 1e3
        assert by[(rate, "e2e_ms_p50")]["value"] == pytest.approx(e2e, abs=80)
        assert by[(rate, "goodput_request_s")]["value"] == by[(rate, "request_s")]["value"]
        assert by[(rate, "output_tok_s")]["value"] == pytest.approx(
            8 * by[(rate, "request_s")]["value"], rel=1e-3
        )
    assert by[("inf", "request_s")]["value"] > by[("20", "request_s")]["value"]
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "TTFT p50" in text


def test_serve_chat_counts_tokens_without_usage(stub, tmp_path):
    url = f"http://127.0.0.1:{stub.port}"
    rc, by = _bench(
        url,
        tmp_path,
        "--api-key",
        API_KEY,
        "--endpoint",
        "/v1/chat/completions",
        "--max-concurrency",
        "2",
        "--model",
        "given-name",
    )
    assert rc == 0
    assert stub.received[-1]["model"] == "given-name"
    assert stub.received[-1]["messages"][0]["role"] == "user"
    assert by[("inf", "output_tok_s")]["value"] == pytest.approx(
        8 * by[("inf", "request_s")]["value"], rel=1e-3
    )
    assert by[("inf", "request_s")]["max_concurrency"] == 2


def test_serve_errors_are_clear(stub, tmp_path, capsys):
    rc, _ = _bench(f"http://127.0.0.1:{_free_port()}", tmp_path)
    assert rc == 1
    assert "cannot reach the server" in capsys.readouterr().out
    rc, _ = _bench(f"http://127.0.0.1:{stub.port}", tmp_path, "--api-key", "wrong")
    assert rc == 1
    assert "HTTP 401" in capsys.readouterr().out
    rc, _ = _bench("http://x", tmp_path, "--endpoint", "/v1/chat/completions", "--token-ids")
    assert rc == 2
    assert "--token-ids works with /v1/completions only" in capsys.readouterr().err


# ---- the real server ---------------------------------------------------------------------------
def _has_server() -> bool:
    try:
        return importlib.util.find_spec("lightwell.server.api_server") is not None
    except ImportError:
        return False


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lightwell serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("lightwell serve did not become ready")


@pytest.mark.slow
@pytest.mark.skipif(not _has_server(), reason="lightwell.server.api_server is not importable")
def test_serve_against_lightwell_serve(tmp_path):
    port = _free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [
        sys.executable,
        "-m",
        "lightwell.cli",
        "serve",
        "--port",
        str(port),
        "--num-threads",
        "1",
    ]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        png = tmp_path / "real.png"
        rc, by = _bench(url, tmp_path, "--ignore-eos", "--request-rate", "8", "--plot", str(png))
        assert rc == 0
        assert by[("8", "request_s")]["completed"] == 8
        assert by[("8", "request_s")]["failed"] == 0
        # usage.completion_tokens: exactly output-len tokens per request with ignore_eos
        assert by[("8", "output_tok_s")]["value"] == pytest.approx(
            8 * by[("8", "request_s")]["value"], rel=1e-3
        )
        assert 0 < by[("8", "ttft_ms_p50")]["value"] < by[("8", "e2e_ms_p50")]["value"]
        assert png.exists()
        rc, by = _bench(url, tmp_path, "--token-ids", "--ignore-eos")  # ids: the server takes them
        assert rc == 0 and by[("inf", "request_s")]["completed"] == 8
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        finally:
            log.close()
            print((tmp_path / "serve.log").read_text()[-3000:])


# ---- offline -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_throughput_and_latency(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(
        [
            "bench",
            "throughput",
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--num-threads",
            "1",
            "--num-warmups",
            "1",
            "--no-progress",
            "--result-json",
            str(out),
        ]
    )
    assert rc == 0
    rows = {r["metric"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"output_tok_s", "total_tok_s", "request_s", "mfu"}
    assert rows["total_tok_s"]["value"] == pytest.approx(5 * rows["output_tok_s"]["value"], 1e-3)
    assert rows["output_tok_s"]["workload"] == "W2" and rows["mfu"]["dtype"] == "float32"
    assert 0 < rows["mfu"]["value"] < 1
    out = tmp_path / "l.json"
    rc = main(
        [
            "bench",
            "latency",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--num-threads",
            "1",
            "--num-iters",
            "1",
            "--num-iters-warmup",
            "0",
            "--result-json",
            str(out),
        ]
    )
    assert rc == 0
    rows = {r["metric"]: r for r in json.loads(out.read_text())}
    assert rows["decode_tok_s"]["value"] == pytest.approx(1e3 / rows["tpot_ms"]["value"], 1e-3)
    assert rows["decode_tok_s"]["floor"] > 0 and rows["ttft_ms"]["value"] > 0
    assert 0 < rows["bandwidth_floor_pct"]["value"] < 100
    assert rows["ttft_ms"]["workload"] == "W1"
    captured = capsys.readouterr()
    assert "time per output token" in captured.out
    # the model load and every batch show progress (a tqdm bar: count and ETA)
    assert "loading" in captured.err and "latency" in captured.err and "1/1" in captured.err
