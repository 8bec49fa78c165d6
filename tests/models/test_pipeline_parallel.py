"""Pipeline parallelism on CPU (gloo, 1 thread a process): PP=2 and TP=2 x PP=2 (four processes)
give TP=1's greedy tokens on SmolLM2 with chunked prefill and prefix hits, and on a tiny dense
(Qwen2: tied LM head, 3 layers split 2 + 1) and a tiny MoE family (Qwen2-MoE) under preemption,
PP=2 with one batch in flight and TP=2 x PP=2 with two (the default: one a stage); killing a
stage's worker mid-run raises a WorkerError, not a hang."""

from __future__ import annotations

import pytest

from lightwell import LLM, SamplingParams
from lightwell.distributed.pipeline import describe_split, stage_split
from lightwell.executor.messages import WorkerError
from tests.models.test_tensor_parallel_engine import PROMPTS, _generate_in_time

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TOKENS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)


def test_stage_split_is_contiguous_and_even():
    assert stage_split(30, 2) == [(0, 15), (15, 30)]
    assert stage_split(3, 2) == [(0, 2), (2, 3)]
    assert stage_split(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert "stage 1: layers 2-2 (1)" in describe_split(3, 2)
    with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
        stage_split(3, 4)


def test_config_refuses_async_and_dual_stream_with_stages():
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(pipeline_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        LLM(pipeline_parallel_size=0)


def _chat(llm: LLM) -> list[list[int]]:
    # the same system prompt twice over: the second round's prompts hit the prefix cache
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    outs = llm.chat(msgs + msgs, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_pp_greedy_equals_tp1_smollm2():
    ref = LLM(num_threads=1, max_num_batched_tokens=24)
    expected = _chat(ref)
    ref.engine.shutdown()
    for tp, pp in ((1, 2), (2, 2)):
        llm = LLM(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            num_threads=1,
            max_num_batched_tokens=24,  # prompts prefilled in chunks beside the others' decodes
        )
        try:
            model = llm.engine.executor.worker.runner.model
            assert (model.model.start_layer, model.model.end_layer) == (0, 15)
            assert type(model.lm_head).__name__ == "PPMissingLayer"  # the last stage's
            assert _chat(llm) == expected, (tp, pp)
        finally:
            llm.engine.shutdown()


FAMILY_PROMPTS = [list(range(3, 40)), list(range(50, 61)), [7, 8, 9, 10, 11] * 5]


@pytest.mark.parametrize("family", ["qwen2_yarn_window", "qwen2_moe_shared"])
def test_pp_families_equal_tp1_under_preemption(tmp_path, family):
    from tests.models.families import FAMILIES

    folder = str(tmp_path / family)
    FAMILIES[family].build(folder, 3)
    # 7 blocks of 16 tokens for three requests that grow to ~50 tokens: preemption happens
    opts = dict(num_threads=1, num_kv_blocks=7, max_num_batched_tokens=24, block_size=16)
    prompts = [{"prompt_token_ids": p} for p in FAMILY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    results = []
    for tp, pp, in_flight in ((1, 1, None), (1, 2, 1), (2, 2, None)):
        llm = LLM(
            folder,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            pipeline_in_flight=in_flight,
            **opts,
        )
        try:
            depths = _record_in_flight(llm)
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
            preempted = llm.engine.scheduler.num_preemptions
        finally:
            llm.engine.shutdown()
    assert results[1] == results[0] and results[2] == results[0]
    assert preempted > 0
    assert max(depths) == 1  # the default: a second batch launched behind the first


def _record_in_flight(llm: LLM) -> list[int]:
    """Before each step of the pipeline's loop, the batches already in flight (1: the step
    launches a second batch while the first is still in the pipeline)."""
    loop, before = llm.engine._overlap, [0]
    if loop is None:
        return before
    step = loop.step

    def recorded() -> list:
        before.append(len(loop.in_flight))
        return step()

    loop.step = recorded
    return before


def test_killed_stage_worker_raises(tmp_path):
    from tests.models.families import FAMILIES

    folder = str(tmp_path / "qwen2")
    FAMILIES["qwen2_yarn_window"].build(folder, 3)
    llm = LLM(folder, pipeline_parallel_size=2, num_threads=1, num_kv_blocks=32)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], TOKENS, use_tqdm=False)  # healthy
        proc = llm.engine.executor.procs[0]  # the last stage
        proc.kill()
        proc.join()
        error = _generate_in_time(llm)
        assert isinstance(error, WorkerError), repr(error)
    finally:
        llm.engine.shutdown()
