"""Quantized expert weights in their published layouts (tests/models/quant_pack.py writes them)
vs HF transformers in fp32 running the dequantized weights: DeepSeek-V3 in HF fine-grained FP8
(every linear; the experts weight-only, the dense linears' activations quantized per group as
HF is made to emulate), Mixtral and Qwen-MoE in GPTQ / AWQ 4-bit (weight-only: same logits to
fp32 rounding, same greedy tokens). A config the tensors do not match is refused."""

from __future__ import annotations

import pytest
import torch

from tests.models import quant_pack as qp
from tests.models.families import deepseek_v3
from tests.models.test_quant_formats import PROMPTS, hf_greedy, run_ours
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
    """Every linear of the published FP8 checkpoints but the router (``mlp.gate``)."""
    return name.endswith(".weight") and "proj" in name.rsplit(".", 2)[-2]


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
