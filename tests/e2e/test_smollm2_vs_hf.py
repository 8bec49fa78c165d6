"""SmolLM2 from the GGUF: our greedy output is token-for-token HF transformers' (fp32)."""

from __future__ import annotations

import pytest

from lightwell import LLM, SamplingParams
from tests.e2e.conftest import CHAT_PROMPTS, MAX_NEW

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _run(llm: LLM, hf_reference) -> list:
    prompts = [{"prompt_token_ids": hf_reference[p][0]} for p in CHAT_PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, out in zip(CHAT_PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_reference[p][1], p
    return outs


@pytest.fixture(scope="module")
def llm_chunked():
    # 16-token chunks: every prompt (~35-50 tokens) is prefilled in several steps, mixed with
    # the decodes of the others.
    return LLM(max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True)


def test_batched_chunked_prefill_matches_hf(llm_chunked, hf_reference):
    _run(llm_chunked, hf_reference)


def test_second_run_hits_prefix_cache(llm_chunked, hf_reference):
    before = llm_chunked.engine.stats().prefix_cache_hits
    outs = _run(llm_chunked, hf_reference)
    # The shared system prompt alone is > 2 blocks; the whole prompts are cached from run 1.
    assert all(o.num_cached_tokens >= 32 for o in outs)
    assert llm_chunked.engine.stats().prefix_cache_hits > before


def test_tiny_kv_cache_preempts_and_still_matches(hf_reference):
    # 14 blocks x 16 = 224 tokens for 7 requests of ~80 tokens each: preemption must happen.
    llm = LLM(num_kv_blocks=14, max_num_batched_tokens=64, enable_prefix_caching=False)
    _run(llm, hf_reference)
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.scheduler.num_free_blocks == 14


def test_chat_api_matches_hf(llm_chunked, hf_reference):
    msgs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:3]]
    outs = llm_chunked.chat(msgs, GREEDY, use_tqdm=False)
    for p, out in zip(CHAT_PROMPTS, outs):
        assert out.prompt_token_ids == hf_reference[p][0]
        assert out.outputs[0].token_ids == hf_reference[p][1]
