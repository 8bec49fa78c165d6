"""MoE and MLA pieces on their own: the routing rules against HF's routers, the expert loop
split over ranks, the latent KV cache's size in the engine, and DeepSeek-V3's
multi-token-prediction layer skipped at load."""

from __future__ import annotations

import logging

import pytest
import torch

from lightwell.layers.moe import moe_loop, select_experts


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("kind", ["v2_greedy", "v2_group_limited", "v3_noaux_tc"])
def test_routing_matches_hf_routers(kind):
    """HF's DeepSeek routers against ``select_experts`` with the rule the model derives from
    the same config (``deepseek_v2.router_of``): V2's plain greedy top-k (V2-Lite's method) and
    group-limited greedy over softmax scores, V3's sigmoid ``noaux_tc`` with the correction
    bias; the routed scaling on the weights."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from lightwell.models.deepseek_v2 import router_of

    torch.manual_seed(0)
    common = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                  topk_group=2, routed_scaling_factor=1.7)  # fmt: skip
    bias = None
    if kind.startswith("v2"):
        method = "greedy" if kind == "v2_greedy" else "group_limited_greedy"
        cfg = DeepseekV2Config(**common, topk_method=method)
        hf = DeepseekV2TopkRouter(cfg)
    else:
        cfg = DeepseekV3Config(**common, norm_topk_prob=True)
        hf = DeepseekV3TopkRouter(cfg)
        hf.e_score_correction_bias.copy_(0.5 * torch.randn(16))
        bias = hf.e_score_correction_bias
    router = router_of(cfg)
    assert router.num_groups == (1 if kind == "v2_greedy" else 4)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(50, 32)
    _, want_w, want_ids = hf(x)
    got_w, got_ids = select_experts(x @ hf.weight.t(), router, bias)
    want_w, want_ids = _sorted(want_w, want_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    groups = got_ids // 4  # experts of at most topk_groups groups per token, when limited
    most = max(len(set(g.tolist())) for g in groups)
    assert most > 2 if kind == "v2_greedy" else most <= 2


def test_expert_loop_split_over_ranks_sums_to_the_whole():
    """Each rank shifts the ids by its first expert and skips the others' (expert parallel):
    the partial sums add up to the single-rank result, itself a per-token dense reference."""
    torch.manual_seed(1)
    x, w13, w2 = torch.randn(9, 16), torch.randn(4, 2 * 8, 16), torch.randn(4, 16, 8)
    weights, ids = torch.rand(9, 2), torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    whole = moe_loop(x, w13, w2, weights, ids)
    halves = sum(moe_loop(x, w13[s : s + 2], w2[s : s + 2], weights, ids - s) for s in (0, 2))
    torch.testing.assert_close(halves, whole)
    ref = torch.zeros_like(x)
    for t in range(9):
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(whole, ref)


def test_shared_experts_stacked_after_the_routed_equal_the_shared_mlp():
    """DeepSeek's shared MLP of 2 x 8 features as 2 stacked experts of 8 (its checkpoint
    tensors split by ``shared_as_experts``): a one-token step runs them as weight-1 choices
    (``folds_shared``), a larger one as a dense MLP; both equal the routed experts plus the
    shared MLP computed whole. Quantized linears or expert parallelism keep the shared MLP."""
    from lightwell.distributed.parallel_state import (
        init_tp_group,
        reset_tp_group,
        set_expert_parallel,
    )
    from lightwell.layers.moe import FusedMoE, folds_shared_experts
    from lightwell.models.deepseek_v2 import shared_as_experts
    from lightwell.quant.int8 import Int8WeightOnlyMethod

    torch.manual_seed(2)
    hidden, inter, experts, shared = 16, 8, 4, 2
    model, moe = torch.nn.Module(), torch.nn.Module()
    model.mlp, moe.experts = moe, FusedMoE(experts, hidden, inter, num_shared=shared)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    gate, up = torch.randn(2, shared * inter, hidden).unbind(0)  # the shared MLP's tensors
    down = torch.randn(hidden, shared * inter)
    for e in range(experts):
        for shard, w in (("gate", w13[e, :inter]), ("up", w13[e, inter:]), ("down", w2[e])):
            moe.experts.weight_loader(moe.experts.w13_weight if shard != "down"
                                      else moe.experts.w2_weight, w, shard, e)  # fmt: skip
    names = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    split = list(
        shared_as_experts(model, [(f"mlp.shared_experts.{n}.weight", t) for n, t in names.items()])
    )
    assert [n for n, _ in split][:2] == [
        "mlp.experts.4.gate_proj.weight",
        "mlp.experts.5.gate_proj.weight",
    ]
    for name, tensor in split:
        _, _, e, proj, _ = name.split(".")
        param = moe.experts.w2_weight if proj == "down_proj" else moe.experts.w13_weight
        moe.experts.weight_loader(param, tensor, proj.split("_")[0], int(e))
    for tokens in (1, 5):
        x, weights = torch.randn(tokens, hidden), torch.rand(tokens, 2)
        ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)])
        want = moe_loop(x, w13, w2, weights, ids)
        want += (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
        assert moe.experts.folds_shared(tokens, 2) == (tokens == 1)
        torch.testing.assert_close(moe.experts(x, weights, ids), want)
    assert folds_shared_experts(None) and not folds_shared_experts(Int8WeightOnlyMethod())
    init_tp_group(0, 2)
    set_expert_parallel(True)
    try:
        assert not folds_shared_experts(None)
        with pytest.raises(ValueError, match="shared experts stack with unquantized"):
            FusedMoE(experts, hidden, inter, num_shared=shared)
    finally:
        set_expert_parallel(False)
        reset_tp_group()


def test_latent_cache_sizes_the_kv_blocks(tmp_path):
    """A DeepSeek layer caches kv_lora_rank + rope dims (32 + 8) a token: the block count for a
    memory budget follows from that, not from the expanded heads (4 x (24 + 20) x 2)."""
    from lightwell import LLM
    from tests.models.families import deepseek_v3

    torch.set_num_threads(1)
    deepseek_v3(str(tmp_path), 0)
    llm = LLM(model=str(tmp_path), block_size=4, kv_cache_memory_gb=0.001)
    runner = llm.engine.executor.worker.runner
    assert [tuple(c.shape[2:]) for c in runner.kv_caches] == [(4, 1, 40)] * 3
    per_block = 3 * 4 * 40 * 4  # layers x block x entry x fp32
    assert runner.kv_bytes_per_block() == per_block
    assert llm.engine.scheduler.num_free_blocks == int(0.001 * 2**30) // per_block
    from lightwell.cli import _banner  # the start-up line counts the latent tokens

    blocks = llm.engine.num_kv_blocks
    assert blocks >= int(0.001 * 2**30) // per_block
    assert f"KV cache {blocks * 4} tokens" in _banner(llm.engine, 0.0)
    # the engine knows a MoE model (its GPU default of requests a step): the CPU one here
    assert llm.engine.model_info.routed_experts == 4  # deepseek_v3: 4 routed, 1 shared
    assert llm.engine.config.scheduler.max_num_seqs == 64


def test_mtp_layer_skipped_at_load(tmp_path, caplog):
    from safetensors.torch import load_file

    from tests.models.families import deepseek_v3
    from tests.models.tiny import load_ours

    torch.set_num_threads(1)
    deepseek_v3(str(tmp_path), 0)
    model = load_ours(str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(40, 64)}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lightwell.models.deepseek_v2"):
        loaded = model.load_weights({**weights, **mtp}.items())
    assert loaded == set(dict(model.named_parameters()))
    assert "skipped 2 tensors of the multi-token-prediction layer" in caplog.text


@pytest.mark.parametrize(
    ("preset", "billions", "entry"),
    [("mixtral-8x7b", 46.70, (2, 1, 1, 8, 128)), ("deepseek-v2-lite", 15.71, (1, 1, 1, 1, 576)),
     ("deepseek-v3", 671.03, (1, 1, 1, 1, 576))],
)  # fmt: skip
def test_presets_have_the_published_sizes(preset, billions, entry):
    """Dummy-weight presets (built on the meta device): parameter counts of the published
    models, and a latent cache entry of 576 values (against 2 x 8 x 128 for Mixtral's GQA)."""
    from lightwell.layers.attention import Attention
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model

    model = load_model(None, load_hf_config(None, preset), torch.bfloat16, "meta", "dummy")
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    assert attn.kv_cache_shape(1, 1) == entry


def test_latent_attention_in_query_chunks_equals_whole(monkeypatch):
    """Long prefills attend a chunk of queries at a time (bounded score memory): 4 queries a
    chunk over 13 cached + 37 new entries give the one-chunk result."""
    import lightwell.attention.mla_torch as mla

    gen = torch.Generator().manual_seed(2)
    q, keys = torch.randn(37, 3, 40, generator=gen), torch.randn(50, 40, generator=gen)
    whole = mla.latent_sdpa(q, keys, 13, 0.2, 32)
    monkeypatch.setattr(mla, "SCORES_PER_CHUNK", 3 * 50 * 4)
    torch.testing.assert_close(mla.latent_sdpa(q, keys, 13, 0.2, 32), whole)
    causal = mla.latent_sdpa(q[:1], keys[:14], 13, 0.2, 32)  # the first query sees 14 entries
    torch.testing.assert_close(whole[:1], causal)


def test_deepseek_routes_in_fp32_in_a_bf16_model(tmp_path):
    """HF computes DeepSeek's router logits in fp32; so do we, whatever the model dtype."""
    from tests.models.families import deepseek_v3
    from tests.models.tiny import load_ours

    torch.set_num_threads(1)
    deepseek_v3(str(tmp_path), 0)
    model = load_ours(str(tmp_path), dtype=torch.bfloat16)
    block = model.model.layers[1].mlp
    assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
    assert block.experts.w13_weight.dtype == torch.bfloat16
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert block.gate(x).dtype == torch.float32 and block(x).dtype == torch.bfloat16
