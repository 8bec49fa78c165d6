"""Quantized expert weights in their published layouts (tests/models/quant_pack.py writes them)
vs HF transformers in fp32 running the dequantized weights: DeepSeek-V3 in HF fine-grained FP8
(every linear; the experts weight-only, the dense linears' activations quantized per group as
HF is made to emulate), Mixtral and Qwen-MoE in GPTQ / AWQ 4-bit (weight-only: same logits to
fp32 rounding, same greedy tokens). A config the tensors do not match is refused."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.models import quant_pack as qp
from tests.models.families import deepseek_v3
from tests.models.test_quant_formats import (
    FP8_CH,
    INT8_CH,
    PROMPTS,
    STATIC,
    TOKEN,
    fake_fp8,
    fake_int8,
    hf_greedy,
    run_ours,
    with_input_quant,
)
from tests.models.tiny import hf_logits, load_ours, rel_err

FP8 = torch.float8_e4m3fn
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
# MoE intermediate 48 and dense 96: whole 16-blocks (the expert scales stack per block)
V3_SIZES = dict(moe_intermediate_size=48, intermediate_size=96)


def fake_fp8_groups(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Per token and per ``group`` inputs (the last group partial), as quant/fp8.py does."""
    k = x.shape[-1]
    xg = torch.nn.functional.pad(x, (0, -k % group)).unflatten(-1, (-1, group))
    s = (xg.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return ((xg / s).clamp(-448, 448).to(FP8).float() * s).flatten(-2)[..., :k]


def _is_linear(name: str) -> bool:
    """Every linear of the published checkpoints but the routers (``mlp.gate``, Qwen2-MoE's
    ``shared_expert_gate``): ``*proj``, and Mixtral's experts ``w1`` / ``w2`` / ``w3``."""
    module = name.rsplit(".", 2)[-2]
    return name.endswith(".weight") and ("proj" in module or module in ("w1", "w2", "w3"))


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    torch.set_num_threads(1)
    folder = str(tmp_path_factory.mktemp("v3fp8"))
    hf = deepseek_v3(folder, 0, **V3_SIZES)
    qp.write_quantized_moe(hf, folder, FP8_CONFIG, qp.fp8_block_tensors, _is_linear)
    return hf, folder


def test_deepseek_v3_fp8_experts_match_hf(v3_fp8):
    """Experts stay fp8 with block scales (dequantized per used expert on CPU); logits match
    HF with the dense linears' activation quantization emulated, and greedy tokens agree."""
    hf, folder = v3_fp8
    model = load_ours(folder)
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8
    assert tuple(experts.w13_weight_scale_inv.shape) == (4, 6, 4)  # [E, 2I / 16, H / 16]
    assert tuple(experts.w2_weight_scale_inv.shape) == (4, 4, 3)  # [E, H / 16, I / 16]
    assert model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    for name, module in hf.named_modules():
        dense = isinstance(module, torch.nn.Linear) and _is_linear(f"{name}.weight")
        if dense and not name.endswith("kv_b_proj"):  # ours: kv_b dequantized, weight-only
            module.register_forward_pre_hook(lambda _m, args: (fake_fp8_groups(args[0]),))
    prefill, seqs = run_ours(model, steps=4)
    for p, lg, s in zip(PROMPTS, prefill, seqs):
        assert rel_err(lg, hf_logits(hf, p)) < 2e-3
        assert s == hf_greedy(hf, p, steps=4)


def test_fp8_experts_refuse_a_tp_slice_off_the_blocks(v3_fp8):
    """I = 48 over 2 ranks is 24 a rank: not whole 16-blocks, refused naming fp8."""
    from lightwell.layers.moe import FusedMoE
    from lightwell.quant.fp8 import Fp8BlockMethod

    with pytest.raises(ValueError, match=r"^fp8: the expert intermediate size per rank \(24\)"):
        FusedMoE(4, 64, 24, Fp8BlockMethod(16, 16))


def test_fp8_config_over_bf16_experts_is_refused(tmp_path):
    """quant_method fp8 over a checkpoint whose experts are not fp8: one line naming the
    method and the tensors it reads."""
    torch.set_num_threads(1)
    folder = str(tmp_path)
    hf = deepseek_v3(folder, 0, **V3_SIZES)
    qp.write_quantized_moe(hf, folder, FP8_CONFIG, qp.fp8_block_tensors,
                           lambda n: _is_linear(n) and ".experts." not in n)  # fmt: skip
    with pytest.raises(ValueError, match=r"does not match its quantization config.*Fp8Block"):
        load_ours(folder)


def _ranks_sum(method, tensors, x, weights, ids, expert_parallel: bool) -> torch.Tensor:
    """Each of 2 ranks' FusedMoE built and loaded in this process (rank state set by hand);
    their partial sums added."""
    from lightwell.distributed.parallel_state import (
        init_tp_group,
        reset_tp_group,
        set_expert_parallel,
    )
    from lightwell.layers.moe import FusedMoE

    total = 0
    try:
        for rank in range(2):
            init_tp_group(rank, 2)
            set_expert_parallel(expert_parallel)
            layer = FusedMoE(4, 64, 64, method)
            for (shard, e, kind), t in tensors.items():
                if kind not in layer.quant_method.checkpoint_tensors:
                    continue  # a GPTQ g_idx of contiguous groups
                target = f"{'w2' if shard == 'down' else 'w13'}_{kind}"
                param = getattr(layer, target)
                param.weight_loader(param, t, shard, e)
            layer.quant_method.process_after_loading(layer)
            total = total + layer(x, weights, ids)
    finally:
        reset_tp_group()
    return total


def _expert_checkpoint(make, seed: int = 0, size: int = 64):
    """Per-expert tensors of 4 experts (H = I = ``size``) from ``make`` and the dequantized
    stacked weights ([E, 2I, H], [E, H, I])."""
    gen = torch.Generator().manual_seed(seed)
    tensors, w13, w2 = {}, torch.zeros(4, 2 * size, size), torch.zeros(4, size, size)
    for e in range(4):
        for i, shard in enumerate(("gate", "up", "down")):
            parts, deq = make(torch.randn(size, size, generator=gen) * 0.1)
            tensors.update({(shard, e, k): t for k, t in parts.items()})
            if shard == "down":
                w2[e] = deq
            else:
                w13[e, size * i : size * (i + 1)] = deq
    return tensors, w13, w2


SPLITS = {
    "fp8_block16": ("fp8", qp.fp8_block_tensors),
    "ct_fp8_channel": ("ct_fp8_channel", functools.partial(qp.scaled_tensors, dtype=FP8)),
    "ct_int8_tensor_static": (
        "ct_int8_tensor_static",
        functools.partial(
            qp.scaled_tensors, dtype=torch.int8, per_channel=False, static_input=0.02
        ),
    ),  # fmt: skip
    "gptq_g16_asym": ("gptq", functools.partial(qp.gptq_tensors, gs=16, sym=False)),
    "awq_g16": ("awq", functools.partial(qp.awq_tensors, gs=16)),
    "ct_g16_sym": ("ct", functools.partial(qp.ct_packed_tensors, gs=16)),
}


def method_of(fmt: str):
    """The linear method of a checkpoint in ``fmt`` with 16-blocks / 16-groups."""
    from lightwell.quant import awq, compressed_tensors, fp8, gptq

    ct = compressed_tensors
    return {"fp8": fp8.Fp8BlockMethod(16, 16), "awq": awq.AWQMethod(16),
            "gptq": gptq.GPTQMethod(4, 16, False, False),
            "ct": ct.PackedMethod(4, 16, True, False),
            "ct_fp8_channel": ct.ScaledMethod(FP8, "channel", "dynamic"),
            "ct_int8_tensor_static": ct.ScaledMethod(torch.int8, "tensor", "static"),
            }[fmt]  # fmt: skip


@pytest.mark.parametrize("key", sorted(SPLITS))
def test_quantized_experts_split_over_ranks(key):
    """Tensor parallel (I / 2 = 32: whole blocks, words and groups a rank) and expert parallel
    (2 whole experts a rank): the ranks' partial sums add up to the whole layer on the
    dequantized weights."""
    from lightwell.layers.moe import moe_loop

    fmt, make = SPLITS[key]
    method = method_of(fmt)
    tensors, w13, w2 = _expert_checkpoint(make)
    gen = torch.Generator().manual_seed(1)
    x, weights = torch.randn(7, 64, generator=gen), torch.rand(7, 2, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(7)])
    want = moe_loop(x, w13, w2, weights, ids)
    for ep in (False, True):
        got = _ranks_sum(method, tensors, x, weights, ids, ep)
        assert rel_err(got, want) < 1e-5


