"""LLMEngine: add_request / abort_request / step. The control plane: no torch imports here."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lightwell import progress
from lightwell.config import EngineConfig, is_preset_dummy, resolve_config
from lightwell.engine.output_processor import OutputProcessor
from lightwell.engine.overlap_loop import OverlapLoop
from lightwell.engine.step_trace import StepTrace
from lightwell.engine.tokenizer import Tokenizer
from lightwell.executor import make_executor
from lightwell.file_checks import check_model_file
from lightwell.model_files import ModelFiles, resolve_model
from lightwell.scheduler.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from lightwell.scheduler.request import Request
from lightwell.scheduler.scheduler import Scheduler
from lightwell.storage.object_store import store_options
from lightwell.structured.manager import StructuredOutputManager
from lightwell.types import FinishReason, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    grammar_compiles: int = 0  # structured output: grammars compiled
    grammar_compile_seconds: float = 0.0
    grammar_cache_queries: int = 0
    grammar_cache_hits: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        t0 = time.perf_counter()
        m = config.model
        self.files: ModelFiles | None = (
            None if is_preset_dummy(m) else resolve_model(m.model, m.load_format, store_options(m))
        )
        if self.files is not None and self.files.remote is None:
            check_model_file(self.files.kind, self.files.path)  # truncated: one line, no load
        skip = m.skip_tokenizer_init or (self.files is None and m.tokenizer is None)
        self.tokenizer = None if skip else _load_tokenizer(self.files, m.tokenizer)
        self.generation_defaults = load_generation_defaults(self.files, m.generation_config)
        # opened first: a path that cannot be written fails before the model loads
        trace = config.scheduler.step_trace
        self._trace = StepTrace(trace) if trace else None
        self.executor = make_executor(config)
        try:
            self._start_executor(config)
        except BaseException:
            self.executor.shutdown()  # no half-started workers or process groups left behind
            if self._trace is not None:
                self._trace.close()
            raise
        s = self.config.scheduler
        self.scheduler = Scheduler(
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.cache.block_size,
            max_model_len=self.config.model.max_model_len,
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
            enable_chunked_prefill=s.enable_chunked_prefill,
            async_scheduling=s.async_scheduling,
            long_prefill_fraction=s.long_prefill_fraction,
        )
        self._overlap = OverlapLoop(self) if self.scheduler.async_scheduling else None
        p = self.config.parallel
        depth = p.pipeline_in_flight or p.pipeline_parallel_size
        if p.pipeline_parallel_size > 1 and depth > 1:  # stages on different batches
            self._overlap = OverlapLoop(self, depth)
        self.output_processor = OutputProcessor(self.tokenizer)
        # the tokenizer's EOS, else config.json's; generation_config's ids stop too
        own = [self.tokenizer.eos_token_id if self.tokenizer else None]
        own = self._eos_in_vocab([*own, self.model_info.eos_token_id])
        self.eos_token_id = own[0] if own else None
        extra = self._eos_in_vocab(self.generation_defaults.pop("eos_token_ids", []))
        self._extra_eos = [t for t in dict.fromkeys(extra) if t != self.eos_token_id]
        self._ids = itertools.count()
        self.task = resolve_task(self.config.model.task, self.model_info.architecture)
        stops = [t for t in [self.eos_token_id, *self._extra_eos] if t is not None]
        self.structured = StructuredOutputManager(
            self.tokenizer,
            self.model_info.vocab_size,
            stops,
            s.grammar_cache_size,
            s.grammar_fill_threads,
        )
        if progress.enabled():
            progress.logger.info("engine ready in %.1f s", time.perf_counter() - t0)

    def _start_executor(self, config: EngineConfig) -> None:
        """Load the model, size the KV cache from what it left, then allocate the cache."""
        self.model_info = info = self.executor.load_model()
        on_gpu, moe = info.device.startswith("cuda"), info.routed_experts > 0
        resolved = resolve_config(
            config, on_gpu=on_gpu, model_max_len=info.max_position_embeddings, moe=moe
        )
        self.num_kv_blocks = self.executor.determine_num_blocks(resolved)
        capacity = self.num_kv_blocks * config.cache.block_size
        self.config = resolve_config(
            config,
            on_gpu=on_gpu,
            model_max_len=info.max_position_embeddings,
            kv_capacity_tokens=capacity,
            moe=moe,
        )
        if self.config.model.max_model_len < (resolved.model.max_model_len or 0):
            logger.warning(
                "max_model_len lowered to %d: the KV cache holds only %d tokens",
                self.config.model.max_model_len,
                capacity,
            )
        self.executor.init_kv_cache(self.num_kv_blocks, self.config)

    # ---- requests ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Text, token ids, or {"prompt": ...} / {"prompt_token_ids": [...]} -> (text, ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt must be a string, a list of token ids, or a prompt dict")

    def _eos_in_vocab(self, ids: list[int]) -> list[int]:
        """The EOS ids the model can produce. One outside the vocabulary (a tokenizer or a
        generation_config larger than the model's embedding) can never be sampled, and
        min_tokens masks every EOS id as a logit column: it is dropped, with a warning."""
        vocab = self.model_info.vocab_size
        ids = [t for t in ids if t is not None]
        bad = sorted({t for t in ids if not 0 <= t < vocab})
        if bad:
            logger.warning(
                "EOS ids %s are outside the model's vocabulary [0, %d): ignored", bad, vocab
            )
        return [t for t in ids if 0 <= t < vocab]

    def check_token_ids(self, token_ids: list[int], what: str = "prompt token ids") -> None:
        """ValueError naming the first ids outside the vocabulary."""
        vocab = self.model_info.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} out of range [0, {vocab}): {bad[:5]}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.check_token_ids(token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but this model's context is "
                f"{self.max_model_len} tokens, and at least one must be left for the output"
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> str:
        """Validate and queue one request (n > 1: n sequences). Raises ValueError on bad input.

        ``final_only``: step() returns this request's output once, when it finishes (no
        per-step snapshots: what offline generation wants).
        """
        params = params or SamplingParams()
        request_id = request_id or self.new_request_id()
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        params.check_vocab(self.model_info.vocab_size)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        params = self._for_task(params)
        params = self._with_engine_stops(params)
        self.structured.validate(params)  # an uncompilable grammar is refused here
        arrival = time.time() if arrival_time is None else arrival_time
        child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        )
        added: list[str] = []
        try:
            for i, cid in enumerate(child_ids):
                child_params = params if params.n == 1 else params.for_child(i)
                share = child_ids[0] if i > 0 and self.config.cache.enable_prefix_caching else None
                req = Request(cid, token_ids, child_params, self.eos_token_id, arrival, share)
                self.scheduler.add_request(req)
                added.append(cid)
                self.structured.add(cid, child_params)
        except Exception:
            self.scheduler.abort_requests(added)  # all or nothing
            self.structured.remove(added)
            raise
        self.output_processor.add_request(
            request_id, child_ids, text, token_ids, params, arrival, final_only
        )
        return request_id

    def _for_task(self, params: SamplingParams) -> SamplingParams:
        """An embedding engine takes only embedding requests (made to compute the prompt and
        stop), a generating engine only generation requests."""
        import dataclasses

        if self.task != "embed":
            if params.pooling is not None:
                raise ValueError("embeddings need an engine started with task='embed' (--task)")
            return params
        if params.pooling is None:
            raise ValueError("this engine embeds (task='embed'): it does not generate text")
        if params.n != 1:
            raise ValueError("an embedding request has n=1")
        pooling, width = params.pooling, self.model_info.hidden_size
        if pooling.dimensions is not None and pooling.dimensions > width:
            raise ValueError(f"dimensions={pooling.dimensions} is more than the model's {width}")
        if pooling.pooling is None:
            pooling = dataclasses.replace(pooling, pooling=self.config.model.pooling)
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, pooling=pooling)

    def _with_engine_stops(self, params: SamplingParams) -> SamplingParams:
        if not self._extra_eos or params.ignore_eos:
            return params
        import dataclasses

        extra = [t for t in self._extra_eos if t not in params.stop_token_ids]
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its n sequences) in any state; its KV blocks are freed now."""
        child_ids = self.output_processor.child_ids(request_id)
        self.scheduler.abort_requests(child_ids)
        self.structured.remove(child_ids)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        in_flight = self._overlap is not None and self._overlap.has_work()
        return in_flight or self.scheduler.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._overlap is not None:  # --async-scheduling, or pipeline batches in flight
            return self._overlap.step()
        sched = self.schedule()
        if sched.total_num_scheduled_tokens or sched.finished_req_ids:
            runner_out = self.executor.execute_model(sched)
        else:
            runner_out = ModelRunnerOutput()
        return self.finish_step(sched, runner_out)

    def schedule(self, grammar_later: bool = False) -> SchedulerOutput:
        """The next step's batch; its new requests' queue time ends now. ``grammar_later``: the
        constrained rows' mask is left to the overlapped loop (``sched.grammar_later``: any)."""
        sched = self.scheduler.schedule()
        if self.structured.active:
            if grammar_later:
                sched.grammar_later = bool(self.structured.rows(sched, self.scheduler.requests))
            else:
                sched.grammar = self.structured.bitmask(sched, self.scheduler.requests)
        if sched.new_reqs:
            self.output_processor.mark_scheduled([r.req_id for r in sched.new_reqs], time.time())
        return sched

    def finish_step(
        self, sched: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply a step's tokens: stops, frees, detokenized outputs (and stop-string aborts)."""
        return self.emit(self.apply_step(sched, runner_out))

    def apply_step(
        self, sched: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """A step's tokens into the scheduler (and the grammars' matchers)."""
        if self._trace is not None:
            self._trace.record(sched, runner_out, self.scheduler)
        core_outputs = self.scheduler.update(sched, runner_out)
        if self.structured.active:
            self.structured.accept(core_outputs)
        return core_outputs

    def emit(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Applied tokens -> detokenized outputs; stop strings abort their requests."""
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.abort_requests(stopped, reason=FinishReason.STOP)
        if self.structured.active:
            self.structured.prune(self.scheduler.requests)
        return outputs

    def stats(self) -> EngineStats:
        s, g = self.scheduler, self.structured.stats
        return EngineStats(
            s.num_running,
            s.num_waiting,
            s.kv_cache_usage,
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.num_preemptions,
            g.compiles,
            g.compile_seconds,
            g.cache_queries,
            g.cache_hits,
        )

    def default_sampling_params(
        self, fallback: dict | None = None, **overrides: object
    ) -> SamplingParams:
        """SamplingParams: ``fallback`` (used only when the model's generation_config.json
        sets no sampling field), then the model's defaults, then ``overrides``."""
        model = {k: v for k, v in self.generation_defaults.items() if k in _GEN_KEYS}
        base = dict(fallback or {}) if not model else {}
        return SamplingParams(**{**base, **self.generation_defaults, **overrides})

    def executor_failure(self) -> str | None:
        """Why the workers can no longer run steps (a worker process or node went away),
        noticed between steps too; None while they can."""
        return getattr(self.executor, "failure", None)

    def shutdown(self) -> None:
        self._overlap = None  # steps in flight are dropped with the executor
        self.executor.shutdown()
        if self._trace is not None:
            self._trace.close()
            self._trace = None


def _load_tokenizer(files: ModelFiles | None, tokenizer: str | None) -> Tokenizer:
    with progress.stage("Loading the tokenizer") as st:
        tok = Tokenizer.load(files, tokenizer)
        st.summary = "loaded the tokenizer"
    return tok


def resolve_task(task: str, architecture: str) -> str:
    """auto: embed for a bare transformer (``Qwen3Model``: an embedding checkpoint), else
    generate."""
    if task != "auto":
        return task
    return "embed" if architecture.endswith("Model") else "generate"


_GEN_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(files: ModelFiles | None, source: str = "auto") -> dict:
    """Sampling defaults from generation_config.json (eos ids included): the HF folder's
    (``source`` "auto"), none ("vllm"), or the one in the folder ``source`` names."""
    if source == "vllm":
        return {}
    if source != "auto":
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config {source!r}: no generation_config.json there")
    elif files is None or files.kind != "hf":
        return {}
    else:
        path = os.path.join(files.folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path}: expected a JSON object")
    out = {k: gen[k] for k in _GEN_KEYS if gen.get(k) is not None}
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0  # the checkpoint asks for greedy decoding
    eos = gen.get("eos_token_id")
    if eos is not None:
        out["eos_token_ids"] = eos if isinstance(eos, list) else [eos]
    return out
