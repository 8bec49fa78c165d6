from __future__ import annotations

import pytest
import torch

from lightwell.types import SamplingParams
from lightwell.worker import logits_processors as lp
from lightwell.worker.sampler import Sampler, compute_prompt_logprobs
from lightwell.worker.sampling_metadata import (
    build_sampling_metadata,
    derive_seed,
    plain_greedy,
)

NEG_INF = float("-inf")
# Probabilities with clear gaps, so no filter boundary sits on a rounding edge.
PROBS = [0.0625, 0.5, 0.125, 0.0625, 0.25]  # token 1 > 4 > 2 > 0 = 3


def make_meta(params, outputs=None, prompts=None, eos=None, vocab=5, gen=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return build_sampling_metadata(params, prompts, outputs, eos, vocab, "cpu", gen)


def prob_logits(rows: int = 1) -> torch.Tensor:
    return torch.tensor(PROBS).log().repeat(rows, 1)


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def sample(logits, params, outputs=None, gen=None):
    meta = make_meta(params, outputs, vocab=logits.shape[1], gen=gen)
    return Sampler()(logits.clone(), meta)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, params, gen=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (4,)
    assert out.token_ids[[0, 2, 3]].tolist() == expected[[0, 2, 3]].tolist()
    meta = make_meta([SamplingParams(temperature=0.0)] * 4, vocab=50)
    assert meta.all_greedy and meta.temperature is None and not meta.any_top_k
    assert Sampler()(logits.clone(), meta).token_ids.tolist() == expected.tolist()


PLAIN_GREEDY_CASES = [  # (params, output tokens so far, plain greedy?)
    (SamplingParams(temperature=0.0), 0, True),
    (SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=7), 0, True),  # no effect
    (SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]), 2, True),  # reached
    (SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]), 1, False),
    (SamplingParams(temperature=0.7), 0, False),
    (SamplingParams(temperature=0.0, logprobs=0), 0, False),
    (SamplingParams(temperature=0.0, logit_bias={2: 5.0}), 0, False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), 0, False),
    (SamplingParams(temperature=0.0, frequency_penalty=0.5), 0, False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), 0, False),
]


@pytest.mark.parametrize("params, done, plain", PLAIN_GREEDY_CASES)
def test_plain_greedy_is_exactly_the_rows_the_sampler_leaves_alone(params, done, plain):
    """plain_greedy (the tensor-parallel argmax without the sampler) accepts a row exactly when
    the sampler would take the argmax of its raw logits and return nothing else."""
    assert plain_greedy(params, done) == plain
    meta = make_meta([params], outputs=[[0] * done], eos=4)
    untouched = meta.all_greedy and meta.max_num_logprobs is None
    untouched = untouched and not (meta.any_min_tokens or meta.any_logit_bias)
    assert (untouched and not meta.any_penalties) == plain
    if plain:  # and the sampler then gives the argmax
        logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(done))
        meta = make_meta([params] * 3, outputs=[[0] * done] * 3, eos=4)
        assert torch.equal(Sampler()(logits.clone(), meta).token_ids, logits.argmax(-1))


def _generate(seed_row_logits, others, position, steps, seed=1234):
    """Tokens of a seeded request placed at ``position`` among ``others`` for ``steps`` steps."""
    target = SamplingParams(seed=seed, top_k=50, top_p=0.95)
    params = others[:position] + [target] + others[position:]
    outputs = [[] for _ in params]
    gen = torch.Generator().manual_seed(99)
    for _ in range(steps):
        noise = torch.randn(len(params), seed_row_logits.shape[0], generator=gen)
        logits = noise.clone()
        logits[position] = seed_row_logits
        tokens = sample(logits, params, outputs, gen=gen).token_ids.tolist()
        for row, token in enumerate(tokens):
            outputs[row].append(token)
    return outputs[position]


def test_seeded_request_is_independent_of_the_batch():
    row = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 0.5
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=7, top_k=5),
        SamplingParams(min_p=0.1, repetition_penalty=1.3, logprobs=2),
    ]
    alone = _generate(row, [], 0, steps=10)
    assert _generate(row, others, 0, steps=10) == alone
    assert _generate(row, others, 2, steps=10) == alone
    assert _generate(row, others[:1], 1, steps=10) == alone
    assert _generate(row, others, 4, steps=10, seed=1235) != alone
    assert len(set(alone)) > 3  # the seed changes with every step: not one repeated draw


