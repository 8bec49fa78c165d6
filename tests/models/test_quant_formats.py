"""Quantized checkpoints in their published layouts (tests/models/quant_pack.py writes them) vs HF
transformers in fp32 running the dequantized weights: weight-only formats give the same logits
(to fp32 rounding) and the same greedy tokens; W8A8 / FP8 formats match HF with the same
activation quantization emulated on every linear's input (tight), and stay within a stated
bound of the unquantized model."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.models import quant_pack as qp
from tests.models.paged import PagedRunner
from tests.models.tiny import hf_logits, hf_tiny_model, load_ours, rel_err, save_hf

PROMPTS = [list(range(3, 20)), [7, 250, 31, 4, 99]]
FP8 = torch.float8_e4m3fn


def gptq_cfg(bits=4, gs=32, sym=True, act=False, fmt=None):
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": act}
    return cfg if fmt is None else {**cfg, "checkpoint_format": fmt}


def ct_w(bits=4, gs=32, sym=True):
    strategy = "group" if gs > 0 else "channel"
    w = {"num_bits": bits, "type": "int", "strategy": strategy, "symmetric": sym}
    return qp.ct_config("pack-quantized", {**w, "group_size": gs if gs > 0 else None})


INT8_CH = {"num_bits": 8, "type": "int", "strategy": "channel"}
FP8_CH = {"num_bits": 8, "type": "float", "strategy": "channel"}
TOKEN = {"num_bits": 8, "strategy": "token", "dynamic": True}
STATIC = {"num_bits": 8, "strategy": "tensor", "dynamic": False}
WEIGHT_ONLY = {
    "gptq_4b_g32_sym": (gptq_cfg(), qp.gptq_tensors),
    "gptq_4b_g32_asym_actorder": (
        gptq_cfg(sym=False, act=True),
        functools.partial(qp.gptq_tensors, sym=False, act_order=True),
    ),
    "gptq_v2_4b_g32_asym": (
        gptq_cfg(sym=False, fmt="gptq_v2"),
        functools.partial(qp.gptq_tensors, sym=False, v2=True),
    ),
    "gptq_8b_channel_asym": (
        gptq_cfg(bits=8, gs=-1, sym=False),
        functools.partial(qp.gptq_tensors, bits=8, gs=-1, sym=False),
    ),
    "awq_4b_g32": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        qp.awq_tensors,
    ),
    "ct_w4a16_g32": (ct_w(), qp.ct_packed_tensors),
    "ct_w4a16_g32_asym": (ct_w(sym=False), functools.partial(qp.ct_packed_tensors, sym=False)),
    "ct_w8a16_channel": (ct_w(8, -1), functools.partial(qp.ct_packed_tensors, bits=8, gs=-1)),
    "ct_int8_weight_only": (
        qp.ct_config("int-quantized", INT8_CH),
        functools.partial(qp.scaled_tensors, dtype=torch.int8),
    ),
}


def build(tmp_path, key, quant_config, make, seed=3):
    """(HF reference with dequantized weights, folder of the quantized checkpoint)."""
    from transformers import LlamaConfig

    torch.set_num_threads(1)
    hf = hf_tiny_model(LlamaConfig(**qp.QUANT_CONFIG), seed=seed)
    folder = str(tmp_path / key)
    if quant_config is None:
        save_hf(hf, folder)
    else:
        qp.write_quantized(hf, folder, quant_config, make)
    return hf, folder


def run_ours(model, steps: int = 6):
    """Prefill logits of PROMPTS, and greedy continuations (tokens) of ``steps`` tokens."""
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    prefill = runner.step([(f"r{i}", p, 0) for i, p in enumerate(PROMPTS)])
    seqs = [list(p) + [int(lg[-1].argmax())] for p, lg in zip(PROMPTS, prefill)]
    for _ in range(steps - 1):
        batch = [(f"r{i}", [s[-1]], len(s) - 1) for i, s in enumerate(seqs)]
        for s, lg in zip(seqs, runner.step(batch)):
            s.append(int(lg[0].argmax()))
    return prefill, seqs


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int = 6) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    return seq


@pytest.mark.parametrize("key", sorted(WEIGHT_ONLY))
def test_weight_only_formats_match_hf_dequantized(tmp_path, key):
    quant_config, make = WEIGHT_ONLY[key]
    hf, folder = build(tmp_path, key, quant_config, make)
    model = load_ours(folder)
    assert_no_float_weights(model)
    prefill, seqs = run_ours(model)
    for p, lg, s in zip(PROMPTS, prefill, seqs):
        assert rel_err(lg, hf_logits(hf, p)) < 1e-4
        assert s == hf_greedy(hf, p)


def assert_no_float_weights(model) -> None:
    """Quantized linears keep no dequantized copy: float parameters (scales, zeros) are small."""
    for name, module in model.named_modules():
        if hasattr(module, "quant_method") and hasattr(module, "input_size"):
            wide = [p for p in module.parameters() if p.is_floating_point()]
            floats = sum(p.numel() for p in wide if p.element_size() >= 2)  # not fp8
            assert floats * 4 <= module.input_size * module.output_size, name


# ---- W8A8 / FP8: HF with the activation quantization emulated on each decoder linear's input


def fake_int8(x: torch.Tensor, static: float | None) -> torch.Tensor:
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12) if static is None else static
    return torch.round(x / s).clamp(-128, 127) * s


def fake_fp8(x: torch.Tensor, static: float | None, group: int | None = None) -> torch.Tensor:
    if group is not None:  # per token and per group of inputs
        xg = x.unflatten(-1, (-1, group))
        return fake_fp8(xg, None).flatten(-2)
    s = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12) if static is None else static
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def with_input_quant(hf, fake) -> None:
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in qp.LINEARS:
            module.register_forward_pre_hook(lambda _m, args: (fake(args[0]),))


def online(dtype):
    """--quantization int8 / fp8: per-channel weights, as the reference dequantizes them."""
    return lambda w: qp.scaled_tensors(w, dtype)


W8A8 = {  # key: (quant_config or None, make, --quantization, fake input quant, bound vs fp32)
    "ct_int8_w8a8_dynamic": (
        qp.ct_config("int-quantized", INT8_CH, {**TOKEN, "type": "int"}),
        functools.partial(qp.scaled_tensors, dtype=torch.int8),
        "auto",
        functools.partial(fake_int8, static=None),
        0.05,
    ),
    "ct_int8_w8a8_static_tensor": (
        qp.ct_config("int-quantized", {**INT8_CH, "strategy": "tensor"}, {**STATIC, "type": "int"}),
        functools.partial(
            qp.scaled_tensors, dtype=torch.int8, per_channel=False, static_input=0.03
        ),
        "auto",
        functools.partial(fake_int8, static=0.03),
        None,
    ),
    "ct_fp8_dynamic": (
        qp.ct_config("float-quantized", FP8_CH, {**TOKEN, "type": "float"}),
        functools.partial(qp.scaled_tensors, dtype=FP8),
        "auto",
        functools.partial(fake_fp8, static=None),
        0.15,
    ),
    "ct_fp8_static_tensor": (
        qp.ct_config(
            "float-quantized", {**FP8_CH, "strategy": "tensor"}, {**STATIC, "type": "float"}
        ),
        functools.partial(qp.scaled_tensors, dtype=FP8, per_channel=False, static_input=0.01),
        "auto",
        functools.partial(fake_fp8, static=0.01),
        None,
    ),
    "hf_fp8_block16": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
        qp.fp8_block_tensors,
        "auto",
        functools.partial(fake_fp8, static=None, group=16),
        0.15,
    ),
    "online_int8": (None, online(torch.int8), "int8", lambda x: x, 0.05),
    "online_fp8": (None, online(FP8), "fp8", functools.partial(fake_fp8, static=None), 0.15),
}


def load_w8a8(tmp_path, key: str) -> tuple:
    """(HF reference, our model loaded from W8A8[key]'s checkpoint, the unquantized HF model's
    logits of PROMPTS). For online methods the reference then holds the weights as the method
    quantizes them."""
    from lightwell.model_files import resolve_model
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model

    quant_config, make, quantization, _, _ = W8A8[key]
    hf, folder = build(tmp_path, key, quant_config, make)
    fp32 = [hf_logits(hf, p) for p in PROMPTS]
    if quant_config is None:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.rsplit(".", 2)[-2] in qp.LINEARS:
                    p.copy_(make(p.float())[1])
    files = resolve_model(folder)
    model = load_model(
        files, load_hf_config(files), torch.float32, "cpu", quantization=quantization
    )
    return hf, model, fp32


@pytest.mark.parametrize("key", sorted(W8A8))
def test_w8a8_formats_match_emulation_within_bounds(tmp_path, key):
    quant_config, _, _, fake, bound = W8A8[key]
    hf, model, fp32 = load_w8a8(tmp_path, key)
    prefill, _ = run_ours(model, steps=1)
    exact = [hf_logits(hf, p) for p in PROMPTS]  # dequantized weights, fp32 activations
    with_input_quant(hf, fake)
    for p, lg, ex, ref in zip(PROMPTS, prefill, exact, fp32):
        assert rel_err(lg, hf_logits(hf, p)) < 2e-3, key  # same quantization, emulated by HF
        if bound is not None:  # the error the activation (and weight) quantization costs
            base = ref if quant_config is None else ex
            assert rel_err(lg, base) < bound, key


@pytest.mark.parametrize(
    "key",
    [
        "ct_int8_w8a8_dynamic", "ct_int8_w8a8_static_tensor", "ct_fp8_dynamic",
        "ct_fp8_static_tensor", "online_fp8",
    ],
)  # fmt: skip
def test_w8a8_norms_write_the_quantized_input(tmp_path, monkeypatch, key):
    """The device check forced on (on CPU the kernels run in the interpreter): both norms of
    every layer write their output quantized for the qkv and gate/up projections (one
    ``rmsnorm_quant`` launch each), which take it as is: the same greedy tokens and logits as
    the unfused path (each projection's own static scale: the two differ here), and as close
    to HF with the same activation quantization emulated."""
    from lightwell.kernels import rmsnorm as rn
    from lightwell.quant import utils as quant_utils

    fake = W8A8[key][3]
    hf, model, _ = load_w8a8(tmp_path, key)
    static = "static" in key
    if static:  # qkv and gate/up with other scales than the checkpoint's (and each other's)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("qkv_proj.input_scale"):
                    p.mul_(0.5)
                elif name.endswith("gate_up_proj.input_scale"):
                    p.mul_(2.0)
    plain_logits, plain = run_ours(model, steps=3)
    calls = []
    fused = rn.rmsnorm_quant

    def counted(*args, **kwargs):
        calls.append(args[4])
        return fused(*args, **kwargs)

    monkeypatch.setattr(rn, "rmsnorm_quant", counted)
    monkeypatch.setattr(quant_utils, "norm_quant_fusable", lambda x: True)
    prefill, seqs = run_ours(model, steps=3)
    layers = qp.QUANT_CONFIG["num_hidden_layers"]
    want = FP8 if "fp8" in key else torch.int8
    assert len(calls) == 3 * 2 * layers and set(calls) == {want}  # 3 steps, 2 norms a layer
    assert seqs == plain
    for lg, ref in zip(prefill, plain_logits):
        assert rel_err(lg, ref) < 1e-4, key
    if not static:
        with_input_quant(hf, fake)
        for p, lg in zip(PROMPTS, prefill):
            assert rel_err(lg, hf_logits(hf, p)) < 2e-3, key


@pytest.mark.parametrize(
    "quant_config",
    [gptq_cfg(act=True), WEIGHT_ONLY["awq_4b_g32"][0], W8A8["hf_fp8_block16"][0], ct_w()],
    ids=["gptq_actorder", "awq", "hf_fp8_block", "ct_w4a16"],
)
def test_dummy_weights_in_quantized_layouts(quant_config):
    """--load-format dummy with a quantization_config override: random weights of the format's
    shapes (benchmarks of quantized models without a checkpoint) that run to finite logits."""
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model

    overrides = {"preset": "llama-3-8b", **qp.QUANT_CONFIG, "quantization_config": quant_config}
    overrides.pop("architectures")
    hf_config = load_hf_config(None, overrides)
    model = load_model(None, hf_config, torch.float32, "cpu", load_format="dummy")
    assert_no_float_weights(model)
    prefill, _ = run_ours(model, steps=1)
    assert all(torch.isfinite(lg).all() for lg in prefill)


def test_scaled_mm_rowwise_call_matches_fp32():
    """The CUDA path's torch._scaled_mm call (scale shapes and layouts), run by CPU's kernel."""
    from lightwell.quant.fp8 import quantize_fp8, scaled_mm_rowwise

    gen = torch.Generator().manual_seed(0)
    qx, sx = quantize_fp8(torch.randn(5, 64, generator=gen))
    qw, sw = quantize_fp8(torch.randn(48, 64, generator=gen))
    out = scaled_mm_rowwise(qx, qw, sx, sw.reshape(1, -1), torch.float32)
    ref = (qx.float() * sx) @ (qw.float() * sw).t()
    assert rel_err(out, ref) < 1e-5


def test_llm_runs_a_gptq_checkpoint_with_an_int8_kv_cache(tmp_path):
    """The engine options end to end: LLM(quantization=..., kv_cache_dtype=...) on a GPTQ
    folder gives HF's greedy tokens, and an int8 KV cache holds more blocks in the same budget."""
    from lightwell import LLM, SamplingParams

    hf, folder = build(tmp_path, "gptq", *WEIGHT_ONLY["gptq_4b_g32_asym_actorder"])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    blocks = {}
    for kv in ("auto", "int8"):
        llm = LLM(
            model=folder, skip_tokenizer_init=True, quantization="gptq", kv_cache_dtype=kv,
            kv_cache_memory_gb=0.001, block_size=4, num_threads=1,
        )  # fmt: skip
        blocks[kv] = llm.engine.num_kv_blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        if kv == "auto":
            assert [o.outputs[0].token_ids for o in outs] == [
                hf_greedy(hf, p)[len(p) :] for p in PROMPTS
            ]
        del llm
    # fp32 cache: 16 values x 4 bytes per token and head; int8: 16 + 4 bytes
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 64 / 20, rel=0.01)
