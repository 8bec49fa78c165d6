"""A short request arriving during a long prefill gets its first token within a step: running
prefills leave part of the budget (``long_prefill_fraction``) to waiting requests."""

from __future__ import annotations

import pytest

from tests.unit.test_scheduler import make_scheduler, prompt, step


def _first_token_step(make_request, fraction: float) -> tuple[int, int]:
    """(the step at which the short request samples its first token, the long prompt's
    prefill tokens still to do then)."""
    sched = make_scheduler(max_num_batched_tokens=16, num_kv_blocks=80, max_model_len=320,
                           long_prefill_fraction=fraction)  # fmt: skip
    sched.add_request(make_request("long", prompt(1000, 200)))
    step(sched)  # the long prefill is under way
    sched.add_request(make_request("short", prompt(3000, 3)))
    for i in range(1, 30):
        out, res = step(sched)
        if any(r.req_id == "short" for r in res):
            long = sched.get_request("long")
            return i, long.num_prompt_tokens - long.num_computed_tokens
    raise AssertionError("the short request never started")


def test_short_request_interleaves_with_a_long_prefill(make_request) -> None:
    at, left = _first_token_step(make_request, 0.75)
    assert at == 1 and left > 150  # the next step, long before the prefill ends
    at, left = _first_token_step(make_request, 1.0)  # no reserve: head-of-line blocking
    assert at >= 12 and left == 0


def test_reserve_only_while_requests_wait(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_fraction=0.75)
    sched.add_request(make_request("long", prompt(1000, 60)))
    assert step(sched)[0].num_scheduled_tokens == {"long": 16}
    assert step(sched)[0].num_scheduled_tokens == {"long": 16}  # nothing waits: whole budget
    sched.add_request(make_request("short", prompt(3000, 3)))
    assert step(sched)[0].num_scheduled_tokens == {"long": 12, "short": 3}


def test_fraction_validated() -> None:
    from lightwell.config import EngineConfig

    with pytest.raises(ValueError, match="long_prefill_fraction"):
        EngineConfig.from_kwargs(long_prefill_fraction=0.0)


def test_requests_behind_a_new_long_prompt_get_the_reserve(make_request) -> None:
    """A long prompt admitted with others waiting behind it leaves them the reserve at once:
    a short request arriving with it is scheduled in the same step."""
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_fraction=0.75)
    sched.add_request(make_request("long", prompt(1000, 60)))
    sched.add_request(make_request("short", prompt(3000, 3)))
    assert step(sched)[0].num_scheduled_tokens == {"long": 12, "short": 3}
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_fraction=1.0)
    sched.add_request(make_request("long", prompt(1000, 60)))
    sched.add_request(make_request("short", prompt(3000, 3)))
    assert step(sched)[0].num_scheduled_tokens == {"long": 16}
