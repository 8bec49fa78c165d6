"""Tensor parallelism (2 CPU processes over gloo) for the family-specific parallel pieces:
Command-R's parallel block (attention and MLP partial sums, one all-reduce) and its per-head
q/k norms sharded by head (with the single KV head replicated on both ranks, and with 3 KV
groups split 2 / 1), and Qwen2's q/k/v biases with sliding-window layers."""

from __future__ import annotations

import functools

import torch

from tests.models.families import cohere, qwen2
from tests.models.test_tensor_parallel import PROMPTS, _free_port, _run_rank
from tests.models.tiny import hf_logits, rel_err

BUILDS = {
    "cohere_kv1": functools.partial(cohere, num_key_value_heads=1),
    # 3 KV groups on 2 ranks: 2 and 1, the per-head q/k norms sharded the same uneven way
    "cohere_uneven": functools.partial(
        cohere, hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    ),
    "qwen2": qwen2,
}


def test_tp2_cohere_and_qwen2_match_hf(tmp_path):
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    hf_models, folders = {}, {}
    for key, build in BUILDS.items():
        folders[key] = str(tmp_path / key)
        hf_models[key] = build(folders[key], 5)
    out = str(tmp_path / "results.pt")
    mp.spawn(_run_rank, args=(2, _free_port(), folders, out), nprocs=2, join=True)
    results = torch.load(out)
    for key, hf in hf_models.items():
        prefill, seqs, steps, shards = results[key]
        assert (
            shards == {"cohere_kv1": (2, 1, 2), "cohere_uneven": (2, 2, 1), "qwen2": (2, 1, 1)}[key]
        )
        for p, lg in zip(PROMPTS, prefill):
            assert rel_err(lg, hf_logits(hf, p)) < 1e-4, key
        for p, s, st in zip(PROMPTS, seqs, steps):
            assert rel_err(st, hf_logits(hf, s)[len(p) - 1 :]) < 1e-4, key
