"""Scheduler driven by hand-built runner outputs: budgets, chunking, preemption, aborts, stops."""

from __future__ import annotations

import pytest

from lightwell.scheduler.output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from lightwell.scheduler.request import RequestStatus
from lightwell.scheduler.scheduler import Scheduler
from lightwell.types import FinishReason

Script = dict[str, list[list[int]]]


def make_scheduler(**overrides) -> Scheduler:
    kwargs = dict(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_kv_blocks=32,
        block_size=4,
        max_model_len=128,
    )
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def fake_runner(sched: Scheduler, out: SchedulerOutput, script: Script | None) -> ModelRunnerOutput:
    """Sample for every scheduled request whose tokens are all computed after this step.

    The tokens come from ``script[req_id]`` (one list per sampling step) or default to
    ``100 + num_tokens``, a function of the position only, so a recomputed request samples the same.
    """
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        req = sched.get_request(req_id)
        if req is None or req.num_computed_tokens < req.num_tokens:
            continue
        if script and script.get(req_id):
            sampled[req_id] = script[req_id].pop(0)
        else:
            sampled[req_id] = [100 + req.num_tokens]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def step(
    sched: Scheduler, script: Script | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    return out, sched.update(out, fake_runner(sched, out, script))


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_budget_split_with_chunked_prefill(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("A", prompt(1000, 40)))
    sched.add_request(make_request("B", prompt(2000, 10)))

    out, res = step(sched)
    assert out.num_scheduled_tokens == {"A": 16}
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.new_reqs] == [
        ("A", [0, 1, 2, 3], 0)
    ]
    assert res == []

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"A": 16}
    assert out.new_reqs == []
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in out.cached_reqs] == [
        ("A", [4, 5, 6, 7], 16)
    ]

    out, res = step(sched)  # A's last chunk and B's first chunk share the step
    assert out.num_scheduled_tokens == {"A": 8, "B": 8}
    assert out.cached_reqs[0].new_block_ids == [8, 9]
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.new_reqs] == [
        ("B", [10, 11], 0)
    ]
    assert [(r.req_id, r.new_token_ids) for r in res] == [("A", [140])]

    out, res = step(sched)  # A decodes while B finishes its prefill
    assert list(out.num_scheduled_tokens.items()) == [("A", 1), ("B", 2)]
    assert out.total_num_scheduled_tokens == 3
    assert [
        (c.req_id, c.new_token_ids, c.new_block_ids, c.num_computed_tokens) for c in out.cached_reqs
    ] == [("A", [140], [12], 40), ("B", [], [13], 8)]
    assert [(r.req_id, r.new_token_ids) for r in res] == [("A", [141]), ("B", [110])]

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}
    assert [(c.new_token_ids, c.new_block_ids) for c in out.cached_reqs] == [
        ([141], []),
        ([110], []),
    ]
    assert sched.get_request("B").output_token_ids == [110, 111]


def test_schedule_twice_before_update_does_not_repeat_tokens(make_request) -> None:
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10, 5)))
    step(sched)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"A": 1}
    assert sched.schedule().is_empty
    res = sched.update(first, fake_runner(sched, first, None))
    assert res[0].new_token_ids == [106]


def test_max_num_seqs(make_request) -> None:
    sched = make_scheduler(max_num_seqs=2)
    for name in "ABC":
        sched.add_request(make_request(name, prompt(10, 4), max_tokens=2))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["A", "B"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, res = step(sched)
    assert list(out.num_scheduled_tokens) == ["A", "B"]
    assert [r.finish_reason for r in res] == [FinishReason.LENGTH] * 2
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"C": 4}
    assert out.finished_req_ids == {"A", "B"}


def test_prefix_hit_advances_num_computed_tokens(make_request) -> None:
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10, 20), max_tokens=1))
    _, res = step(sched)
    assert res[0].finish_reason == FinishReason.LENGTH and res[0].num_cached_tokens == 0
    assert sched.num_free_blocks == 32
    sched.add_request(make_request("B", prompt(10, 20) + [7, 7, 7]))
    out, res = step(sched)
    assert out.num_scheduled_tokens == {"B": 3}
    (new,) = out.new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([0, 1, 2, 3, 4, 5], 20)
    req = sched.get_request("B")
    assert (req.num_cached_tokens, req.num_computed_tokens) == (20, 23)
    assert res[0].num_cached_tokens == 20
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (20 + 23, 20)


