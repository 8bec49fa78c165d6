"""Shared fixtures for the scheduler and KV-cache unit tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lightwell.scheduler.request import Request
from lightwell.types import SamplingParams


@pytest.fixture
def make_request() -> Callable[..., Request]:
    """``make_request(req_id, prompt_token_ids, **sampling_params)``; eos_token_id defaults to 2."""

    def make(
        req_id: str,
        prompt_token_ids: list[int],
        *,
        eos_token_id: int | None = 2,
        prefill_after: str | None = None,
        **params: object,
    ) -> Request:
        return Request(
            req_id,
            prompt_token_ids,
            SamplingParams(**params),
            eos_token_id=eos_token_id,
            arrival_time=0.0,
            prefill_after=prefill_after,
        )

    return make
