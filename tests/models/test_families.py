"""Mistral, Qwen2, Qwen3, MiniCPM and Command-R vs HF transformers on tiny random checkpoints
(fp32, CPU): logits through the paged cache (prefill, 20 decode steps, chunked prefill mixed
with decodes), and greedy generation through ``LLM`` (chunked prefill, prefix caching).

The families and what each variant turns on are in ``tests/models/families.py`` (MiniCPM is
checked against HF Llama with its scalings folded into the weights: see there).
"""

from __future__ import annotations

import json

import pytest
import torch

from lightwell.models.registry import supported_architectures
from tests.models.families import FAMILIES, WINDOW, hf_decode_logits, hf_generate
from tests.models.paged import PagedRunner
from tests.models.tiny import hf_logits, load_ours, rel_err, save_hf

TOL = 1e-4
VOCAB = 300


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, Family, HF reference model, folder, our model loaded from the folder)."""
    torch.set_num_threads(1)
    fam = FAMILIES[request.param]
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = fam.build(folder, len(request.param))
    return request.param, fam, hf, folder, load_ours(folder)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in lengths]


def test_builds_the_family(family):
    name, fam, _, _, ours = family
    assert type(ours).__name__ == fam.cls_name
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
    expected = {
        "mistral_window": [WINDOW] * 2,
        "mixtral_window": [WINDOW] * 2,
        "qwen2_yarn_window": [None, WINDOW, WINDOW],
    }
    assert windows == expected.get(name, [None] * len(windows))


def test_prefill_batch_matches_hf(family):
    _, fam, hf, _, ours = family
    prompts = _prompts(fam.prefill_lens)
    out = PagedRunner(ours, block_size=4, num_blocks=48).step(
        [(f"r{i}", p, 0) for i, p in enumerate(prompts)]
    )
    for p, logits in zip(prompts, out):
        assert logits.shape == (len(p), VOCAB)
        assert rel_err(logits, hf_logits(hf, p)) < TOL


def test_20_decode_steps_match_hf(family):
    """Contexts reach 50 tokens: past the window (8) and past yarn's original length and the
    dynamic-NTK max position (32)."""
    _, _, hf, _, ours = family
    prompts = _prompts([9, 30], seed=1)
    runner = PagedRunner(ours, block_size=4, num_blocks=48, seed=1)
    seqs = [list(p) for p in prompts]
    got = [[o[-1]] for o in runner.step([(f"r{i}", p, 0) for i, p in enumerate(prompts)])]
    for _ in range(20):
        for s, g in zip(seqs, got):
            s.append(int(g[-1].argmax()))
        batch = [(f"r{i}", [s[-1]], len(s) - 1) for i, s in enumerate(seqs)]
        for g, o in zip(got, runner.step(batch)):
            g.append(o[0])
    for p, s, g in zip(prompts, seqs, got):
        ref = hf_decode_logits(hf, p, s[len(p) :])  # [21, V]
        assert rel_err(torch.stack(g), ref) < TOL


def test_chunked_prefill_mixed_with_decode(family):
    """A 23-token prompt in chunks of 5 (each chunk over a cached prefix longer than the
    window) while another request decodes in the same batches."""
    _, _, hf, _, ours = family
    long, short = _prompts([23, 6], seed=2)
    runner = PagedRunner(ours, block_size=4, num_blocks=48, seed=2)
    short_seq = list(short)
    last = runner.step([("s", short, 0)])[0][-1]
    decode_logits = []
    for start in range(0, len(long), 5):
        short_seq.append(int(last.argmax()))
        batch = [("s", [short_seq[-1]], len(short_seq) - 1), ("l", long[start : start + 5], start)]
        dec, chunk = runner.step(batch)
        last = dec[0]
        decode_logits.append(last)
    assert rel_err(chunk, hf_logits(hf, long)[20:]) < TOL
    ref_short = hf_decode_logits(hf, short, short_seq[len(short) :])
    assert rel_err(torch.stack(decode_logits), ref_short[1:]) < TOL


def test_llm_greedy_matches_hf_generate(family):
    """Mixed-length prompts (two share a 16-token prefix) through the engine with a 16-token
    budget (chunked prefill) and prefix caching; run twice, the second from the prefix cache."""
    from lightwell import LLM, SamplingParams

    _, fam, hf, folder, _ = family
    prompts = _prompts([5, 13, 30, 22], seed=3)
    prompts[3][:16] = prompts[2][:16]
    want = [hf_generate(hf, p, 20) for p in prompts]
    llm = LLM(
        model=folder,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
        block_size=4,
        num_kv_blocks=96,
        **fam.llm_options,
    )
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= 4 for o in outs)  # run 2 reused full prefix blocks


def test_unknown_architecture_lists_the_supported(tmp_path):
    from lightwell import LLM
    from tests.models.families import save_tokenizer
    from tests.models.tiny import hf_tiny_model, tiny_config

    torch.set_num_threads(1)
    folder = save_hf(hf_tiny_model(tiny_config(num_hidden_layers=1)), str(tmp_path))
    save_tokenizer(folder)
    path = tmp_path / "config.json"
    supported = ", ".join(supported_architectures())
    assert all(f.cls_name in supported for f in FAMILIES.values())
    config = json.loads(path.read_text())
    for arch, model_type in (("FooForCausalLM", "llama"), ("BarForCausalLM", "bar")):
        # a known config class with an unknown architecture; a config transformers can't read
        path.write_text(json.dumps({**config, "architectures": [arch], "model_type": model_type}))
        with pytest.raises(ValueError, match=f"(?s){arch}.*{supported}"):
            LLM(model=folder)


def test_preemption_mid_request_matches_hf(family):
    """16 blocks of 4 tokens for four requests of up to 50 tokens: requests are preempted
    mid-decode, recomputed later, and still give HF's tokens."""
    from lightwell import LLM, SamplingParams

    _, fam, hf, folder, _ = family
    prompts = _prompts([5, 13, 30, 22], seed=4)
    want = [hf_generate(hf, p, 20) for p in prompts]
    llm = LLM(model=folder, max_num_batched_tokens=16, block_size=4, num_kv_blocks=16,
              **fam.llm_options)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.stats().num_preemptions > 0
