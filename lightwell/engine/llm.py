"""The offline API, shaped like vLLM's: LLM(model=...).generate(...) / .chat(...)."""

from __future__ import annotations

import signal
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from lightwell.config import EngineConfig
from lightwell.engine.interrupts import StepGuard
from lightwell.engine.llm_engine import LLMEngine, PromptInput
from lightwell.types import PoolingParams, RequestOutput, SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    ``LLM()`` loads the default model (SmolLM2-135M-Instruct); engine options are the flat
    names of ``lightwell.config`` (``dtype=``, ``max_num_seqs=``, ``enable_prefix_caching=`` ...).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        # worker processes stop when this object goes away, at exit, or on shutdown()
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine and its worker processes (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or a prompt dict); outputs in input order."""
        prompts = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    c, add_generation_prompt=add_generation_prompt, chat_template=chat_template
                )
            }
            for c in convs
        ]
        params = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """The prompts' embeddings (``RequestOutput.embedding``), in input order; the engine
        must have been made with ``task="embed"`` (or load an embedding architecture)."""
        prompts = _as_prompt_list(prompts)
        params = SamplingParams(pooling=pooling_params or PoolingParams())
        return self._run(prompts, [params] * len(prompts), use_tqdm)

    def _params_list(
        self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        return sp

    def _run(
        self, prompts: list[PromptInput], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(engine.add_request(None, p, sp, final_only=True))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            # Ctrl-C (and a multi-process engine's SIGTERM) between steps: ranks stay in step
            with StepGuard((signal.SIGINT, signal.SIGTERM)) as guard:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            bar.update(1)
                    guard.check()
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single list of token ids
    return prompts
