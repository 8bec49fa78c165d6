"""Tensor parallelism on CPU: 2 processes over gloo load sharded weights and must reproduce
HF's logits (vocab-sharded embedding and LM head, column/row-parallel linears with biases,
KV heads split across ranks and replicated when there are fewer KV heads than ranks)."""

from __future__ import annotations

import socket

import torch

from tests.models.tiny import hf_logits, hf_tiny_model, rel_err, save_hf, tiny_config

CONFIGS = {
    # 1 KV head for 2 ranks: replicated; biases everywhere; tied LM head.
    "kv1": dict(
        num_key_value_heads=1, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    # 2 KV heads: one per rank.
    "kv2": dict(num_key_value_heads=2),
}
PROMPTS = [list(range(3, 14)), list(range(40, 46))]
DECODE_STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, size: int, port: int, folders: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from lightwell.distributed.launch import shutdown_distributed
    from lightwell.distributed.parallel_state import init_tp_group
    from tests.models.paged import PagedRunner
    from tests.models.tiny import load_ours

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    init_tp_group(rank, size, dist.group.WORLD)
    results = {}
    for key, folder in folders.items():
        model = load_ours(folder)
        runner = PagedRunner(model, block_size=4, num_blocks=32)
        logits = runner.step([(f"r{i}", p, 0) for i, p in enumerate(PROMPTS)])
        seqs = [list(p) for p in PROMPTS]
        steps = [[lg[-1]] for lg in logits]
        for _ in range(DECODE_STEPS):
            for s, st in zip(seqs, steps):
                s.append(int(st[-1].argmax()))
            batch = [(f"r{i}", [s[-1]], len(s) - 1) for i, s in enumerate(seqs)]
            for st, lg in zip(steps, runner.step(batch)):
                st.append(lg[0])
        qkv = model.model.layers[0].self_attn.qkv_proj
        shards = (qkv.tp_size, qkv.num_kv_heads, qkv.num_kv_head_replicas)
        results[key] = (logits, seqs, [torch.stack(s) for s in steps], shards)
    if rank == 0:
        torch.save(results, out)
    del model, runner, qkv
    shutdown_distributed()


def test_tp2_matches_hf(tmp_path):
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    hf_models, folders = {}, {}
    for key, extra in CONFIGS.items():
        hf_models[key] = hf_tiny_model(tiny_config("base", **extra), seed=11)
        folders[key] = save_hf(hf_models[key], str(tmp_path / key))
    out = str(tmp_path / "results.pt")
    mp.spawn(_run_rank, args=(2, _free_port(), folders, out), nprocs=2, join=True)
    results = torch.load(out)
    for key, hf in hf_models.items():
        prefill, seqs, steps, shards = results[key]
        assert shards == {"kv1": (2, 1, 2), "kv2": (2, 1, 1)}[key]
        for p, lg in zip(PROMPTS, prefill):
            assert rel_err(lg, hf_logits(hf, p)) < 1e-4, key
        for p, s, st in zip(PROMPTS, seqs, steps):
            assert rel_err(st, hf_logits(hf, s)[len(p) - 1 :]) < 1e-4, key
