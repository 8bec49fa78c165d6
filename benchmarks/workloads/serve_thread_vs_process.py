"""Thread vs process for the server's engine loop: TTFT, ITL and event-loop stalls under load.

``thread``: the shipped design (lightwell/engine/async_engine.py): one background thread owns
the LLMEngine; the asyncio server shares its process (and its GIL).
``process``: a prototype kept here, not shipped: the LLMEngine runs in a child process; the
server sends commands down one pipe and a reader thread receives each step's RequestOutputs
(pickled) up another.

Both serve the same FastAPI app (lightwell.server.api_server). A separate load process runs
``--concurrency`` closed-loop streaming clients for ``--duration`` s and probes /health every
50 ms; inside the server an asyncio task measures event-loop lag (oversleep of 10 ms sleeps).
On the CPU (SmolLM2-135M, one torch thread), about 75 s a design:

    python3 -m benchmarks.workloads.serve_thread_vs_process --design thread --out thread.json

(then ``--design process``). Writes one record (metric output_tok_s, with the TTFT, ITL,
/health and loop-lag percentiles). Reference result:
benchmarks/results/serve_thread_vs_process_cpu.json (three runs of each design).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from types import SimpleNamespace

from lightwell.bench.results import record


# ---- the process design (prototype) ------------------------------------------------------------
def _engine_process(cfg, cmd_conn, out_conn) -> None:
    from lightwell.engine.llm_engine import LLMEngine

    engine = LLMEngine(cfg)
    out_conn.send(("ready", engine.max_model_len, engine.model_info, engine.files))
    while True:
        if not engine.has_unfinished_requests():
            cmd_conn.poll(None)
        while cmd_conn.poll(0):
            msg = cmd_conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                out = engine.abort_request(msg[1])
                out_conn.send(("out", [out] if out else [], engine.stats()))
                continue
            try:
                engine.add_request(msg[1], msg[2], msg[3])
                out_conn.send(("ok", msg[1]))
            except ValueError as e:
                out_conn.send(("err", msg[1], e))
        if engine.has_unfinished_requests():
            outs = engine.step()
            out_conn.send(("out", outs, engine.stats()))


class ProcessAsyncEngine:
    """AsyncEngine's interface (as the server uses it) over an engine in a child process."""

    def __init__(self, cfg) -> None:
        from lightwell.engine.tokenizer import Tokenizer
        from lightwell.types import SamplingParams

        ctx = mp.get_context("spawn")
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_engine_process, args=(cfg, cmd_r, out_w), daemon=True)
        self._proc.start()
        _, max_len, info, files = self._out.recv()
        self.engine = SimpleNamespace(
            tokenizer=Tokenizer.load(files, cfg.model.tokenizer),
            max_model_len=max_len,
            model_info=info,
            files=files,
            default_sampling_params=lambda **kw: SamplingParams(**kw),
        )
        self.stats = None
        self._streams: dict = {}
        self._send_lock = threading.Lock()
        threading.Thread(target=self._reader, daemon=True).start()

    @property
    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def _send(self, msg) -> None:
        with self._send_lock:
            self._cmd.send(msg)

    async def add_request(self, rid, prompt, params):
        from lightwell.engine.async_engine import RequestStream

        stream = RequestStream(rid, asyncio.get_running_loop())
        self._streams[rid] = stream
        self._send(("add", rid, prompt, params))
        await asyncio.shield(stream.accepted)
        return stream

    def iterate(self, stream):
        from lightwell.engine.async_engine import AsyncEngine

        return AsyncEngine.iterate(self, stream)  # only uses stream and self.abort

    def abort(self, rid) -> None:
        self._send(("abort", rid))

    def _reader(self) -> None:
        from lightwell.engine.async_engine import _accept, _put_all

        while True:
            try:
                msg = self._out.recv()
            except (EOFError, OSError):  # the engine process exited
                return
            if msg[0] == "ok":
                s = self._streams[msg[1]]
                s.loop.call_soon_threadsafe(_accept, s)
            elif msg[0] == "err":
                s = self._streams.pop(msg[1])
                s.loop.call_soon_threadsafe(_put_all, [(s, msg[2])])
            else:
                self.stats = msg[2]
                batch = [
                    (self._streams[o.request_id], o)
                    for o in msg[1]
                    if o.request_id in self._streams
                ]
                for o in msg[1]:
                    if o.finished:
                        self._streams.pop(o.request_id, None)
                if batch:
                    batch[0][0].loop.call_soon_threadsafe(_put_all, batch)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._send(("stop",))
        self._proc.join(timeout)


