"""Streamed outputs: each RequestOutput is a snapshot of the request so far, made without
copying what was generated before (ListPrefix views), and finished outputs hold lists."""

from __future__ import annotations

import time

import pytest

from lightwell.engine.output_processor import OutputProcessor
from lightwell.scheduler.output import EngineCoreOutput, TokenLogprobs
from lightwell.types import FinishReason, ListPrefix, SamplingParams


def test_list_prefix_is_a_read_only_sequence_of_the_first_items():
    items = [10, 11, 12, 13]
    view = ListPrefix(items, 3)
    items.append(14)  # the list grows: the view does not
    assert len(view) == 3 and list(view) == [10, 11, 12]
    assert view[0] == 10 and view[-1] == 12 and view[-3] == 10
    for bad in (3, -4):
        with pytest.raises(IndexError):
            view[bad]
    assert view[1:] == [11, 12] and view[:10] == [10, 11, 12] and view[::-1] == [12, 11, 10]
    assert view[2:0:-1] == [12, 11] and view[5:] == [] and view[-2:] == [11, 12]
    assert view[::2] == [10, 12] and view[2:1] == [] and isinstance(view[1:], list)
    assert view == [10, 11, 12] and view == (10, 11, 12) and view != [10, 11, 12, 13]
    assert view == ListPrefix([10, 11, 12, 99], 3) and [10, 11, 12] == view
    assert 12 in view and 13 not in view and view.index(11) == 1
    assert repr(view) == "[10, 11, 12]" and bool(ListPrefix(items, 0)) is False
    with pytest.raises(TypeError):
        hash(view)
    with pytest.raises(ValueError):
        ListPrefix(items, 6)


def _step(op: OutputProcessor, token: int, finish: FinishReason | None = None):
    lps = [TokenLogprobs([token], [-0.5], [1])]
    outs, _ = op.process([EngineCoreOutput("r0c", [token], lps, finish_reason=finish)])
    return outs[0].outputs[0]


def test_streamed_snapshots_keep_their_length_and_finished_ones_are_lists():
    op = OutputProcessor(None)
    params = SamplingParams(max_tokens=3, logprobs=0)
    op.add_request("r0", ["r0c"], None, [1, 2], params, time.time())
    first = _step(op, 7)
    second = _step(op, 8)
    assert isinstance(first.token_ids, ListPrefix) and isinstance(first.logprobs, ListPrefix)
    assert first.token_ids == [7] and len(first.logprobs) == 1  # unchanged by the next step
    assert second.token_ids == [7, 8] and second.token_ids[1:] == [8]
    assert [next(iter(p)) for p in second.logprobs] == [7, 8]
    last = _step(op, 9, FinishReason.LENGTH)
    assert type(last.token_ids) is list and type(last.logprobs) is list
    assert last.token_ids == [7, 8, 9] and last.finished
    assert last.cumulative_logprob == pytest.approx(-1.5)
