"""Our Llama vs HF transformers on tiny random checkpoints (fp32, CPU), through the paged cache."""

from __future__ import annotations

import pytest
import torch

from tests.models.paged import PagedRunner
from tests.models.tiny import (
    VARIANTS,
    has_files,
    hf_logits,
    hf_tiny_model,
    load_ours,
    rel_err,
    save_hf,
    tiny_config,
)

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(variant, HF model, our model loaded from its save_pretrained folder)."""
    torch.set_num_threads(1)
    hf = hf_tiny_model(tiny_config(request.param), seed=len(request.param))
    folder = save_hf(hf, str(tmp_path_factory.mktemp(request.param)))
    return request.param, hf, load_ours(folder)


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n, (k,), generator=gen).tolist() for k in lengths]


def test_prefill_batch_matches_hf(pair):
    _, hf, ours = pair
    prompts = _prompts(300, [7, 13, 4])
    runner = PagedRunner(ours, block_size=4, num_blocks=32)
    out = runner.step([(f"r{i}", p, 0) for i, p in enumerate(prompts)])
    for p, logits in zip(prompts, out):
        assert logits.shape == (len(p), 300)
        assert rel_err(logits, hf_logits(hf, p)) < TOL


def test_greedy_decode_matches_hf(pair):
    _, hf, ours = pair
    prompts = _prompts(300, [5, 9], seed=1)
    runner = PagedRunner(ours, block_size=4, num_blocks=32, seed=1)
    seqs = [list(p) for p in prompts]
    out = runner.step([(f"r{i}", p, 0) for i, p in enumerate(prompts)])
    got = [[o[-1]] for o in out]
    for _ in range(20):
        for s, g in zip(seqs, got):
            s.append(int(g[-1].argmax()))
        batch = [(f"r{i}", [s[-1]], len(s) - 1) for i, s in enumerate(seqs)]
        for g, o in zip(got, runner.step(batch)):
            g.append(o[0])
    for p, s, g in zip(prompts, seqs, got):
        ref = hf_logits(hf, s)  # [len(p) + 20, V]
        assert rel_err(torch.stack(g), ref[len(p) - 1 :]) < TOL


def test_chunked_prefill_mixed_with_decode(pair):
    """A 23-token prompt in chunks of 5 while another request decodes in the same batches."""
    _, hf, ours = pair
    long, short = _prompts(300, [23, 6], seed=2)
    runner = PagedRunner(ours, block_size=4, num_blocks=32, seed=2)
    short_seq = list(short)
    last = runner.step([("s", short, 0)])[0][-1]
    decode_logits = []
    for start in range(0, len(long), 5):
        short_seq.append(int(last.argmax()))
        batch = [("s", [short_seq[-1]], len(short_seq) - 1), ("l", long[start : start + 5], start)]
        dec, chunk = runner.step(batch)
        last = dec[0]
        decode_logits.append(last)
    ref_long = hf_logits(hf, long)
    assert rel_err(chunk[-1], ref_long[-1]) < TOL
    ref_short = hf_logits(hf, short_seq)
    assert rel_err(torch.stack(decode_logits), ref_short[len(short) :]) < TOL


def test_sharded_checkpoint(tmp_path):
    torch.set_num_threads(1)
    hf = hf_tiny_model(tiny_config("base"), seed=7)
    folder = save_hf(hf, str(tmp_path), max_shard_size="40KB")
    assert has_files(folder, ".safetensors") > 1
    assert has_files(folder, ".index.json") == 1
    ours = load_ours(folder)
    (prompt,) = _prompts(300, [11], seed=3)
    (logits,) = PagedRunner(ours).step([("a", prompt, 0)])
    assert rel_err(logits, hf_logits(hf, prompt)) < TOL


def test_without_kv_cache_matches_hf(pair):
    """The profiling path: kv_cache None, plain causal attention per request."""
    from lightwell.attention.metadata import forward_context
    from tests.models.paged import build_metadata

    _, hf, ours = pair
    prompts = _prompts(300, [6, 3], seed=4)
    meta, positions = build_metadata([6, 3], [6, 3], [[0, 1], [2]], 4, torch.device("cpu"))
    attn = [m for m in ours.modules() if hasattr(m, "kv_cache")]
    saved = [m.kv_cache for m in attn]
    for m in attn:
        m.kv_cache = None
    try:
        with forward_context(meta), torch.no_grad():
            hidden = ours(torch.tensor(prompts[0] + prompts[1]), positions)
    finally:
        for m, c in zip(attn, saved):
            m.kv_cache = c
    logits = ours.compute_logits(hidden)
    assert rel_err(logits[:6], hf_logits(hf, prompts[0])) < TOL
    assert rel_err(logits[6:], hf_logits(hf, prompts[1])) < TOL