GPTQ_G16 = {"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": True, "desc_act": False}
AWQ_G16 = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True,
           "version": "gemm"}  # fmt: skip
W4 = {  # family, sizes in whole groups of 16, config, packer
    "mixtral_gptq_g16": ("mixtral", {}, GPTQ_G16, functools.partial(qp.gptq_tensors, gs=16)),
    # MLA's kv_b_proj too: loaded as published, dequantized after loading
    "deepseek_v2_gptq_g16": (
        "deepseek_v2",
        V3_SIZES,
        GPTQ_G16,
        functools.partial(qp.gptq_tensors, gs=16),
    ),
    "deepseek_v2_awq_g16": (
        "deepseek_v2",
        V3_SIZES,
        AWQ_G16,
        functools.partial(qp.awq_tensors, gs=16),
    ),
    "qwen2_moe_awq_g16": (
        "qwen2_moe",
        dict(moe_intermediate_size=48, shared_expert_intermediate_size=64, intermediate_size=96),
        AWQ_G16,
        functools.partial(qp.awq_tensors, gs=16),
    ),
    "qwen3_moe_gptq_channel_asym": (
        "qwen3_moe",
        dict(moe_intermediate_size=48, intermediate_size=96),
        {**GPTQ_G16, "group_size": -1, "sym": False},
        functools.partial(qp.gptq_tensors, gs=-1, sym=False),
    ),
    "qwen3_moe_ct_w4a16_g16_asym": (
        "qwen3_moe",
        dict(moe_intermediate_size=48, intermediate_size=96),
        qp.ct_config(
            "pack-quantized",
            {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 16,
                "symmetric": False,
            },
        ),
        functools.partial(qp.ct_packed_tensors, gs=16, sym=False),
    ),
}


