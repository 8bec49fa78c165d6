"""`lightwell generate | chat | serve | bench`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from lightwell.cli_args import (
    DefaultsHelpFormatter,
    add_config_args,
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_overrides_from_args,
)
from lightwell.config import ModelConfig, is_preset_dummy
from lightwell.engine.interrupts import StepGuard

logger = logging.getLogger("lightwell")

# generate / chat without sampling defaults from the model: greedy (the --temperature help)
CLI_FALLBACK_SAMPLING = {"temperature": 0.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightwell",
        description="Lightwell: LLM inference and serving. Default model: SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--version", action="store_true", help="Print the version and exit.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    fmt = DefaultsHelpFormatter

    gen = sub.add_parser("generate", help="Generate text for one prompt, streamed.")
    gen.add_argument(
        "prompt",
        nargs="?",
        default="Write a haiku about the sea.",
        help="The prompt (a user chat message unless --raw-prompt).",
    )
    gen.add_argument(
        "--raw-prompt",
        action="store_true",
        help="Send the prompt as plain text, without the model's chat template.",
    )
    gen.add_argument("--system", default=None, help="System message for the chat template.")
    gen.add_argument("--no-stream", action="store_true", help="Print the text only at the end.")
    gen.add_argument(
        "--show-stats",
        action="store_true",
        help="Print token counts, TTFT and decode speed to stderr at the end.",
    )
    _common(gen)

    chat = sub.add_parser("chat", help="Interactive chat with history (/reset, /exit).")
    chat.add_argument("--system", default=None, help="System message.")
    _common(chat)

    down = sub.add_parser(
        "download",
        help="Copy an s3:// model into --download-dir (for an init container or a warm node).",
        formatter_class=fmt,
    )
    down.add_argument("model", help="The model's address, s3://bucket/prefix.")
    add_config_args(down, ModelConfig, ("download_dir", "s3_endpoint_url", "s3_max_connections"))
    down.set_defaults(handler=cmd_download)

    for name, (helptext, adder) in _EXTRA_COMMANDS.items():
        extra = sub.add_parser(name, help=helptext, formatter_class=fmt)
        adder(extra)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Logging level (INFO adds one line per start-up stage, with its seconds).",
    )
    add_sampling_args(p)
    add_engine_args(p)


# Subcommands registered by other modules (serve, bench) to keep this file small.
_EXTRA_COMMANDS: dict[str, tuple[str, Any]] = {}


def _register_extra() -> None:
    try:
        from lightwell.server.cli import register as register_serve
    except ImportError:
        register_serve = None
    if register_serve:
        register_serve(_EXTRA_COMMANDS)
    try:
        from lightwell.bench.cli import register as register_bench
    except ImportError:
        register_bench = None
    if register_bench:
        register_bench(_EXTRA_COMMANDS)


def stream_request(engine: Any, request_id: str) -> Iterator[Any]:
    """Step the engine until request_id finishes, yielding each of its RequestOutputs.
    Ctrl-C / SIGTERM raise KeyboardInterrupt between steps, never inside one."""
    with StepGuard((signal.SIGINT, signal.SIGTERM)) as guard:
        while True:
            for out in engine.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return
            guard.check()
            if not engine.has_unfinished_requests():
                return


def _make_engine(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The engine and the sampling options; every option is checked before the model loads."""
    from lightwell.preflight import check_engine_config, check_sampling

    cfg = engine_config_from_args(args)
    overrides = sampling_overrides_from_args(args)
    check_sampling({**CLI_FALLBACK_SAMPLING, **overrides})
    check_engine_config(cfg)
    m = cfg.model
    if m.skip_tokenizer_init or (is_preset_dummy(m) and m.tokenizer is None):
        raise ValueError(
            f"{args.command} needs a tokenizer: this configuration loads none "
            "(--skip-tokenizer-init, or a dummy model from --hf-config-json); pass --tokenizer"
        )
    from lightwell.engine.llm_engine import LLMEngine

    name = cfg.model.model or "SmolLM2-135M-Instruct (the default model)"
    print(f"lightwell: loading {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    print(_banner(engine, time.perf_counter() - t0), file=sys.stderr, flush=True)
    return engine, overrides


def _banner(engine: Any, load_s: float) -> str:
    info, cfg = engine.model_info, engine.config
    threads = f", {info.num_threads} CPU thread(s)" if info.device == "cpu" else ""
    return (
        f"lightwell: {info.name} ({info.architecture}, {info.dtype} on {info.device}{threads}) "
        f"loaded in {load_s:.1f}s; KV cache {engine.num_kv_blocks * cfg.cache.block_size} "
        f"tokens, context {engine.max_model_len}"
    )


def _prompt_ids(engine: Any, args: argparse.Namespace, messages: list[dict] | None) -> Any:
    if messages is None:
        return args.prompt
    return {"prompt_token_ids": engine.tokenizer.apply_chat_template(messages)}


def cmd_generate(args: argparse.Namespace) -> int:
    engine, overrides = _make_engine(args)
    try:
        return _generate(engine, overrides, args)
    finally:
        engine.shutdown()  # worker processes end before the interpreter does


def _generate(engine: Any, overrides: dict[str, Any], args: argparse.Namespace) -> int:
    params = engine.default_sampling_params(CLI_FALLBACK_SAMPLING, **overrides)
    messages = None
    if not args.raw_prompt and engine.tokenizer.chat_template:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
    t0 = time.perf_counter()
    rid = engine.add_request(None, _prompt_ids(engine, args, messages), params)
    final = _print_stream(engine, rid, stream=not args.no_stream and params.n == 1)
    if final is not None and (args.no_stream or params.n > 1):
        for c in final.outputs:
            prefix = f"[{c.index}] " if params.n > 1 else ""
            print(prefix + c.text)
    if final is not None and params.prompt_logprobs is not None:
        _print_logprobs(engine, "prompt", final.prompt_token_ids, final.prompt_logprobs or [])
    if final is not None and params.logprobs is not None:
        for c in final.outputs:
            _print_logprobs(engine, f"output [{c.index}]", c.token_ids, c.logprobs or [])
    if args.show_stats and final is not None:
        _print_stats(final, time.perf_counter() - t0)
    return 0


def _print_stream(engine: Any, rid: str, stream: bool) -> Any:
    final = None
    printed = 0
    for out in stream_request(engine, rid):
        final = out
        if stream:
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    if stream:
        sys.stdout.write("\n")
    return final


def _print_logprobs(engine: Any, what: str, ids: Any, positions: Any) -> None:
    """One line per token: its text, log-probability, rank, and the top alternatives."""
    print(f"-- {what} logprobs: token, logprob, rank, top alternatives")
    tok = engine.tokenizer
    piece = (
        (lambda t: tok.decode(t, skip_special_tokens=False))
        if tok
        else (lambda t: f"token_id:{t[0]}")
    )
    for tid, pos in zip(ids, positions):
        if pos is None:  # the first prompt token has no logprob
            print(f"{piece([tid])!r}\t-")
            continue
        chosen = pos.get(tid)
        top = sorted(pos.items(), key=lambda kv: kv[1].rank)
        alts = ", ".join(f"{piece([t])!r} {lp.logprob:.3f}" for t, lp in top if lp.rank)
        shown = f"{chosen.logprob:.4f}\t{chosen.rank}" if chosen else "?\t?"
        print(f"{piece([tid])!r}\t{shown}\t[{alts}]")


def _print_stats(out: Any, wall: float) -> None:
    m = out.metrics
    n = sum(len(c.token_ids) for c in out.outputs)
    ttft = (m.first_token_time - m.arrival_time) if m and m.first_token_time else float("nan")
    decode = wall - ttft
    rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
    print(
        f"prompt {len(out.prompt_token_ids)} tokens (cached {out.num_cached_tokens}), "
        f"output {n} tokens, TTFT {ttft * 1e3:.1f} ms, decode {rate:.1f} tok/s, "
        f"finish {[str(c.finish_reason) for c in out.outputs]}",
        file=sys.stderr,
    )


def cmd_chat(args: argparse.Namespace) -> int:
    engine, overrides = _make_engine(args)
    try:
        return _chat(engine, overrides, args)
    finally:
        engine.shutdown()


def _chat(engine: Any, overrides: dict[str, Any], args: argparse.Namespace) -> int:
    if not engine.tokenizer.chat_template:
        print(
            "this model has no chat template; use `lightwell generate --raw-prompt`",
            file=sys.stderr,
        )
        return 2
    params = engine.default_sampling_params(CLI_FALLBACK_SAMPLING, **overrides)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    print("Lightwell chat: /reset clears the history, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            rid = engine.add_request(None, _prompt_ids(engine, args, system + history), params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        try:
            final = _print_stream(engine, rid, stream=True)
        except KeyboardInterrupt:  # stops this answer; the session goes on
            final = engine.abort_request(rid)
            print("\n[interrupted]", file=sys.stderr)
        history.append({"role": "assistant", "content": final.outputs[0].text if final else ""})


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


_interrupt.defers_to_steps = True  # type: ignore[attr-defined]  # StepGuard takes it over


def cmd_download(args: argparse.Namespace) -> int:
    from lightwell.storage.object_store import StoreOptions, is_object_uri
    from lightwell.storage.remote import download_model

    if not is_object_uri(args.model):
        raise ValueError(f"{args.model!r}: lightwell download takes an s3://bucket/prefix")
    if not args.download_dir:
        raise ValueError("lightwell download needs --download-dir")
    opts = StoreOptions(args.s3_endpoint_url, args.s3_max_connections, args.download_dir)
    print(download_model(args.model, opts))
    return 0


def main(argv: list[str] | None = None) -> int:
    _register_extra()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from lightwell import __version__

        print(__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(args, "log_level", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handlers = {"generate": cmd_generate, "chat": cmd_chat}
    handler = handlers.get(args.command) or args.handler
    if args.command in handlers:  # SIGTERM stops as Ctrl-C does: workers shut down, exit 0
        signal.signal(signal.SIGTERM, _interrupt)
    from lightwell.storage.object_store import ObjectStoreError

    try:
        return handler(args)
    except (ValueError, FileNotFoundError, ObjectStoreError) as e:
        print(f"lightwell: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a requested stop, quietly (as serve)
        print(file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
