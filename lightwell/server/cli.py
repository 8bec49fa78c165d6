"""`lightwell serve`: load the model, then open the OpenAI-compatible HTTP server.

The port opens only after the model is loaded. SIGTERM (or Ctrl-C) stops accepting connections,
lets in-flight requests finish for up to --shutdown-timeout seconds, aborts what is left, and
exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
import time
from typing import Any

from lightwell.cli_args import add_config_args, add_engine_args, engine_config_from_args
from lightwell.server.tool_parsers import PARSER_CHOICES

logger = logging.getLogger("lightwell.server")
WATCH_S = 0.5  # how often serve checks that its engine, workers and nodes are alive


def register(commands: dict[str, tuple[str, Any]]) -> None:
    commands["serve"] = ("Serve a model over an OpenAI-compatible HTTP API.", add_serve_args)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    p.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    p.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on every route but /health (401 otherwise; "
        "/metrics too unless --public-metrics).",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="The model name clients send and see (default: the model's own name); several "
        "names are aliases of one model, all accepted and listed by /v1/models, the first is "
        "the one responses and metrics carry.",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=PARSER_CHOICES,
        help="How the model's tool calls are read from its text under tool_choice 'auto': "
        "hermes (Hermes, Qwen2.5, Qwen3 <tool_call> JSON), llama3_json (Llama 3.1+), mistral "
        "([TOOL_CALLS]); auto: the format the chat template writes, if it names one; none: "
        "never parsed. tool_choice 'required' and named functions need no parser.",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Logging level (INFO: one line per start-up stage with its seconds, one line per "
        "finished request, periodic stats).",
    )
    p.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="Log lines as text, or as one JSON object each (time, level, logger, message, "
        "request_id: the X-Request-Id a client sent, or the one the server made and returned "
        "in X-Request-Id).",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="On SIGTERM, seconds to let in-flight requests finish before aborting them.",
    )
    p.add_argument(
        "--stats-interval", type=float, default=10.0, help="Seconds between stats log lines."
    )
    from lightwell.server.limits import ServerLimits

    limits = p.add_argument_group("server limits (docs/serving.md)")
    add_config_args(limits, ServerLimits, tuple(f.name for f in dataclasses.fields(ServerLimits)))
    add_engine_args(p)
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from lightwell.engine.async_engine import AsyncEngine
    from lightwell.engine.llm_engine import LLMEngine
    from lightwell.preflight import check_engine_config, check_port
    from lightwell.server.api_server import BannerServer, build_app
    from lightwell.server.limits import ServerLimits
    from lightwell.server.metrics import ServerMetrics
    from lightwell.server.observability import use_json_logs

    if args.log_format == "json":
        use_json_logs()
    cfg = engine_config_from_args(args).replace(serving=True)
    limits = ServerLimits(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)}
    )
    limits.validate()
    check_engine_config(cfg)  # before the load: one line, exit code 2
    check_port(args.host, args.port)
    print(f"lightwell: loading {cfg.model.model or 'SmolLM2-135M-Instruct'} ...", flush=True)
    t0 = time.perf_counter()
    if cfg.parallel.node_rank > 0:  # another node: workers only
        from lightwell.executor.nodes import run_worker_node

        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
        return run_worker_node(cfg)
    engine = LLMEngine(cfg)
    names = args.served_model_name or [
        engine.files.name if engine.files else engine.model_info.name
    ]
    name, aliases = names[0], tuple(dict.fromkeys(n for n in names[1:] if n != names[0]))
    metrics = ServerMetrics(name)
    async_engine = AsyncEngine(
        engine, on_finished=metrics.observe_finished, on_step=metrics.observe_step
    )
    metrics.attach(lambda: async_engine.stats)
    app = build_app(
        async_engine,
        name,
        metrics,
        args.api_key,
        args.stats_interval,
        args.tool_call_parser,
        aliases,
        limits,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout,
        # JSON logs: uvicorn's loggers propagate to the root's JSON handler
        **({"log_config": None} if args.log_format == "json" else {}),
    )
    server = BannerServer(config, banner=_banner(args, engine, name, time.perf_counter() - t0))
    # uvicorn re-raises the signal it shut down on; make that a no-op so the exit code is 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    failed = threading.Event()
    threading.Thread(
        target=_exit_when_dead, args=(server, async_engine, failed), daemon=True
    ).start()
    try:
        server.run()
    finally:
        async_engine.shutdown(timeout=min(args.shutdown_timeout, 5.0))
    return 0 if server.started and not failed.is_set() else 1


def _exit_when_dead(server: Any, async_engine: Any, failed: threading.Event) -> None:
    """A dead engine loop, worker or node: /health already answers 503; stop the server so
    the process exits non-zero (an orchestrator restarts it)."""
    while not server.should_exit:
        if server.started and not async_engine.is_alive:
            why = async_engine.engine.executor_failure() or "the engine loop stopped"
            logger.error("shutting down: %s", why)
            failed.set()
            server.should_exit = True
            return
        time.sleep(WATCH_S)


def _banner(args: argparse.Namespace, engine: Any, name: str, load_s: float) -> str:
    info, cfg = engine.model_info, engine.config
    blocks, bs = engine.num_kv_blocks, cfg.cache.block_size
    host = f"[{args.host}]" if ":" in args.host else args.host
    return (
        f"Lightwell serving {name} ({info.architecture}, {info.dtype} on {info.device}, loaded "
        f"in {load_s:.1f}s) at http://{host}:{args.port}/v1\n"
        f"KV cache: {blocks} blocks x {bs} tokens = {blocks * bs} tokens; context length "
        f"{engine.max_model_len}; max {cfg.scheduler.max_num_seqs} sequences, "
        f"{cfg.scheduler.max_num_batched_tokens} tokens per step"
        + (f"; {engine.model_info.num_threads} CPU threads" if info.device == "cpu" else "")
        + ("; API key required" if args.api_key else "")
    )


if __name__ == "__main__":
    from lightwell.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