@pytest.mark.parametrize("key", sorted(W4))
def test_w4a16_experts_match_hf_dequantized(tmp_path, key):
    """Experts (and every other linear) in 4 bits; the logits match HF's on the dequantized
    weights to fp32 rounding and the greedy tokens agree."""
    from tests.models import families

    torch.set_num_threads(1)
    family, sizes, config, make = W4[key]
    hf = getattr(families, family)(str(tmp_path), 0, **sizes)
    qp.write_quantized_moe(hf, str(tmp_path), config, make, _is_linear)
    model = load_ours(str(tmp_path))
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    assert experts.w13_qweight.dtype == torch.int32 and not hasattr(experts, "w13_weight")
    prefill, seqs = run_ours(model, steps=4)
    for p, lg, s in zip(PROMPTS, prefill, seqs):
        assert rel_err(lg, hf_logits(hf, p)) < 1e-4
        assert s == hf_greedy(hf, p, steps=4)


def test_awq_config_over_gptq_experts_is_refused(tmp_path):
    from tests.models.families import mixtral

    torch.set_num_threads(1)
    hf = mixtral(str(tmp_path), 0)
    make = functools.partial(qp.gptq_tensors, gs=16)
    qp.write_quantized_moe(hf, str(tmp_path), AWQ_G16, make, _is_linear)
    with pytest.raises(ValueError, match=r"does not match its quantization config.*AWQMethod"):
        load_ours(str(tmp_path))


