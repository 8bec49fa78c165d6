"""Async scheduling in the scheduler: step N+1 scheduled before step N's update, placeholders
for tokens in flight, the limits they imply, preemption with a token in flight; and the whole
pipelined loop gives the same tokens as the plain loop (with a fake runner whose tokens depend
only on the position)."""

from __future__ import annotations

from collections import deque

from lightwell.scheduler.output import ModelRunnerOutput, SchedulerOutput
from lightwell.scheduler.request import Request
from lightwell.scheduler.scheduler import Scheduler
from lightwell.types import FinishReason, SamplingParams
from tests.unit.test_scheduler import fake_runner, make_scheduler, prompt


def _req(req_id: str, n: int, max_tokens: int, eos: int | None = None, start: int = 1):
    return Request(req_id, prompt(start, n), SamplingParams(max_tokens=max_tokens), eos)


def _schedule(sched: Scheduler) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """A step and what the device will sample for it, decided at launch: each request that got
    a new placeholder samples the token after its last computed one (100 + its position)."""
    before = {r.req_id: r.num_output_placeholders for r in sched.requests.values()}
    out = sched.schedule()
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        req = sched.get_request(req_id)
        if req.num_output_placeholders > before[req_id]:
            sampled[req_id] = [100 + req.num_computed_tokens]
    return out, ModelRunnerOutput(sampled_token_ids=sampled)


def _run_async(sched: Scheduler) -> dict[str, tuple[list[int], FinishReason]]:
    results: dict[str, tuple[list[int], FinishReason]] = {}
    tokens: dict[str, list[int]] = {}
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for _ in range(1000):
        if not (sched.has_unfinished_requests() or in_flight):
            return results
        out, runner_out = _schedule(sched)  # then as OverlapLoop.step does:
        if out.total_num_scheduled_tokens or out.finished_req_ids:
            in_flight.append((out, runner_out))
        if not in_flight or (out.total_num_scheduled_tokens and len(in_flight) < 2):
            continue
        done, runner_out = in_flight.popleft()
        for o in sched.update(done, runner_out):
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                results[o.req_id] = (tokens[o.req_id], o.finish_reason)
    raise AssertionError("the pipelined loop did not finish")


def _run_sync(sched: Scheduler) -> dict[str, tuple[list[int], FinishReason]]:
    results: dict[str, tuple[list[int], FinishReason]] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            return results
        out = sched.schedule()
        for o in sched.update(out, fake_runner(sched, out, None)):
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                results[o.req_id] = (tokens[o.req_id], o.finish_reason)
    raise AssertionError("the plain loop did not finish")


def test_placeholders_let_the_next_step_be_scheduled_before_the_update():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(_req("r", 6, max_tokens=3))
    s1 = sched.schedule()
    r = sched.get_request("r")
    assert s1.num_scheduled_tokens == {"r": 6} and r.num_output_placeholders == 1
    s2 = sched.schedule()  # before update(s1): the token in flight is the next input
    assert s2.num_scheduled_tokens == {"r": 1} and r.num_output_placeholders == 2
    assert s2.cached_reqs[0].new_token_ids == []  # not known yet
    sched.update(s1, ModelRunnerOutput(sampled_token_ids={"r": [50]}))
    assert r.output_token_ids == [50] and r.num_output_placeholders == 1
    s3 = sched.schedule()
    assert s3.num_scheduled_tokens == {"r": 1} and s3.cached_reqs[0].new_token_ids == [50]
    sched.update(s2, ModelRunnerOutput(sampled_token_ids={"r": [51]}))
    # 2 outputs + 1 in flight = max_tokens: nothing more to schedule for r
    assert sched.schedule().num_scheduled_tokens == {}
    outs = sched.update(s3, ModelRunnerOutput(sampled_token_ids={"r": [52]}))
    assert outs[0].new_token_ids == [52] and outs[0].finish_reason == FinishReason.LENGTH
    assert sched.num_free_blocks == sched.num_kv_blocks


def test_a_token_past_eos_is_dropped_and_blocks_come_back():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(_req("r", 5, max_tokens=10, eos=7))
    s1, s2 = sched.schedule(), sched.schedule()
    outs = sched.update(s1, ModelRunnerOutput(sampled_token_ids={"r": [7]}))
    assert outs[0].finish_reason == FinishReason.STOP
    assert sched.update(s2, ModelRunnerOutput(sampled_token_ids={"r": [8]})) == []
    assert not sched.has_unfinished_requests()
    assert sched.num_free_blocks == sched.num_kv_blocks
    assert "r" in sched.schedule().finished_req_ids  # the worker forgets it


def test_a_reused_request_id_does_not_take_the_old_steps_token():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(_req("a", 5, max_tokens=10, eos=7))
    s1, s2 = sched.schedule(), sched.schedule()
    sched.update(s1, ModelRunnerOutput(sampled_token_ids={"a": [7]}))  # EOS: "a" is free again
    sched.add_request(_req("a", 4, max_tokens=10, start=50))
    s3 = sched.schedule()
    # the old request's extra token (step 2) must not land in the new "a"
    assert sched.update(s2, ModelRunnerOutput(sampled_token_ids={"a": [8]})) == []
    new = sched.get_request("a")
    assert new.output_token_ids == [] and new.num_output_placeholders == 1
    outs = sched.update(s3, ModelRunnerOutput(sampled_token_ids={"a": [60]}))
    assert outs[0].new_token_ids == [60] and new.output_token_ids == [60]


def test_steps_dropped_without_update_are_not_kept():
    sched = make_scheduler(async_scheduling=True, max_num_seqs=1)
    sched.add_request(_req("r", 5, max_tokens=100))
    steps = [sched.schedule() for _ in range(3)]  # at most 4 remembered, not all of them
    sched.abort_requests("r")
    for i in range(10):
        sched.add_request(_req(f"x{i}", 3, max_tokens=100))
        steps.append(sched.schedule())
        sched.abort_requests(f"x{i}")
    assert len(sched._step_requests) <= 4
    assert sched.update(steps[-1], ModelRunnerOutput(sampled_token_ids={"x9": [1]})) == []


def test_sync_scheduler_never_leaves_placeholders():
    sched = make_scheduler()
    sched.add_request(_req("r", 6, max_tokens=3))
    sched.schedule()
    assert sched.get_request("r").num_output_placeholders == 0
    assert sched.schedule().num_scheduled_tokens == {}  # plain loop: wait for the update


def _load(sched: Scheduler) -> None:
    for i in range(6):  # prompts 3..13 tokens, outputs up to 4..14 tokens; two stop on EOS
        eos = 100 + 6 + 2 * i if i in (1, 4) else None  # the token sampled at position 6 + 2i
        sched.add_request(_req(f"r{i}", 3 + 2 * i, max_tokens=4 + 2 * i, eos=eos, start=10 * i))


def test_pipelined_loop_gives_the_plain_loops_tokens_under_preemption():
    # 10 blocks of 4 tokens, budget 8: chunked prefills, mixed steps and preemptions
    kwargs = dict(num_kv_blocks=10, max_num_batched_tokens=8, max_model_len=40)
    plain, piped = make_scheduler(**kwargs), make_scheduler(async_scheduling=True, **kwargs)
    _load(plain)
    _load(piped)
    want, got = _run_sync(plain), _run_async(piped)
    assert got == want and len(got) == 6
    assert {r for r, (_, why) in got.items() if why == FinishReason.STOP} == {"r1", "r4"}
    assert piped.num_preemptions > 0
    assert piped.num_free_blocks == piped.num_kv_blocks