def test_preemption_and_resumption(make_request) -> None:
    sched = make_scheduler(num_kv_blocks=6)
    sched.add_request(make_request("A", prompt(1000, 8), max_tokens=6))
    sched.add_request(make_request("B", prompt(2000, 8), max_tokens=6))
    out, _ = step(sched)
    assert [r.block_ids for r in out.new_reqs] == [[0, 1], [2, 3]]
    out, _ = step(sched)
    assert [c.new_block_ids for c in out.cached_reqs] == [[4], [5]]
    for _ in range(3):
        step(sched)
    assert sched.num_free_blocks == 0

    # A needs a 4th block: B (the last running) is preempted and its blocks go to A, tail first.
    out, res = step(sched)
    assert out.num_scheduled_tokens == {"A": 1}
    assert out.cached_reqs[0].new_block_ids == [5]
    assert out.finished_req_ids == {"B"}
    b = sched.get_request("B")
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert sched.num_preemptions == 1
    assert res[0].finish_reason == FinishReason.LENGTH  # A is done and frees everything

    # B comes back as a new request: prompt + outputs, prompt blocks 2 and 3 hit the cache.
    out, res = step(sched)
    (new,) = out.new_reqs
    assert new.token_ids == prompt(2000, 8) + [108, 109, 110, 111, 112]
    assert (new.block_ids, new.num_computed_tokens) == ([2, 3, 5, 4], 8)
    assert out.num_scheduled_tokens == {"B": 5}
    assert res[0].new_token_ids == [113] and res[0].finish_reason == FinishReason.LENGTH
    assert b.output_token_ids == [108, 109, 110, 111, 112, 113]
    assert sched.num_free_blocks == 6 and not sched.has_unfinished_requests()


def test_request_that_cannot_grow_preempts_itself(make_request) -> None:
    sched = make_scheduler(num_kv_blocks=4)
    sched.add_request(make_request("A", prompt(1000, 6), max_tokens=2))
    sched.add_request(make_request("B", prompt(2000, 8), max_tokens=4))
    step(sched)
    out, res = step(sched)  # B needs a 3rd block; it is the last running, so it steps back
    assert out.num_scheduled_tokens == {"A": 1}
    assert out.finished_req_ids == {"B"}
    assert sched.get_request("B").status == RequestStatus.PREEMPTED
    assert res[0].finish_reason == FinishReason.LENGTH
    out, _ = step(sched)
    assert out.new_reqs[0].req_id == "B" and out.new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"B": 1}


def test_chunked_prefill_off_schedules_whole_prompts(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_request("A", prompt(1000, 10)))
    sched.add_request(make_request("B", prompt(2000, 10)))
    sched.add_request(make_request("C", prompt(3000, 4)))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"A": 10}  # B does not fit whole; C waits behind it
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"A": 1, "B": 10, "C": 4}


def test_abort_returns_every_block(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("run", prompt(10, 6)))
    sched.add_request(make_request("twin", prompt(10, 6)))  # shares run's first block
    step(sched)
    step(sched)
    sched.add_request(make_request("mid", prompt(500, 20)))
    sched.add_request(make_request("wait", prompt(900, 4)))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"run": 1, "twin": 1, "mid": 6}
    assert sched.get_request("mid").num_computed_tokens == 6
    sched.abort_requests(["wait", "mid", "run", "unknown"])
    assert sched.get_request("run") is None
    sched.abort_requests("twin", reason=FinishReason.STOP)
    assert sched.num_free_blocks == sched.num_kv_blocks
    assert sched.kv_cache_usage == 0.0
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"wait", "mid", "run", "twin"}


def test_abort_between_schedule_and_update_is_ignored(make_request) -> None:
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10, 5)))
    out = sched.schedule()
    runner = fake_runner(sched, out, None)
    sched.abort_requests(["A"])
    assert sched.update(out, runner) == []
    assert sched.num_free_blocks == 32


def run_one(make_request, script: list[list[int]], max_model_len: int = 128, **params):
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(make_request("R", [10, 11, 12, 13, 14, 15], **params))
    outputs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        outputs += step(sched, {"R": script})[1]
    assert sched.num_free_blocks == 32
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


@pytest.mark.parametrize(
    ("script", "params", "tokens", "reason", "stop_reason"),
    [
        ([[5], [2]], {}, [5, 2], FinishReason.STOP, None),
        ([[2], [2], [2]], {"min_tokens": 3}, [2, 2, 2], FinishReason.STOP, None),
        (
            [[7], [5], [7]],
            {"stop_token_ids": [7], "min_tokens": 2},
            [7, 5, 7],
            FinishReason.STOP,
            7,
        ),
        ([[5], [6], [8]], {"max_tokens": 3}, [5, 6, 8], FinishReason.LENGTH, None),
        (
            [[2], [2], [2]],
            {"max_tokens": 3, "ignore_eos": True},
            [2, 2, 2],
            FinishReason.LENGTH,
            None,
        ),
        ([[5, 2, 9]], {}, [5, 2], FinishReason.STOP, None),  # tokens after a stop are dropped
    ],
)
def test_stop_conditions(make_request, script, params, tokens, reason, stop_reason) -> None:
    got, last = run_one(make_request, script, **params)
    assert got == tokens
    assert (last.finish_reason, last.stop_reason) == (reason, stop_reason)