def test_act_order_experts_are_refused():
    from lightwell.layers.moe import FusedMoE
    from lightwell.quant.gptq import GPTQMethod

    with pytest.raises(ValueError, match=r"^gptq: act-order expert weights are not supported"):
        FusedMoE(4, 64, 64, GPTQMethod(4, 16, True, False))


# compressed-tensors 8-bit experts (channel or tensor scales): weight-only in ours; the dense
# linears W8A8, which HF emulates on their inputs
# the routers' ignore entries of llm-compressor's MoE examples
MIXTRAL_IGNORE = ("lm_head", "re:.*block_sparse_moe.gate")
QWEN_IGNORE = ("lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$")
W8 = {  # family, sizes, config, packer, input fake-quantization of the dense linears
    "mixtral_ct_fp8_channel_dynamic": (
        "mixtral", {},
        qp.ct_config("float-quantized", FP8_CH, {**TOKEN, "type": "float"}, MIXTRAL_IGNORE),
        functools.partial(qp.scaled_tensors, dtype=FP8),
        functools.partial(fake_fp8, static=None),
    ),
    "qwen3_moe_ct_fp8_tensor_static": (
        "qwen3_moe", dict(moe_intermediate_size=48, intermediate_size=96),
        qp.ct_config("float-quantized", {**FP8_CH, "strategy": "tensor"},
                     {**STATIC, "type": "float"}, QWEN_IGNORE),
        functools.partial(qp.scaled_tensors, dtype=FP8, per_channel=False, static_input=0.01),
        functools.partial(fake_fp8, static=0.01),
    ),
    # MLA's kv_b_proj dequantized at load (the attention absorbs it); DeepSeek's fp8 inputs
    # flip fp8 roundings after the attention at these sizes: weight-only int8, or a static
    # per-tensor scheme (the same arithmetic as HF's emulation)
    "deepseek_v2_ct_int8_channel_weight_only": (
        "deepseek_v2", dict(moe_intermediate_size=48, intermediate_size=96),
        qp.ct_config("int-quantized", INT8_CH, None, ("lm_head", "re:.*mlp.gate$")),
        functools.partial(qp.scaled_tensors, dtype=torch.int8),
        lambda x: x,
    ),
    "deepseek_v3_ct_fp8_tensor_static": (
        "deepseek_v3", V3_SIZES,
        qp.ct_config("float-quantized", {**FP8_CH, "strategy": "tensor"},
                     {**STATIC, "type": "float"}, ("lm_head", "re:.*mlp.gate$")),
        functools.partial(qp.scaled_tensors, dtype=FP8, per_channel=False, static_input=0.01),
        functools.partial(fake_fp8, static=0.01),
    ),
    "qwen2_moe_ct_int8_channel_dynamic": (
        "qwen2_moe", dict(moe_intermediate_size=48, shared_expert_intermediate_size=64,
                          intermediate_size=96),
        qp.ct_config("int-quantized", INT8_CH, {**TOKEN, "type": "int"}, QWEN_IGNORE),
        functools.partial(qp.scaled_tensors, dtype=torch.int8),
        functools.partial(fake_int8, static=None),
    ),
}  # fmt: skip


@pytest.mark.parametrize("key", sorted(W8))
def test_8bit_experts_match_hf_dequantized(tmp_path, key):
    """compressed-tensors int8 / fp8 experts with channel or tensor scales (a static input
    scale read and dropped; the routers named in ``ignore``, as llm-compressor's MoE recipes
    write) stay 8-bit, one scale a row after loading, and run weight-only; the dense linears
    keep their W8A8 scheme; DeepSeek's kv_b_proj loads dequantized. Logits match HF on the
    dequantized weights with the dense linears' input quantization emulated; greedy tokens
    agree."""
    from tests.models import families

    torch.set_num_threads(1)
    family, sizes, config, make, fake = W8[key]
    hf = getattr(families, family)(str(tmp_path), 0, **sizes)
    qp.write_quantized_moe(hf, str(tmp_path), config, make, _is_linear)
    model = load_ours(str(tmp_path))
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    want = torch.int8 if "int8" in key else FP8
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == want
    num, two_inter, hidden = experts.w13_weight.shape
    assert tuple(experts.w13_row_scale.shape) == (num, two_inter)
    assert tuple(experts.w2_row_scale.shape) == (num, hidden)
    assert not hasattr(experts, "w13_input_scale") and not hasattr(experts, "w13_weight_scale")
    for name, module in hf.named_modules():  # (kv_b_proj runs unquantized in ours)
        if isinstance(module, torch.nn.Linear) and _is_linear(f"{name}.weight"):
            if not name.endswith("kv_b_proj"):
                module.register_forward_pre_hook(lambda _m, args: (fake(args[0]),))
    prefill, seqs = run_ours(model, steps=4)
    for p, lg, s in zip(PROMPTS, prefill, seqs):
        assert rel_err(lg, hf_logits(hf, p)) < 2e-3, key
        assert s == hf_greedy(hf, p, steps=4), key


