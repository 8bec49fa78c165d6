"""Layer-level invariants: shard loading per rank, fused checkpoints, norm and RoPE semantics."""

from __future__ import annotations

import pytest
import torch

from lightwell.distributed.parallel_state import init_tp_group, reset_tp_group
from lightwell.layers.embedding import ParallelLMHead
from lightwell.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SplitReplicatedLinear,
)
from lightwell.layers.norm import RMSNorm
from lightwell.layers.rotary import get_rope


@pytest.fixture
def ranks():
    """Build layers as rank r of n (no process group: loading only)."""

    def as_rank(rank: int, size: int, build):
        init_tp_group(rank, size)
        try:
            return build()
        finally:
            reset_tp_group()

    return as_rank


@pytest.mark.parametrize("tp, kv_heads", [(1, 2), (2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_shards_by_head_with_kv_replication(ranks, tp, kv_heads):
    heads, d, hidden = 4, 3, 8
    q = torch.randn(heads * d, hidden)
    k, v = torch.randn(2, kv_heads * d, hidden).unbind(0)
    replicas = max(1, tp // kv_heads)
    for rank in range(tp):
        layer = ranks(rank, tp, lambda: QKVParallelLinear(hidden, d, heads, kv_heads, bias=False))
        for sid, w in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, w, sid)
        n_q, n_kv = heads // tp, max(1, kv_heads // tp)
        kv_rank = rank // replicas
        want = torch.cat(
            [
                q[rank * n_q * d : (rank + 1) * n_q * d],
                k[kv_rank * n_kv * d : (kv_rank + 1) * n_kv * d],
                v[kv_rank * n_kv * d : (kv_rank + 1) * n_kv * d],
            ]
        )
        assert torch.equal(layer.weight, want)
        # A checkpoint that stores the fused tensor loads to the same shard.
        fused = ranks(rank, tp, lambda: QKVParallelLinear(hidden, d, heads, kv_heads))
        fused.weight_loader(fused.weight, torch.cat([q, k, v]))
        assert torch.equal(fused.weight, want)


def test_merged_and_row_shards(ranks):
    gate, up = torch.randn(2, 6, 4).unbind(0)
    down = torch.randn(4, 6)
    for rank in range(2):
        merged = ranks(rank, 2, lambda: MergedColumnParallelLinear(4, [6, 6], bias=True))
        merged.weight_loader(merged.weight, gate, 0)
        merged.weight_loader(merged.weight, up, 1)
        assert torch.equal(merged.weight, torch.cat([gate[rank * 3 :][:3], up[rank * 3 :][:3]]))
        row = ranks(rank, 2, lambda: RowParallelLinear(6, 4, bias=True))
        row.weight_loader(row.weight, down)
        row.weight_loader(row.bias, torch.arange(4.0))
        assert torch.equal(row.weight, down[:, rank * 3 : rank * 3 + 3])
        assert torch.equal(row.bias, torch.arange(4.0))  # replicated
    with pytest.raises(ValueError, match="shape mismatch.*\\(5, 4\\)"):
        merged.weight_loader(merged.weight, torch.zeros(5, 4), 1)


def test_split_replicated_holds_its_query_rows_and_the_whole_latent(ranks):
    """MLA's fused q / kv_a projection: rank r of 2 holds its half of q's rows, then every
    latent row; a checkpoint storing the fused tensor loads the same; the output is both
    projections side by side."""
    q, kv = torch.randn(8, 5), torch.randn(3, 5)
    x = torch.randn(2, 5)
    for rank in range(2):
        layer = ranks(rank, 2, lambda: SplitReplicatedLinear(5, [8, 3], [True, False]))
        layer.weight_loader(layer.weight, q, 0)
        layer.weight_loader(layer.weight, kv, 1)
        assert layer.output_partition_sizes == [4, 3]
        assert torch.equal(layer.weight, torch.cat([q[rank * 4 : rank * 4 + 4], kv]))
        fused = ranks(rank, 2, lambda: SplitReplicatedLinear(5, [8, 3], [True, False]))
        fused.weight_loader(fused.weight, torch.cat([q, kv]))
        assert torch.equal(fused.weight, layer.weight)
        torch.testing.assert_close(layer(x), x @ layer.weight.t())
    whole = ranks(0, 1, lambda: SplitReplicatedLinear(5, [8, 3], [True, False]))
    assert whole.output_partition_sizes == [8, 3]
    with pytest.raises(ValueError, match="output size \\(8\\) is not divisible by 3"):
        ranks(0, 3, lambda: SplitReplicatedLinear(5, [8, 3], [True, False]))


def test_vocab_shards_pad_and_zero(ranks):
    table = torch.randn(100, 8)
    heads = [ranks(r, 2, lambda: ParallelLMHead(100, 8, padding_size=16)) for r in range(2)]
    for h in heads:
        h.weight_loader(h.weight, table)
    assert heads[0].num_embeddings_padded == 128
    assert torch.equal(torch.cat([h.weight for h in heads])[:100], table)
    assert torch.all(heads[1].weight[36:] == 0)


def test_rmsnorm_fused_residual():
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data.normal_()
    x, r = torch.randn(2, 3, 8).unbind(0)
    out, new_residual = norm(x, r)
    assert torch.equal(new_residual, x + r)
    h = x + r
    want = norm.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, want)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("neox", [True, False])
def test_rope_rotates_pairs_and_keeps_the_rest(neox):
    d, rot = 8, 4
    rope = get_rope(d, rot, 64, 10000.0, None, is_neox_style=neox)
    pos = torch.tensor([0, 5, 17])
    q, k = torch.randn(3, 2 * d), torch.randn(3, d)
    q2, k2 = rope(pos, q, k)
    assert torch.equal(q2.view(3, 2, d)[..., rot:], q.view(3, 2, d)[..., rot:])
    assert torch.equal(q2[0], q[0])  # position 0: identity
    # As complex numbers: each pair times exp(i * pos * inv_freq).
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    x = k[:, :rot]
    pairs = torch.stack(x.chunk(2, -1), -1) if neox else x.view(3, rot // 2, 2)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(
        torch.ones(3, rot // 2), pos[:, None].float() * inv
    )
    got = k2[:, :rot]
    got = torch.stack(got.chunk(2, -1), -1) if neox else got.view(3, rot // 2, 2)
    torch.testing.assert_close(got, torch.view_as_real(z))


def test_rope_unknown_type_lists_supported():
    with pytest.raises(ValueError, match="llama3"):
        get_rope(8, 8, 64, 10000.0, {"rope_type": "longrope"})


def test_linear_rope_scaling_stretches_positions():
    plain = get_rope(8, 8, 64, 10000.0, None)
    linear = get_rope(8, 8, 64, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert linear.cos_sin_cache.shape[0] == 256
    torch.testing.assert_close(linear.cos_sin_cache[8], plain.cos_sin_cache[2])


def test_llama_mlp_takes_the_fused_activation_where_the_quant_method_offers_it():
    """A quant method whose ``apply_silu_mul`` answers (the GPU's batch-1 GEMV, W8A8 on the
    GPU) replaces the activation + down projection; one that answers None (everything on CPU)
    leaves both."""
    from types import SimpleNamespace

    from lightwell.models.llama import LlamaMLP

    reset_tp_group()
    cfg = SimpleNamespace(hidden_act="silu", intermediate_size=6, hidden_size=4)
    mlp = LlamaMLP(cfg, None)
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 4)
    gate, up = (x @ mlp.gate_up_proj.weight.t()).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.t()
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)  # CPU: not fused
    assert mlp.down_proj.fused_silu_mul(torch.randn(3, 12), reduce=True) is None
    seen = []

    def fused(layer, gate_up, bias):
        seen.append(gate_up.shape)
        return torch.full((gate_up.shape[0], 4), 7.0)

    mlp.down_proj.quant_method.apply_silu_mul = fused
    assert torch.equal(mlp(x), torch.full((3, 4), 7.0))
    assert torch.equal(mlp.partial(x), torch.full((3, 4), 7.0))
    assert seen == [torch.Size([3, 12])] * 2
