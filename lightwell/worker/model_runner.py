"""SchedulerOutput -> ModelInput -> logits -> sampled tokens, on one device."""

from __future__ import annotations

import functools
import logging
import math
import mmap
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightwell.attention.backend import get_attention_backend
from lightwell.attention.metadata import AttentionMetadata, forward_context
from lightwell.distributed.parallel_state import get_tp_size, tp_broadcast
from lightwell.dual_stream import DualStream
from lightwell.layers.attention import Attention
from lightwell.layers.rotary import rope_table_length
from lightwell.quant.kv_cache import cache_dtype, check_head_dim, stored_head_size
from lightwell.scheduler.output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from lightwell.worker import context_parallel
from lightwell.worker.cuda_graph import CudaGraphRunner, take_sampled
from lightwell.worker.input_batch import InputBatch, ModelInput, to_device
from lightwell.worker.pending_step import PendingStep
from lightwell.worker.pipeline_stage import PipelineStage
from lightwell.worker.pooling import Pooler, take_pooled
from lightwell.worker.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from lightwell.worker.sampling_metadata import build_sampling_metadata, plain_greedy
from lightwell.worker.structured_output import grammar_mask

if TYPE_CHECKING:
    from lightwell.worker.cpu_decode import CpuDecode

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        is_driver: bool = True,
        kv_cache_dtype: str = "auto",
        pipeline: bool = False,
    ) -> None:
        """``kv_cache_dtype``: auto, fp8 or int8 (``lightwell/quant/kv_cache.py``).
        ``is_driver``: this rank samples. Under tensor parallelism only rank 0 does; the
        others compute the same logits (their share of the LM head's all-gather) and drop them
        (all-greedy steps: every rank computes the tokens, ``_sharded_greedy``); every rank
        learns rank 0's tokens from the next step's SchedulerOutput. ``pipeline``: a stage."""
        self.model = model
        self.is_driver = is_driver
        self.stage = PipelineStage(model, dtype, device) if pipeline else None
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = cache_dtype(kv_cache_dtype, dtype)
        self.batch = InputBatch(block_size, device, max_positions=rope_table_length(model))
        self.sampler = Sampler()
        self.pooler = Pooler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        for layer in self.attn_layers:
            check_head_dim(layer.head_dim, self.kv_dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CudaGraphRunner | None = None
        self.cpu_decode: CpuDecode | None = None  # set by the worker (--fused-cpu-decode)
        self.overlap: DualStream | None = None  # set by the worker (--dual-stream)
        # Async scheduling under tensor parallelism: rank 0 broadcasts its sampled tokens so
        # every rank can feed a token still in flight to the next step (set by the worker).
        self.share_sampled_tokens = False
        # The last step's sampled tokens: req_id -> row, and the [S] int64 device tensor.
        self._last_sampled: tuple[list[str], torch.Tensor] = ([], torch.empty(0))

    def set_attention_backend(self, name: str) -> None:
        """auto: Triton kernels on GPU, the torch reference on CPU."""
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        backend = get_attention_backend(name)
        for layer in self.attn_layers:
            layer.backend = backend

    def capture_cuda_graphs(
        self, max_batch: int, max_model_len: int, prefill_tokens: int = 0, capture: bool = True
    ) -> float:
        """Decode graphs up to ``max_batch`` requests, mixed-step graphs up to ``prefill_tokens``
        tokens. ``capture=False`` (CPU tests) sets up the padded inputs and replays by running
        the forward on them. A pipeline stage captures its layers alone (``PipelineStage``)."""
        kv_heads = self.attn_layers[0].num_kv_heads if self.attn_layers else 0
        stage = self.stage
        self.graphs = CudaGraphRunner(
            max_batch,
            max_model_len,
            self.block_size,
            self.device,
            self.forward if stage is None else stage.graph_forward,
            prefill_tokens,
            num_kv_heads=kv_heads,
            stage_input=None if stage is None else stage.graph_input(),
        )
        if not capture:
            self.graphs.prepare_without_graphs()
            return 0.0
        return self.graphs.capture()

    # ---- KV cache -------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Per the layers' own cache shapes: [2, 1, B, Hkv, D] for K and V, [1, 1, B, 1, D]
        for a latent-cache (MLA) layer; an 8-bit cache stores D + 4 per row (its scale)."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        per_layer = [math.prod(self._kv_shape(a, 1)) for a in self.attn_layers]
        return sum(per_layer) * elem

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's cache (``kv_cache_shape``: [2, num_blocks, block_size, Hkv, D]
        for K and V; one latent entry a token for MLA layers) and bind it."""
        self.batch.num_blocks = num_blocks
        self.kv_caches = []
        self.cpu_decode = None  # it points into the caches: built again after them
        for layer in self.attn_layers:
            shape = self._kv_shape(layer, num_blocks)
            cache = _zeros(shape, self.kv_dtype, self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    def _kv_shape(self, layer: nn.Module, num_blocks: int) -> list[int]:
        """The layer's cache shape with each row as stored in the cache dtype."""
        shape = list(layer.kv_cache_shape(num_blocks, self.block_size))
        shape[-1] = stored_head_size(self.kv_dtype, shape[-1])
        return shape

    # ---- one step ---------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.stage is None:
            return self.launch(sched).result()
        t0, waited = time.perf_counter(), self.stage.times["recv_wait_s"]
        pending = self.launch(sched)
        self.stage.end_step()
        out = pending.result()
        if sched.total_num_scheduled_tokens:
            self.stage.count_step(time.perf_counter() - t0, waited)
        return out

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """Queue the step's work on the device; ``result()`` waits for its sampled tokens (async
        scheduling: step N+1's tokens still being sampled by step N are taken on the device)."""
        self.batch.apply(sched)
        self.pooler.forget(sched.finished_req_ids)
        if sched.total_num_scheduled_tokens == 0:
            return PendingStep(ModelRunnerOutput())
        sampled_req_ids, sampled = self._last_sampled
        inp = self.batch.prepare(sched, sampled_req_ids)
        # input tokens the previous step is still sampling, taken from its tokens on the device
        deferred = None if inp.token_src is None else (inp.token_src, sampled)
        key = self.graphs.graph_for(inp.meta) if self.graphs is not None else None
        if key is None and deferred is not None:  # (a graph's replay takes them itself)
            take_sampled(inp.input_ids, *deferred)
        if key is not None:  # [T, H]; None on a pipeline stage before the last
            args = (inp.input_ids, inp.positions, inp.meta, key)
            if self.stage is not None:
                hidden = self.stage.replay(self.graphs, *args, deferred=deferred)
            else:
                hidden = self.graphs.run(*args, deferred=deferred)
            path = f"graph {key[0]} {key[1]}"
        elif self.cpu_decode is not None and self.cpu_decode.applies(inp.meta):
            hidden, logits, tokens = self.cpu_decode.forward(inp.input_ids, inp.positions, inp.meta)
            inp.fused_logits = (logits, tokens) if logits is not None else None
            path = "fused cpu"
        elif context_parallel.applies(inp.meta):  # this rank's chunk, then all of them
            hidden = context_parallel.forward(self, inp.input_ids, inp.positions, inp.meta)
            path = "eager context-parallel"
        else:
            split = self._splits(inp.meta)
            hidden = self.forward(inp.input_ids, inp.positions, inp.meta, split)  # [T, H]
            path = "eager split" if split else "eager"
        pending = PendingStep(ModelRunnerOutput(path=path))
        if hidden is None:  # an earlier pipeline stage: its activations went to the next
            return pending
        if any(self.batch.requests[r].sampling_params.pooling for r in inp.req_ids):
            pooled = self.pooler.step(inp, hidden, self.batch.requests)
            take_pooled(inp, pooled, pending.out if self.is_driver else None, self.batch.requests)
        rows = functools.partial(self._sample_rows, inp, hidden, pending)
        if inp.sample_req_ids and sched.grammar_later and self.is_driver:
            pending.deferred = rows  # run by ``pending.sample``, which brings the mask
        else:
            rows(sched.grammar)
        return pending

    def _sample_rows(
        self,
        inp: ModelInput,
        hidden: torch.Tensor,  # [T, H]
        pending: PendingStep,
        grammar: GrammarBitmask | None,
    ) -> None:
        """Sampling, then prompt logprobs: in this order on every rank, so their logits
        collectives pair up also when rank 0 samples later (``grammar_later``)."""
        if inp.sample_req_ids:
            self._sample(inp, hidden, pending, grammar)
        if inp.prompt_logprob_rows:
            self._prompt_logprobs(inp, hidden, pending.out)

    def _last_sampled_rows(self) -> tuple[dict[str, int], torch.Tensor]:
        """The previous step's sampled tokens [S] and each request's row in them."""
        req_ids, tokens = self._last_sampled
        return {r: i for i, r in enumerate(req_ids)}, tokens

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        split: bool | None = None,  # the step runs as micro-batches (None: _splits decides)
    ) -> torch.Tensor | None:  # [T, H]; None on a pipeline stage before the last
        if split is None:
            split = self._splits(meta)
        if split:
            return self.overlap.forward(input_ids, positions, meta)
        with forward_context(meta):
            return self._run_model(input_ids, positions)

    def _run_model(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
    ) -> torch.Tensor | None:  # [T, H]; None on a pipeline stage before the last
        if self.stage is None:
            return self.model(input_ids, positions)
        return self.stage.forward(input_ids, positions)

    def _greedy_tokens(self, inp: ModelInput, hidden: torch.Tensor) -> torch.Tensor | None:
        """The step's tokens [S] when every sampling row is plain greedy and no sampler is
        needed: the argmax the fused CPU decode took in C, or the model's ``greedy_tokens``
        (``_sharded_greedy``) on every rank; else None."""
        if inp.fused_logits is not None and self._plain_greedy(inp):
            return inp.fused_logits[1][inp.logits_indices]
        if self._sharded_greedy(inp):
            return self.model.greedy_tokens(_sampling_rows(inp, hidden))
        return None

    def _splits(self, meta: AttentionMetadata) -> bool:
        """The step runs as micro-batches (--dual-stream)."""
        return self.overlap is not None and self.overlap.applies(meta)

    def _sample(
        self,
        inp: ModelInput,
        hidden: torch.Tensor,
        pending: PendingStep,
        grammar: GrammarBitmask | None = None,
    ) -> None:
        tokens = self._greedy_tokens(inp, hidden)
        if tokens is not None:
            self._last_sampled = (inp.sample_req_ids, tokens)
            if self.is_driver:
                pending.set_tokens(inp.sample_req_ids, SamplerOutput(tokens))
            return
        if inp.fused_logits is not None:
            logits = inp.fused_logits[0][inp.logits_indices]  # [S, V]
        else:
            logits = self.model.compute_logits(_sampling_rows(inp, hidden))  # [S, V]
        if not self.is_driver:
            if self.share_sampled_tokens:  # rank 0's tokens, to feed the next step in flight
                tokens = torch.empty(len(inp.sample_req_ids), dtype=torch.int64, device=self.device)
                self._last_sampled = (inp.sample_req_ids, tp_broadcast(tokens))
            return
        try:
            result = self._run_sampler(inp, logits, grammar)
        except BaseException:
            if self.share_sampled_tokens:  # keep the ranks' collectives paired: the step
                # fails here, and its requests are aborted, so these tokens are never used
                tp_broadcast(torch.zeros_like(inp.logits_indices))
            raise
        if self.share_sampled_tokens:
            tp_broadcast(result.token_ids)
        self._last_sampled = (inp.sample_req_ids, result.token_ids)
        pending.set_tokens(inp.sample_req_ids, result)

    @functools.cached_property
    def _can_shard_greedy(self) -> bool:
        """The model's ``greedy_tokens`` applies (its logits untransformed, ``sharded_greedy``)
        and pays: under tensor parallelism, or on a GPU (fixed for the runner's life: worked
        out once, not every step)."""
        model_greedy = bool(getattr(self.model, "sharded_greedy", False))
        return model_greedy and (get_tp_size() > 1 or self.device.type == "cuda")

    def _sharded_greedy(self, inp: ModelInput) -> bool:
        """A step whose every sampling row is plain greedy (no logprobs, logit bias, penalties
        or min_tokens still in force) takes the model's ``greedy_tokens`` instead of the
        sampler: under tensor parallelism the argmax of the vocab-sharded logits without
        gathering them (every rank gets the tokens, so none is broadcast either), on one GPU
        the argmax of the LM head's logits as they come, in one launch (kernels/argmax.py).
        Decided from what every rank holds alike (the requests' parameters and output counts),
        so all ranks take the same path."""
        return self._can_shard_greedy and self._plain_greedy(inp)

    def _plain_greedy(self, inp: ModelInput) -> bool:
        """Every sampling row of the step is plain greedy (``plain_greedy``)."""
        return all(
            plain_greedy(self.batch.requests[r].sampling_params, n_out)
            for r, n_out in zip(inp.sample_req_ids, inp.num_outputs)
        )

    def _run_sampler(
        self, inp: ModelInput, logits: torch.Tensor, grammar: GrammarBitmask | None = None
    ) -> SamplerOutput:
        # logits: [S, V]
        states = [self.batch.requests[r] for r in inp.sample_req_ids]
        params = [s.sampling_params for s in states]
        if any(p.uses_penalties for p in params):  # penalties read whole token histories
            prompts = [s.token_ids[: s.num_prompt_tokens] for s in states]
            outputs = self._output_histories(inp, states)
        else:  # only the output lengths matter (min_tokens, seeds): no per-step copies
            prompts = [()] * len(states)
            outputs = [range(n) for n in inp.num_outputs]
        meta = build_sampling_metadata(
            params,
            prompts,
            outputs,
            [s.eos_token_id for s in states],
            logits.shape[-1],
            self.device,
            self.generator,
        )
        if grammar is not None:
            meta.grammar = grammar_mask(grammar, inp.sample_req_ids, self.device)
        return self.sampler(logits, meta)

    def _output_histories(self, inp: ModelInput, states: list) -> list[list[int]]:
        """Each sampling request's output tokens, with the one still in flight (a host sync:
        penalties cost async scheduling its overlap)."""
        deferred = {r for _, r in inp.deferred_tokens}
        if not deferred:
            return [s.output_token_ids for s in states]
        rows, tokens = self._last_sampled_rows()
        host = tokens.tolist()
        return [
            s.output_token_ids + ([host[rows[s.req_id]]] if s.req_id in deferred else [])
            for s in states
        ]

    def _prompt_logprobs(
        self, inp: ModelInput, hidden: torch.Tensor, out: ModelRunnerOutput
    ) -> None:
        for req_id, (rows, targets) in inp.prompt_logprob_rows.items():
            if not rows:
                continue
            k = self.batch.requests[req_id].sampling_params.prompt_logprobs or 0
            idx = to_device(torch.tensor(rows, dtype=torch.int64), self.device)  # [P]
            logits = self.model.compute_logits(hidden[idx])  # [P, V]
            if not self.is_driver:
                continue
            target = to_device(torch.tensor(targets, dtype=torch.int64), self.device)  # [P]
            out.prompt_logprobs[req_id] = compute_prompt_logprobs(logits, target, k)


def _sampling_rows(inp: ModelInput, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [S, H]
    """The hidden rows of the step's sampling tokens. Their indices increase, one a request at
    most, so as many as the tokens are all of them (a decode step's): no gather launched."""
    every_row = inp.logits_indices.shape[0] == hidden.shape[0]
    return hidden if every_row else hidden[inp.logits_indices]


def _zeros(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache. On the CPU an anonymous memory map (small pages): zero without
    being written, so the process's resident memory grows with the cache's use, not its size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