def test_quantized_routers_load_dequantized(tmp_path):
    """A compressed-tensors checkpoint whose routers are quantized too (no router ``ignore``
    entry: Qwen2-MoE's ``mlp.gate`` and ``shared_expert_gate`` in fp8 with row scales): the
    routers load dequantized and run unquantized; logits match HF on the dequantized weights
    (the dense linears' fp8 inputs emulated, not the routers'), greedy tokens agree."""
    from tests.models import families

    torch.set_num_threads(1)
    sizes = dict(moe_intermediate_size=48, shared_expert_intermediate_size=64,
                 intermediate_size=96)  # fmt: skip
    hf = families.qwen2_moe(str(tmp_path), 0, **sizes)
    config = qp.ct_config("float-quantized", FP8_CH, {**TOKEN, "type": "float"}, ("lm_head",))
    routers = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")
    qp.write_quantized_moe(hf, str(tmp_path), config,
                           functools.partial(qp.scaled_tensors, dtype=FP8),
                           lambda name: _is_linear(name) or name.endswith(routers))  # fmt: skip
    model = load_ours(str(tmp_path))
    gate = next(m for n, m in model.named_modules() if n.endswith("mlp.gate"))
    assert gate.weight.dtype != FP8 and not hasattr(gate, "weight_scale")
    with_input_quant(hf, functools.partial(fake_fp8, static=None))
    prefill, seqs = run_ours(model, steps=4)
    for p, lg, s in zip(PROMPTS, prefill, seqs):
        assert rel_err(lg, hf_logits(hf, p)) < 2e-3
        assert s == hf_greedy(hf, p, steps=4)


def _round_rows(hf, dtype) -> None:
    """HF's linears and stacked experts (not the routers, not MLA's kv_b_proj) quantized per
    output row as ``--quantization`` does, then dequantized in place."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if not (stacked or _is_linear(name)) or "kv_b_proj" in name:
                continue  # (MLA's kv_b_proj stays in the model dtype: absorbed by attention)
            rows = param.data.reshape(-1, param.shape[-1])
            rows.copy_(qp.scaled_tensors(rows.float(), dtype)[1])


ONLINE = {  # family, sizes, --quantization, dense linears' input fake-quantization
    "mixtral_fp8": ("mixtral", {}, "fp8", functools.partial(fake_fp8, static=None)),
    "mixtral_int8": ("mixtral", {}, "int8", lambda x: x),
    "deepseek_v2_int8": ("deepseek_v2", {}, "int8", lambda x: x),
    "qwen2_moe_fp8": ("qwen2_moe", {}, "fp8", functools.partial(fake_fp8, static=None)),
}


@pytest.mark.parametrize("key", sorted(ONLINE))
def test_online_quantization_quantizes_the_experts(tmp_path, key):
    """``--quantization fp8 / int8`` of a float checkpoint quantizes the experts per output row
    too (on the CPU both stay 8-bit, with one scale a row; DeepSeek's shared experts stay a
    separate quantized MLP); logits match HF holding the same rounded weights, the dense
    linears' fp8 input quantization emulated; greedy tokens agree."""
    from tests.models import families

    torch.set_num_threads(1)
    family, sizes, quantization, fake = ONLINE[key]
    hf = getattr(families, family)(str(tmp_path), 0, **sizes)
    model = load_ours(str(tmp_path), quantization=quantization)
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    want = torch.int8 if quantization == "int8" else FP8
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == want
    assert tuple(experts.w13_row_scale.shape) == tuple(experts.w13_weight.shape[:2])
    _round_rows(hf, want)
    with_input_quant(hf, fake)
    prefill, seqs = run_ours(model, steps=4)
    for p, lg, s in zip(PROMPTS, prefill, seqs):
        assert rel_err(lg, hf_logits(hf, p)) < 2e-3, key
        assert s == hf_greedy(hf, p, steps=4), key


