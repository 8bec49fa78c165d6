"""--async-scheduling on the real SmolLM2: the overlapped loop gives the plain loop's outputs
(greedy = HF's text; seeded sampling, penalties, min_tokens, logprobs, stop strings, n > 1) with
chunked prefill and a cache small enough to preempt; aborts mid-flight leave nothing behind."""

from __future__ import annotations

import pytest

from lightwell import LLM, SamplingParams
from tests.e2e.conftest import CHAT_PROMPTS, MAX_NEW

ENGINE = dict(max_num_batched_tokens=16, num_threads=2, block_size=16, num_kv_blocks=12)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=0.8, seed=7, max_tokens=20),
    SamplingParams(
        temperature=0.7, seed=3, max_tokens=16, presence_penalty=0.5, repetition_penalty=1.2
    ),
    SamplingParams(temperature=0, max_tokens=30, min_tokens=8, logprobs=2, stop=["."]),
    SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=12, top_k=20),
]


def _chats(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in prompts]


def _summary(outs) -> list:
    rows = []
    for o in outs:
        for c in o.outputs:
            lps = None if c.logprobs is None else [sorted(d) for d in c.logprobs]
            rows.append((o.request_id, c.token_ids, c.finish_reason, c.text, lps))
    return rows


@pytest.fixture(scope="module")
def engines():
    plain, piped = LLM(**ENGINE), LLM(async_scheduling=True, **ENGINE)
    assert piped.engine._overlap is not None and plain.engine._overlap is None
    return plain, piped


def test_overlapped_loop_matches_the_plain_loop_under_preemption(engines, monkeypatch):
    plain, piped = engines
    runner = piped.engine.executor.worker.runner
    prepare, fed = runner.batch.prepare, []

    def counted(*args):
        inp = prepare(*args)
        if inp.token_src is not None:  # input tokens the step before is still sampling
            fed.append(inp)
        return inp

    monkeypatch.setattr(runner.batch, "prepare", counted)
    prompts = CHAT_PROMPTS[:5]
    want = plain.chat(_chats(prompts), PARAMS, use_tqdm=False)
    got = piped.chat(_chats(prompts), PARAMS, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert len(fed) > 20  # the steps really overlapped: tokens in flight were fed on the device
    assert piped.engine.stats().num_preemptions > 0  # 12 blocks of 16 for 6 sequences
    for llm in (plain, piped):
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.num_free_blocks == llm.engine.num_kv_blocks


def test_greedy_text_equals_hf(engines, hf_reference):
    _, piped = engines
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    prompts = CHAT_PROMPTS[:4]
    outs = piped.generate(
        [{"prompt_token_ids": hf_reference[p][0]} for p in prompts], sp, use_tqdm=False
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_reference[p][1][: len(o.outputs[0].token_ids)]
        assert len(o.outputs[0].token_ids) == len(hf_reference[p][1])


def test_abort_with_steps_in_flight(engines):
    _, piped = engines
    engine = piped.engine
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("keep", {"prompt_token_ids": [1, 2, 3, 4, 5]}, sp)
    engine.add_request("drop", {"prompt_token_ids": [6, 7, 8, 9]}, sp)
    seen: dict[str, list[int]] = {}
    for _ in range(6):
        for out in engine.step():
            seen[out.request_id] = out.outputs[0].token_ids
    assert engine._overlap.has_work()
    engine.abort_request("drop")
    finished = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"  # nothing more for the aborted one
            if out.finished:
                finished = out
    assert finished is not None and len(finished.outputs[0].token_ids) == 50
    assert engine.scheduler.num_free_blocks == engine.num_kv_blocks


def test_constrained_requests_under_preemption_in_both_loops(engines, monkeypatch):
    """JSON-schema requests (greedy, seeded n=2) beside free ones, in a cache that preempts:
    each matcher follows its request through recomputation, the overlapped loop keeps a step in
    flight while it fills the next one's mask and gives the plain loop's tokens, and every
    constrained output validates."""
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"enum": [1, 2, 3]}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    so = {"json": schema}
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=so),
        SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=24, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=4, structured_outputs={"choice": ["A", "B"]}),
    ]
    # ~55-token prompts: 5 sequences cannot all keep their blocks in 12 x 16 slots
    prompts = [f"{p} {' '.join(CHAT_PROMPTS[:3])} JSON." for p in ("One", "Two", "3", "4")]
    plain, piped = engines
    loop, overlapped = piped.engine._overlap, []
    held = loop._sample_constrained

    def sample_constrained(sched, handle):
        overlapped.append(bool(loop.in_flight))  # the step before is still to be applied
        return held(sched, handle)

    monkeypatch.setattr(loop, "_sample_constrained", sample_constrained)
    before = [llm.engine.stats().num_preemptions for llm in engines]
    want = plain.chat(_chats(prompts), params, use_tqdm=False)
    got = piped.chat(_chats(prompts), params, use_tqdm=False)
    # request ids differ: the engines served different requests before this test
    assert [r[1:] for r in _summary(got)] == [r[1:] for r in _summary(want)]
    assert all(llm.engine.stats().num_preemptions > n for llm, n in zip(engines, before))
    for o in got[:2]:
        for c in o.outputs:
            jsonschema.validate(json.loads(c.text), schema)
    assert got[3].outputs[0].text in ("A", "B")
    assert sum(overlapped) > 20  # masks filled with the forward launched and a step in flight
    for llm in engines:
        assert not llm.engine.structured.matchers and not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.num_free_blocks == llm.engine.num_kv_blocks
