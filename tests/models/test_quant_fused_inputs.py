"""W8A8 linears whose input the op before them quantizes (quant/input_quant.py): a tiny Llama
with ``--quantization fp8`` and compressed-tensors int8 / fp8 W8A8 checkpoints (dynamic
per-token and static per-tensor input scales) gives exactly the logits of the unfused path
(each linear quantizing its plain input itself), and its norms and SiLU-and-mul really hand
the linears pre-quantized inputs. On CUDA the fused kernels run; on CPU their torch paths."""

from __future__ import annotations

import pytest
import torch

from lightwell.layers.linear import LinearBase
from lightwell.quant.compressed_tensors import ScaledMethod
from lightwell.quant.fp8 import Fp8W8A8Method
from lightwell.quant.input_quant import QuantizedInput
from tests.models.test_quant_formats import W8A8, build, run_ours

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"cpu": [torch.float32, torch.bfloat16], "cuda": [torch.bfloat16]}[DEVICE]
KEYS = ["online_fp8", "ct_int8_w8a8_dynamic", "ct_int8_w8a8_static_tensor", "ct_fp8_static_tensor"]


def _load(folder: str, quantization: str, dtype: torch.dtype):
    from lightwell.model_files import resolve_model
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model

    files = resolve_model(folder)
    return load_model(files, load_hf_config(files), dtype, DEVICE, quantization=quantization)


def _count_quantized_inputs(model, monkeypatch) -> dict[str, int]:
    """Per linear name (qkv_proj ...), how many of its calls get a ``QuantizedInput`` (from
    now on: ``LinearBase._apply`` observed, then run as it is)."""
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    seen: dict[str, int] = {}
    apply = LinearBase._apply

    def observed(self, x, bias):
        if isinstance(x, QuantizedInput) and id(self) in names:
            seen[names[id(self)]] = seen.get(names[id(self)], 0) + 1
        return apply(self, x, bias)

    monkeypatch.setattr(LinearBase, "_apply", observed)
    return seen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key", KEYS)
def test_fused_input_quantization_gives_the_unfused_logits(tmp_path, monkeypatch, key, dtype):
    quant_config, make, quantization, _, _ = W8A8[key]
    _, folder = build(tmp_path, key, quant_config, make)
    torch.manual_seed(0)
    fused = _load(folder, quantization, dtype)
    seen = _count_quantized_inputs(fused, monkeypatch)
    got_prefill, got_tokens = run_ours(fused, steps=3)
    layers = fused.config.num_hidden_layers
    assert seen == {"qkv_proj": 3 * layers, "gate_up_proj": 3 * layers, "down_proj": 3 * layers}
    # the reference: no linear takes a pre-quantized input, each quantizes its own
    for cls in (Fp8W8A8Method, ScaledMethod):
        monkeypatch.setattr(cls, "input_quant", lambda self, layer: None)
    unfused = _load(folder, quantization, dtype)
    seen = _count_quantized_inputs(unfused, monkeypatch)
    ref_prefill, ref_tokens = run_ours(unfused, steps=3)
    assert seen == {}
    assert got_tokens == ref_tokens
    for got, ref in zip(got_prefill, ref_prefill):
        assert got.dtype == ref.dtype and torch.equal(got, ref), key


def test_micro_batch_forward_hands_the_linears_quantized_inputs(tmp_path, monkeypatch):
    """The dual-stream micro-batch forward (its own norm calls) fuses the same way, and gives
    the plain forward's hidden states."""
    from lightwell.attention.metadata import forward_context
    from lightwell.dual_stream.comm import CommStream
    from lightwell.dual_stream.forward import micro_batch_forward
    from lightwell.dual_stream.split import split_batch
    from tests.models.test_tensor_parallel_comm import micro_batch_steps, plain_and_split

    quant_config, make, _, _, _ = W8A8["ct_int8_w8a8_dynamic"]
    _, folder = build(tmp_path, "micro", quant_config, make)
    plain, split = plain_and_split(folder)
    seen = _count_quantized_inputs(split, monkeypatch)
    for _, ids, pos, meta in micro_batch_steps():
        with torch.no_grad(), forward_context(meta):
            want = plain(ids, pos)  # [T, H]
        with torch.no_grad():
            got = micro_batch_forward(split, split_batch(ids, pos, meta, 2), CommStream(None))
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert set(seen) == {"qkv_proj", "gate_up_proj", "down_proj"}
    assert len(set(seen.values())) == 1


def test_only_rmsnorm_hands_over_quantized_inputs():
    """``pre_norm`` with a quantization: an RMSNorm's output comes quantized (the values of
    quantizing its plain output), a LayerNorm's (Cohere) plain."""
    from lightwell.layers.norm import LayerNorm, RMSNorm, pre_norm
    from lightwell.quant.input_quant import InputQuant, quantize_input

    gen = torch.Generator().manual_seed(5)
    x, res = (torch.randn(3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    quant = InputQuant(torch.float8_e4m3fn)
    rms = RMSNorm(64).to(torch.bfloat16)
    got, new_res = pre_norm(rms, x, res, quant=quant)
    want, want_res = rms(x, res)
    ref = quantize_input(want, quant)
    assert isinstance(got, QuantizedInput) and got.dtype == torch.bfloat16
    assert torch.equal(got.q.view(torch.uint8), ref.q.view(torch.uint8))
    assert torch.equal(got.scale, ref.scale) and torch.equal(new_res, want_res)
    plain, _ = pre_norm(LayerNorm(64), x, res, quant=quant)
    assert isinstance(plain, torch.Tensor)