def test_router_ignore_entries_load_and_other_ignores_are_refused():
    """llm-compressor's MoE recipes ignore the routers (Mixtral's ``block_sparse_moe.gate``,
    Qwen's ``mlp.gate`` and ``shared_expert_gate``): accepted, since routers load unquantized;
    an entry naming another linear (``gate_proj``) is still refused."""
    from lightwell.quant import compressed_tensors as ct

    fp8 = qp.ct_config("float-quantized", FP8_CH, {**TOKEN, "type": "float"})
    for ignore in (MIXTRAL_IGNORE, QWEN_IGNORE, ("lm_head", "model.layers.3.mlp.gate")):
        assert type(ct.from_config({**fp8, "ignore": list(ignore)})).__name__ == "ScaledMethod"
    for entry in ("re:.*mlp.gate_proj", "model.layers.0.mlp.gate_up_proj", "re:.*self_attn.*"):
        with pytest.raises(ValueError, match="ignore names layers other than lm_head and MoE"):
            ct.from_config({**fp8, "ignore": ["lm_head", entry]})


def test_a_per_tensor_scale_saved_as_a_scalar_loads_as_one_of_shape_1():
    """A per-tensor ``weight_scale`` saved 0-dimensional goes where a [1] one does."""
    from lightwell.layers.moe import FusedMoE
    from lightwell.quant.compressed_tensors import ScaledMethod

    layers = [FusedMoE(2, 16, 16, ScaledMethod(FP8, "tensor", "dynamic")) for _ in range(2)]
    for layer, shape in zip(layers, ((), (1,))):
        for shard, value in (("gate", 0.5), ("up", 0.25), ("down", 2.0)):
            name = "w2_weight_scale" if shard == "down" else "w13_weight_scale"
            param = getattr(layer, name)
            param.weight_loader(param, torch.full(shape, value), shard, 1)
    assert torch.equal(layers[0].w13_weight_scale[1], torch.tensor([0.5, 0.25]))
    assert torch.equal(layers[0].w13_weight_scale[1], layers[1].w13_weight_scale[1])
    assert torch.equal(layers[0].w2_weight_scale[1], layers[1].w2_weight_scale[1])
    assert torch.equal(layers[0].w2_weight_scale[1], torch.tensor([2.0]))


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act_order"])
def test_kv_b_dense_after_loading_is_the_dequantized_weight(act_order):
    """``DenseAfterLoading`` (MLA's kv_b_proj in a packed format): GPTQ tensors loaded as
    published, then one plain weight equal to the format's dequantization, act-order rows put
    back in their inputs' order; the layer is then a plain matmul."""
    from lightwell.layers.linear import ColumnParallelLinear
    from lightwell.quant.gptq import GPTQMethod
    from lightwell.quant.wna16 import DenseAfterLoading

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    tensors, deq = qp.gptq_tensors(w, gs=16, act_order=act_order)
    layer = ColumnParallelLinear(64, 48, False, quant_method=DenseAfterLoading(
        GPTQMethod(4, 16, act_order, False)))  # fmt: skip
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, t)
    layer.quant_method.process_after_loading(layer)
    assert set(dict(layer.named_parameters())) == {"weight"}
    torch.testing.assert_close(layer.weight.float(), deq, rtol=0, atol=1e-6)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=1e-5, atol=1e-5)