def test_derived_seeds_depend_on_seed_and_step():
    seeds = {derive_seed(s, k) for s in range(50) for k in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(-1, 3) == derive_seed(-1, 3)


def test_unseeded_rows_follow_the_default_generator():
    logits = torch.zeros(8, 100)
    params = [SamplingParams()] * 8
    a = sample(logits, params, gen=torch.Generator().manual_seed(3)).token_ids
    b = sample(logits, params, gen=torch.Generator().manual_seed(3)).token_ids
    c = sample(logits, params, gen=torch.Generator().manual_seed(4)).token_ids
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([[0.1, 3.0, -2.0, 1.5, 0.7, 2.2]]).repeat(3, 1)
    top_k = torch.tensor([2, 0, 4])
    expected = [{1, 5}, set(range(6)), {1, 5, 3, 4}]
    assert kept(lp.apply_top_k(logits.clone(), top_k, max_top_k=4)) == expected
    no_top_p = torch.ones(3)
    assert kept(lp.apply_top_k_top_p(logits.clone(), top_k, no_top_p)) == expected


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.4, {1}), (0.7, {1, 4}), (0.8, {1, 4, 2}), (0.99, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    logits = prob_logits()
    assert kept(lp.apply_top_k_top_p(logits, None, torch.tensor([top_p]))) == [expected]


def test_top_p_applies_after_top_k_renormalises():
    # top-3 probs renormalised: 0.571, 0.286, 0.143; top_p 0.8 then keeps 2 (3 without top_k).
    logits = prob_logits(2)
    out = lp.apply_top_k_top_p(logits, torch.tensor([3, 0]), torch.tensor([0.8, 0.8]))
    assert kept(out) == [{1, 4}, {1, 4, 2}]


@pytest.mark.parametrize("min_p, expected", [(0.3, {1, 4}), (0.2, {1, 4, 2}), (0.0, set(range(5)))])
def test_min_p_keeps_tokens_above_the_scaled_max(min_p, expected):
    assert kept(lp.apply_min_p(prob_logits(), torch.tensor([min_p]))) == [expected]


@pytest.mark.parametrize(
    "params, support",
    [
        (SamplingParams(top_k=2), {1, 4}),
        (SamplingParams(top_p=0.7), {1, 4}),
        (SamplingParams(min_p=0.2), {1, 4, 2}),
        (SamplingParams(top_k=3, top_p=0.8), {1, 4}),
        (SamplingParams(min_p=0.2, top_p=0.8), {1, 4}),  # renormalised after min_p
        (SamplingParams(), {0, 1, 2, 3, 4}),
    ],
)
def test_sampled_support_is_exactly_the_kept_set(params, support):
    out = sample(prob_logits(3000), [params] * 3000, gen=torch.Generator().manual_seed(0))
    assert set(out.token_ids.tolist()) == support


def test_seeded_samples_stay_in_the_kept_set():
    params = [SamplingParams(seed=s, top_k=3, top_p=0.8) for s in range(200)]
    assert set(sample(prob_logits(200), params).token_ids.tolist()) == {1, 4}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_match_the_softmax(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    n = 20000
    params = [SamplingParams(temperature=temperature)] * n
    out = sample(logits.repeat(n, 1), params, gen=torch.Generator().manual_seed(42))
    observed = torch.bincount(out.token_ids, minlength=6).double()
    expected = (logits / temperature).softmax(dim=-1).double() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def test_penalties_change_logits_exactly():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
    ]
    meta = make_meta(params, outputs=[[1, 1, 2], [1]], prompts=[[0], [3]], vocab=4)
    assert meta.any_penalties
    out = lp.apply_penalties(logits.clone(), meta)
    # token 0: prompt only -> 2 / 2; token 1: -1 * 2 - 0.5 - 2 * 0.25; token 2: 0.5 / 2 - 0.75
    assert out[0].tolist() == pytest.approx([1.0, -3.0, -0.5, 3.0])
    assert out[1].tolist() == logits[1].tolist()


def test_frequency_penalty_alone_scales_with_counts():
    params = [SamplingParams(frequency_penalty=-1.0)]
    meta = make_meta(params, outputs=[[2, 2, 2, 0]], prompts=[[1]], vocab=3)
    assert meta.prompt_output_mask is None  # no repetition penalty: no prompt mask built
    out = lp.apply_penalties(torch.zeros(1, 3), meta)
    assert out[0].tolist() == [1.0, 0.0, 3.0]


def test_logit_bias_adds_to_the_tokens():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(logit_bias={2: 1.5, 5: -100.0}), SamplingParams()]
    out = lp.apply_logit_bias(logits.clone(), make_meta(params, vocab=6))
    assert out[0].tolist() == [0.0, 0.0, 1.5, 0.0, 0.0, -100.0]
    assert out[1].tolist() == [0.0] * 6
    greedy = [SamplingParams(temperature=0.0, logit_bias={4: 100.0})]
    assert sample(torch.randn(1, 6), greedy).token_ids.tolist() == [4]


