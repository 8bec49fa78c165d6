"""The engine at tensor_parallel_size=2 on CPU (2 processes over gloo, 1 thread each): greedy
SmolLM2 output equals TP=1, also with --async-scheduling (SmolLM2-135M has 9 query / 3 KV
heads, so this also covers the uneven head split: 6 + 3 query heads, 2 + 1 KV heads); and a
worker that dies or raises surfaces in the engine as a WorkerError instead of a hang."""

from __future__ import annotations

import threading

import pytest

from lightwell import LLM, SamplingParams
from lightwell.executor.messages import ExecuteModel, WorkerError
from lightwell.scheduler.output import CachedRequestData, SchedulerOutput

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
TOKENS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
CHOICE = SamplingParams(  # prompt logprobs: more collectives in its steps, to keep in order
    temperature=0.0, max_tokens=4, structured_outputs={"choice": ["383"]}, prompt_logprobs=1
)
HANG_S = 60.0


def _greedy(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _count_sharded_greedy(llm: LLM) -> list[bool]:
    """Rank 0's choices of the sharded greedy argmax (no logits gathered), one per step."""
    runner = llm.engine.executor.worker.runner
    chosen, decide = [], runner._sharded_greedy
    runner._sharded_greedy = lambda inp: chosen.append(decide(inp)) or chosen[-1]
    return chosen


def _check_both_sampling_paths(llm: LLM, expected: list[list[int]]) -> None:
    """All-greedy steps take the sharded argmax; a request wanting logprobs makes its steps
    gather the logits and run the sampler; the tokens are TP=1's either way."""
    sharded = _count_sharded_greedy(llm)
    assert _greedy(llm) == expected
    assert sharded and all(sharded)  # every step: the argmax without gathering logits
    sharded.clear()
    logprobs = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    assert _greedy(llm, [GREEDY, logprobs, GREEDY]) == expected
    assert False in sharded and True in sharded  # (the others go on alone at the end)


def test_tp2_greedy_equals_tp1_smollm2():
    ref = LLM(num_threads=1)
    expected = _greedy(ref)
    constrained = _greedy(ref, [GREEDY, CHOICE, GREEDY])
    ref.engine.shutdown()
    # A 16-token budget: prompts are prefilled in chunks mixed with the others' decodes.
    llm = LLM(tensor_parallel_size=2, num_threads=1, max_num_batched_tokens=16)
    try:
        heads = llm.engine.executor.worker.runner.model.model.layers[0].self_attn.qkv_proj
        assert (heads.num_heads, heads.num_kv_heads) == (6, 2)  # rank 0's share of 9 / 3
        _check_both_sampling_paths(llm, expected)
    finally:
        llm.engine.shutdown()
    # Async scheduling: rank 1 feeds the tokens in flight from its own sharded argmax, or,
    # in steps with a logprobs request, from rank 0's broadcast.
    llm = LLM(
        tensor_parallel_size=2, num_threads=1, max_num_batched_tokens=16, async_scheduling=True
    )
    try:
        assert llm.engine._overlap is not None
        _check_both_sampling_paths(llm, expected)
        # a grammar's step samples after its forward, once rank 0 has filled the mask: the
        # ranks' collectives (logits gathers, token broadcast) still pair up
        assert _greedy(llm, [GREEDY, CHOICE, GREEDY]) == constrained
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from tests.models.tiny import hf_tiny_model, save_hf, tiny_config

    folder = str(tmp_path_factory.mktemp("tiny_tp"))
    return save_hf(hf_tiny_model(tiny_config("base", num_key_value_heads=2), seed=1), folder)


def _tiny_tp2(folder: str) -> LLM:
    llm = LLM(
        folder, tensor_parallel_size=2, num_threads=1, skip_tokenizer_init=True, num_kv_blocks=32
    )
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], TOKENS, use_tqdm=False)  # healthy first
    return llm


def _generate_in_time(llm: LLM) -> BaseException | None:
    """Run a generate call that must fail; return its exception (fail the test on a hang)."""
    result: list[BaseException | None] = [None]

    def run() -> None:
        try:
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], TOKENS, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), "the engine hung after a worker failure"
    return result[0]


def test_killed_worker_raises(tiny_folder):
    llm = _tiny_tp2(tiny_folder)
    proc = llm.engine.executor.procs[0]
    proc.kill()
    proc.join()
    error = _generate_in_time(llm)
    assert isinstance(error, WorkerError), repr(error)
    llm.engine.shutdown()


def test_worker_exception_raises_with_its_traceback(tiny_folder):
    llm = _tiny_tp2(tiny_folder)
    executor = llm.engine.executor
    # A step for a request the worker never saw: KeyError in the worker only.
    ghost = SchedulerOutput([], [CachedRequestData("ghost-req", [], [], 0)], {"ghost-req": 1}, 1)
    executor.conns[0].send(ExecuteModel(ghost))
    error = _generate_in_time(llm)
    assert isinstance(error, WorkerError), repr(error)
    assert "ghost-req" in str(error) and "rank 1" in str(error)
    llm.engine.shutdown()


def test_failed_start_leaves_nothing_behind(tiny_folder):
    """An engine that fails after its workers started shuts them down: a new one can start."""
    with pytest.raises(ValueError, match="exceeds the model's"):
        LLM(
            tiny_folder,
            tensor_parallel_size=2,
            num_threads=1,
            skip_tokenizer_init=True,
            max_model_len=10**6,
        )
    llm = _tiny_tp2(tiny_folder)  # would fail: "process group initialized twice"
    llm.engine.shutdown()
