"""Context parallelism on CPU (2 processes over gloo, 1 thread each): a 2,048-token prompt's
prefill split over two ranks (all-gather of K/V) gives the greedy tokens of one rank, in one
step and in chunks mixed with a second request (a request cut across the ranks' chunks, its
later part attending to the earlier part through the cache); decodes run whole on each rank."""

from __future__ import annotations

import random

import pytest

from lightwell import LLM, SamplingParams
from tests.models.tiny import hf_tiny_model, save_hf, tiny_config

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    cfg = tiny_config("base", max_position_embeddings=4096, tie_word_embeddings=True)
    return save_hf(hf_tiny_model(cfg, seed=7), str(tmp_path_factory.mktemp("cp")))


def _prompts() -> list[dict]:
    rng = random.Random(0)
    long = [rng.randrange(3, 300) for _ in range(2048)]
    return [{"prompt_token_ids": long}, {"prompt_token_ids": long[:300] + [5, 6, 7]}]


def _run(folder: str, cp: int, budget: int) -> tuple[list[list[int]], list[str]]:
    llm = LLM(folder, context_parallel_size=cp, num_threads=1, skip_tokenizer_init=True,
              num_kv_blocks=300, max_num_batched_tokens=budget)  # fmt: skip
    try:
        paths: list[str] = []
        step = llm.engine.executor.execute_model
        llm.engine.executor.execute_model = lambda s: paths.append((out := step(s)).path) or out
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], paths
    finally:
        llm.engine.shutdown()


def test_cp2_greedy_equals_cp1_on_2048_tokens(folder):
    for budget in (2400, 700):  # the long prompt in one step; in chunks beside the other
        expected, _ = _run(folder, 1, budget)
        tokens, paths = _run(folder, 2, budget)
        assert tokens == expected, budget
        assert "eager context-parallel" in paths and "eager" in paths  # prefill split; decodes


def test_cp_refuses_latent_attention(tmp_path):
    """MLA's latent cache is stored by its own layer, not the K/V all-gather: refused."""
    from lightwell.executor.messages import WorkerError
    from tests.models.families import FAMILIES

    folder = str(tmp_path / "deepseek")
    FAMILIES["deepseek_v2_yarn"].build(folder, 3)
    with pytest.raises((ValueError, WorkerError), match="does not support LatentAttention"):
        LLM(folder, context_parallel_size=2, num_threads=1, num_kv_blocks=32)
