"""Structured output without a model: spec validation, the grammar cache and its errors, the
bitmask's unpacking and application (vs xgrammar's own kernel), matchers over a tiny vocab."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightwell.scheduler.output import GrammarBitmask
from lightwell.structured.compiler import GrammarCache, choice_grammar, compiler_reason
from lightwell.types import SamplingParams, StructuredOutputs
from lightwell.worker.structured_output import apply_grammar_mask, grammar_mask, unpack_bitmask

xgr = pytest.importorskip("xgrammar")

VOCAB = ["{", "}", '"', "a", "b", ":", "1", "2", " ", ",", "yes", "no", "</s>"]
EOS = 12


@pytest.fixture(scope="module")
def cache():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=40, stop_token_ids=EOS)
    return GrammarCache(info, capacity=2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
        ({"json": 3}, "JSON schema"),
    ],
)
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)


def test_params_take_a_dict_and_refuse_eos_overrides():
    p = SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"b": {}}}})
    assert p.structured_outputs.kind == "json"
    assert json.loads(p.structured_outputs.json) == {"type": "object", "properties": {"b": {}}}
    assert p.for_child(1).structured_outputs == p.structured_outputs
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})


@pytest.mark.parametrize(
    "spec,reason",
    [
        ({"json": '{"type": "objectx"}'}, 'invalid JSON schema: Unsupported type "objectx"'),
        ({"json": "{not json"}, "invalid JSON schema: Failed to parse JSON"),
        ({"regex": "([a-z"}, "invalid regex: Regex parsing error at position"),
        ({"grammar": "root ::= foo"}, "invalid grammar: EBNF parser error at line 1, column 10"),
    ],
)
def test_compile_errors_say_why_on_one_line(cache, spec, reason):
    with pytest.raises(ValueError) as e:
        cache.get(StructuredOutputs(**spec))
    assert str(e.value).startswith(reason) and "\n" not in str(e.value)
    assert ".cc:" not in str(e.value)


def test_cache_hits_and_lru_eviction(cache):
    before = (cache.stats.compiles, cache.stats.cache_hits)
    a, b, c = (StructuredOutputs(choice=[w]) for w in ("yes", "no", "ab"))
    first = cache.get(a)
    assert cache.get(StructuredOutputs(choice=["yes"])) is first  # equal spec: a hit
    cache.get(b)
    cache.get(c)  # capacity 2: evicts a
    assert len(cache) == 2 and cache.get(c) is not None
    cache.get(a)  # compiled again
    assert cache.stats.compiles - before[0] == 4 and cache.stats.cache_hits - before[1] == 2
    assert cache.stats.compile_seconds > 0


def _allowed(matcher, vocab_size=40) -> set[int]:
    mask = np.empty((1, (vocab_size + 31) // 32), dtype=np.int32)
    matcher.fill_next_token_bitmask(mask, 0)
    return set(np.flatnonzero(unpack_bitmask(torch.from_numpy(mask), vocab_size)[0].numpy()))


def test_matcher_masks_follow_the_choice_grammar(cache):
    matcher = xgr.GrammarMatcher(cache.get(StructuredOutputs(choice=["ab", "a1"])))
    assert _allowed(matcher) == {3}  # "a"
    assert matcher.accept_token(3)
    assert _allowed(matcher) == {4, 6}  # "b" or "1"
    assert matcher.accept_token(6)
    assert _allowed(matcher) == {EOS}  # complete: only the stop token
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a"b', "c\\d", "é"]) == 'root ::= "a\\"b" | "c\\\\d" | "é"'


def test_compiler_reason_strips_the_source_location():
    err = RuntimeError("[15:13:19] /project/cpp/x.cc:94: Regex parsing error\nmore")
    assert compiler_reason(err) == "Regex parsing error"


def test_unpack_and_apply_match_xgrammar():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 70, 5  # 70: the last word is partly used
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    allowed = unpack_bitmask(bits, vocab)  # [3, 70]
    for g in range(3):
        for t in (0, 31, 32, 63, 69):
            assert bool(allowed[g, t]) == bool((int(bits[g, t // 32]) >> (t % 32)) & 1)
    logits = torch.randn(rows, vocab, generator=gen)
    grammar = GrammarBitmask(["r3", "r0", "gone"], np.ascontiguousarray(bits.numpy()))
    mask = grammar_mask(grammar, ["r0", "r1", "r2", "r3", "r4"], torch.device("cpu"))
    assert mask.rows.tolist() == [3, 0]  # "gone" does not sample this step: dropped
    got = apply_grammar_mask(logits.clone(), mask)
    want, full = logits.clone(), torch.full((rows, 3), -1, dtype=torch.int32)  # all allowed
    full[3], full[0] = bits[0], bits[1]
    xgr.apply_token_bitmask_inplace(want, full, indices=[3, 0])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isinf(got[3]).sum() == (~allowed[0]).sum() and torch.equal(got[1], logits[1])


@pytest.mark.parametrize("threads", [1, 2])
def test_manager_fills_the_sampling_rows_of_a_batch_into_one_buffer(cache, threads):
    from types import SimpleNamespace

    from lightwell.scheduler.output import SchedulerOutput
    from lightwell.structured.manager import StructuredOutputManager

    manager = StructuredOutputManager(None, 40, [EOS], fill_threads=threads)
    manager._cache = cache  # the tiny vocab's grammars (no tokenizer here)
    spec = {"structured_outputs": {"choice": ["ab", "a1", "yes"]}}
    for r in ("a", "b", "prefill"):
        manager.add(r, SamplingParams(**spec))
    manager.accept([SimpleNamespace(req_id="b", new_token_ids=[3], finished=False)])
    done = SimpleNamespace(num_computed_tokens=5, num_tokens=5)
    requests = {"a": done, "b": done, "free": done, "prefill": SimpleNamespace(
        num_computed_tokens=2, num_tokens=5)}  # fmt: skip
    sched = SchedulerOutput([], [], {"free": 1, "b": 1, "prefill": 2, "a": 1}, 5)
    grammar = manager.bitmask(sched, requests)
    assert grammar.req_ids == ["b", "a"]  # constrained rows that sample, in batch order
    want = xgr.allocate_token_bitmask(2, 40).numpy()
    for g, r in enumerate(grammar.req_ids):
        manager.matchers[r].fill_next_token_bitmask(want, g)
    assert np.array_equal(grammar.bitmask, want)
    assert _allowed_rows(grammar.bitmask) == [{4, 6}, {3, 10}]  # after "a"; "a" or "yes"
    again = manager.bitmask(SchedulerOutput([], [], {"a": 1}, 1), requests)
    assert np.shares_memory(again.bitmask, grammar.bitmask)  # one buffer across steps


def _allowed_rows(mask) -> list[set]:
    bits = unpack_bitmask(torch.from_numpy(np.ascontiguousarray(mask)), 40)
    return [set(np.flatnonzero(row.numpy())) for row in bits]
