"""A ``ModelRunner``'s start-up work, run once by the worker before serving: the forward that
measures peak activation memory, the warm-up step, and compiling every kernel variant."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from lightwell.attention.metadata import AttentionMetadata, forward_context
from lightwell.scheduler.output import NewRequestData, SchedulerOutput
from lightwell.types import SamplingParams

if TYPE_CHECKING:
    from lightwell.worker.model_runner import ModelRunner


@torch.inference_mode()
def profile_run(
    runner: ModelRunner, num_tokens: int, max_position: int, num_logit_rows: int = 256
) -> None:
    """A forward over a maximal batch with no KV cache, to measure peak activation memory.
    Positions count up and wrap at ``max_position`` (the model's length): a step budget
    longer than the model (8,192 tokens on a 2,048-position model) must not index RoPE's
    table past its end, which the GPU kernel would do silently (an illegal address, or
    none, depending on what lies after the table)."""
    dev = runner.device
    ids = torch.randint(0, runner.vocab_size, (num_tokens,), device=dev)
    pos = torch.arange(num_tokens, device=dev) % max_position
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
        block_table=torch.zeros((1, 1), dtype=torch.int32, device=dev),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
    )
    with forward_context(meta):
        hidden = runner._run_model(ids, pos)  # [T, H]
    if hidden is None:  # an earlier pipeline stage
        return
    logits = runner.model.compute_logits(hidden[: min(num_tokens, num_logit_rows)])
    torch.softmax(logits, dim=-1)
    del hidden, logits


def warmup(runner: ModelRunner) -> float:
    """Run two tiny steps so first-request latency excludes lazy initialisation (one sampled
    request, then one greedy: the sampler's path and the greedy argmax's); on CUDA then compile
    the attention backends' and the MoE experts' kernel variants. Returns the seconds it
    took."""
    t0 = time.perf_counter()
    for req_id, params in (
        ("__warmup__", SamplingParams(max_tokens=1)),
        ("__warmup_greedy__", SamplingParams(max_tokens=1, temperature=0.0)),
    ):
        req = NewRequestData(req_id, [1, 2, 3, 4], 4, params, [0], 0)
        runner.execute_model(SchedulerOutput([req], [], {req_id: 4}, 4))
        runner.batch.requests.pop(req_id, None)
    if runner.device.type == "cuda":
        compile_attention_variants(runner)
        for module in runner.model.modules():  # MoE experts' kernel variants
            compile_fn = getattr(module, "compile_kernel_variants", None)
            if callable(compile_fn):
                compile_fn()
    return time.perf_counter() - t0


def compile_attention_variants(runner: ModelRunner) -> int:
    """Have each attention backend of ``runner.attn_layers`` compile every kernel variant
    serving can meet, once per distinct layer shape (CUDA-graph capture covers only its own
    steps' variants; an eager step would compile the rest mid-serving). Returns the launches
    made."""
    done: set[tuple] = set()
    launches = 0
    for layer in runner.attn_layers:
        compile_fn = getattr(layer.backend, "compile_variants", None)
        if compile_fn is None or layer.kv_cache is None:
            continue
        key = (
            layer.backend.name,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.sliding_window,
            layer.kv_cache.dtype,
        )
        if key in done:
            continue
        done.add(key)
        launches += compile_fn(
            layer.num_heads, layer.kv_cache, layer.scale, runner.dtype, layer.sliding_window
        )
    return launches