# ---- server side ------------------------------------------------------------
async def _lag_monitor(samples: list[float]) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        samples.append(time.perf_counter() - t - 0.01)


def serve(args) -> None:
    import uvicorn

    from lightwell.config import EngineConfig
    from lightwell.engine.async_engine import AsyncEngine
    from lightwell.engine.llm_engine import LLMEngine
    from lightwell.server.api_server import build_app
    from lightwell.server.metrics import ServerMetrics

    cfg = EngineConfig.from_kwargs(num_threads=1, max_model_len=2048)
    if args.design == "thread":
        engine = AsyncEngine(LLMEngine(cfg))
    else:
        engine = ProcessAsyncEngine(cfg)
    metrics = ServerMetrics("m")
    metrics.attach(lambda: engine.stats)
    app = build_app(engine, "m", metrics)
    server = uvicorn.Server(uvicorn.Config(app, port=args.port, log_level="warning"))
    lags: list[float] = []

    async def main() -> None:
        monitor = asyncio.create_task(_lag_monitor(lags))
        load = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.workloads.serve_thread_vs_process",
            "--load",
            "--port",
            str(args.port),
            "--concurrency",
            str(args.concurrency),
            "--duration",
            str(args.duration),
            "--out",
            args.out,
            "--design",
            args.design,
        )
        serving = asyncio.create_task(server.serve())
        await load.wait()
        monitor.cancel()
        server.should_exit = True
        await serving

    asyncio.run(main())
    engine.shutdown(5.0)
    with open(args.out) as f:
        result = json.load(f)
    result["loop_lag_ms"] = _pcts([x * 1e3 for x in lags[len(lags) // 10 :]])
    result = record("output_tok_s", result.pop("output_tok_s"), workload="serve-design", **result)
    with open(args.out, "w") as f:
        json.dump([result], f, indent=1)
    print(json.dumps(result, indent=1))


# ---- load side ------------------------------------------------------------
def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {
        "n": len(xs),
        "mean": round(statistics.fmean(xs), 2),
        "p50": round(q(0.5), 2),
        "p90": round(q(0.9), 2),
        "p99": round(q(0.99), 2),
        "max": round(xs[-1], 2),
    }


async def _client(session, url, i, stop_at, ttft, itl, tokens) -> None:
    k = 0
    while time.perf_counter() < stop_at:
        k += 1
        prompt = f"Client {i} request {k}: " + "tell me about the weather today " * 12
        body = {
            "prompt": prompt,
            "max_tokens": 32,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        t0 = last = time.perf_counter()
        first = True
        async with session.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                (ttft if first else itl).append((now - (t0 if first else last)) * 1e3)
                first, last = False, now
                tokens.append(now)


async def _probe(session, url, stop_at, lat) -> None:
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        async with session.get(url + "/health") as r:
            await r.read()
        lat.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(0.05)


async def load(args) -> None:
    import aiohttp

    url = f"http://127.0.0.1:{args.port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(600):
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        ttft, itl, tokens, health = [], [], [], []
        t_start = time.perf_counter()
        stop_at = t_start + args.duration
        await asyncio.gather(
            _probe(session, url, stop_at, health),
            *(
                _client(session, url, i, stop_at, ttft, itl, tokens)
                for i in range(args.concurrency)
            ),
        )
        wall = time.perf_counter() - t_start
    result = {
        "design": args.design,
        "concurrency": args.concurrency,
        "wall_s": round(wall, 1),
        "output_tok_s": round(len(tokens) / wall, 1),
        "ttft_ms": _pcts(ttft),
        "itl_ms": _pcts(itl),
        "health_ms": _pcts(health),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--design", choices=["thread", "process"], default="thread")
    p.add_argument("--port", type=int, default=8177)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--out", default="/tmp/serve_design.json")
    p.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if a.load:
        asyncio.run(load(a))
    else:
        serve(a)