def test_logit_bias_outside_the_vocab_is_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_meta([SamplingParams(logit_bias={9: 1.0})], vocab=6)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 8.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    for outputs, masking in [([], True), ([7], True), ([7, 7], False)]:
        meta = make_meta([params], outputs=[outputs], eos=3, vocab=6)
        masked = lp.apply_min_tokens(logits.clone(), meta)
        assert kept(masked) == [{0, 1, 2, 4} if masking else set(range(6))]
        assert Sampler()(logits.clone(), meta).token_ids.tolist() == [0 if masking else 3]
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    meta = make_meta([ignore], outputs=[[]], eos=3, vocab=6)
    assert kept(lp.apply_min_tokens(logits.clone(), meta)) == [{0, 1, 2, 3, 4}]


def test_min_tokens_masks_each_rows_own_eos():
    """Rows stop on different EOS ids (e.g. Llama 3's <|eot_id|> vs <|end_of_text|>)."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 8.0]] * 2)
    params = [SamplingParams(temperature=0.0, min_tokens=1)] * 2
    meta = make_meta(params, outputs=[[], []], eos=[3, 5], vocab=6)
    assert kept(lp.apply_min_tokens(logits.clone(), meta)) == [{0, 1, 2, 4, 5}, {0, 1, 2, 3, 4}]


def test_logprobs_are_of_the_raw_logits_with_ranks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g)
    params = [
        SamplingParams(temperature=0.5, top_k=5, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(repetition_penalty=1.5),
    ]
    out = sample(logits, params, gen=g)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.logprobs[2] is None
    for row, k in [(0, 3), (1, 0)]:
        entry = out.logprobs[row]
        token = int(out.token_ids[row])
        top = raw[row].topk(k).indices.tolist()
        assert entry.token_ids == [token] + top
        expected = [float(raw[row, t]) for t in entry.token_ids]
        assert entry.logprobs == pytest.approx(expected, abs=1e-6)
        assert entry.ranks == [int((raw[row] > raw[row, t]).sum()) + 1 for t in entry.token_ids]
    assert out.logprobs[1].ranks == [1]  # greedy picks rank 1
    assert sample(logits, [SamplingParams()] * 3, gen=g).logprobs is None


def test_tied_logprobs_share_a_rank():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=3)])
    assert out.logprobs[0].token_ids == [1, 1, 2, 0]
    assert out.logprobs[0].ranks == [1, 1, 1, 3]


def test_prompt_logprobs():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([3, 0, 29, 7, 7])
    rows = compute_prompt_logprobs(logits, targets, num_top=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(rows) == 5
    for i, row in enumerate(rows):
        t = int(targets[i])
        assert row.token_ids == [t] + raw[i].topk(2).indices.tolist()
        assert row.logprobs[0] == pytest.approx(float(raw[i, t]), abs=1e-6)
        assert row.ranks[0] == int((raw[i] > raw[i, t]).sum()) + 1
        assert row.ranks[1:] == [1, 2]
    assert [r.token_ids for r in Sampler().compute_prompt_logprobs(logits, targets, 0)] == [
        [t] for t in targets.tolist()
    ]


def test_unused_features_are_not_built():
    meta = make_meta([SamplingParams(), SamplingParams(temperature=0.8)], vocab=10)
    assert meta.all_random and meta.greedy_mask is None
    assert not (meta.any_top_k or meta.any_top_p or meta.any_min_p or meta.any_penalties)
    assert meta.top_k is None and meta.output_token_counts is None and meta.max_num_logprobs is None
    assert not meta.any_logit_bias and not meta.any_min_tokens and meta.seeded_rows == []


def test_mismatched_logits_are_rejected():
    meta = make_meta([SamplingParams()], vocab=10)
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(1, 12), meta)


def test_top_k_at_least_the_vocab_is_off():
    meta = make_meta([SamplingParams(top_k=10)], vocab=10)
    assert not meta.any_top_k and meta.top_k is None