def test_stop_at_max_model_len(make_request) -> None:
    got, last = run_one(make_request, [[5], [6], [8]], max_model_len=8)
    assert got == [5, 6]
    assert last.finish_reason == FinishReason.LENGTH


def test_logprobs_are_cut_with_the_tokens(make_request) -> None:
    sched = make_scheduler()
    sched.add_request(make_request("R", [10, 11, 12]))
    out = sched.schedule()
    lps = [TokenLogprobs([t], [-0.5], [1]) for t in (5, 2, 9)]
    runner = ModelRunnerOutput(sampled_token_ids={"R": [5, 2, 9]}, logprobs={"R": lps})
    (res,) = sched.update(out, runner)
    assert res.new_token_ids == [5, 2] and res.new_logprobs == lps[:2]


def test_partial_prefill_chunk_reports_prompt_logprobs(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("A", prompt(10, 6), max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    sched.add_request(make_request("B", prompt(10, 6), prompt_logprobs=1))
    out = sched.schedule()
    assert out.new_reqs[0].num_computed_tokens == 0  # no prefix lookup with prompt logprobs
    lps = [TokenLogprobs([t], [-1.0], [1]) for t in prompt(10, 4)]
    (res,) = sched.update(out, ModelRunnerOutput(prompt_logprobs={"B": lps}))
    assert (res.req_id, res.new_token_ids, res.new_prompt_logprobs) == ("B", [], lps)
    assert res.finish_reason is None


def test_sibling_waits_for_prefill_then_hits_its_blocks(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=12)
    sched.add_request(make_request("s0", prompt(10, 10)))
    sched.add_request(make_request("s1", prompt(10, 10), prefill_after="s0"))
    out, _ = step(sched)  # s0's prompt is done within the step, so s1 may follow at once
    assert out.num_scheduled_tokens == {"s0": 10, "s1": 2}
    assert [(r.block_ids, r.num_computed_tokens) for r in out.new_reqs] == [
        ([0, 1, 2], 0),
        ([0, 1, 3], 8),
    ]
    assert sched.get_request("s1").num_cached_tokens == 8


def test_waiting_sibling_is_skipped_without_blocking_others(make_request) -> None:
    sched = make_scheduler()
    sched.add_request(make_request("s1", prompt(10, 10), prefill_after="s0"))
    sched.add_request(make_request("s0", prompt(10, 10)))
    sched.add_request(make_request("other", prompt(500, 3)))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"s0": 10, "other": 3}
    assert sched.num_waiting == 1
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"s0": 1, "other": 1, "s1": 2}
    assert out.new_reqs[0].num_computed_tokens == 8


def test_add_request_validation(make_request) -> None:
    sched = make_scheduler(num_kv_blocks=4, max_model_len=64)
    sched.add_request(make_request("A", [1, 3], max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("A", [1, 3]))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("B", []))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("C", [1] * 65))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("D", [1] * 10, max_tokens=20))


def test_resumed_request_does_not_repeat_prompt_logprobs(make_request) -> None:
    sched = make_scheduler(num_kv_blocks=4, max_num_batched_tokens=4)
    sched.add_request(make_request("A", prompt(1000, 8), max_tokens=4))
    sched.add_request(make_request("B", prompt(2000, 8), max_tokens=2, prompt_logprobs=0))
    got: list[int] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        runner = fake_runner(sched, out, None)
        starts = {r.req_id: r.num_computed_tokens for r in out.new_reqs + out.cached_reqs}
        if "B" in starts:  # one entry per prompt position computed this step
            end = min(starts["B"] + out.num_scheduled_tokens["B"], 8)
            runner.prompt_logprobs["B"] = [
                TokenLogprobs([p], [-1.0], [1]) for p in range(starts["B"], end)
            ]
        for res in sched.update(out, runner):
            if res.req_id == "B" and res.new_prompt_logprobs:
                got += [lp.token_ids[0] for lp in res.new_prompt_logprobs]
    assert sched.num_preemptions >= 1
    assert got == list(range(8))
