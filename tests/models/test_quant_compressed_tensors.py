"""Checkpoints written by the real tool: compressed-tensors' own ``ModelCompressor`` (the code
llm-compressor calls to save) compresses a tiny random Llama after its scales were computed
with compressed-tensors' ``calculate_qparams`` (round-to-nearest, data-free), and saves it with
the config.json block it writes. (llm-compressor itself pins an older transformers than ours.)
The reference is HF transformers on compressed-tensors' own ``fake_quantize`` of each weight."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.models import quant_pack as qp
from tests.models.test_quant_formats import (
    PROMPTS,
    fake_fp8,
    hf_greedy,
    run_ours,
    with_input_quant,
)
from tests.models.tiny import hf_logits, hf_tiny_model, load_ours, rel_err

pytest.importorskip("compressed_tensors")


def _args(scheme: str):
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    if scheme == "W4A16_ASYM_G32":
        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=32
        )
        return weights, None
    preset = preset_name_to_scheme(scheme, ["Linear"])
    return preset.weights, preset.input_activations


def _observe(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max per output channel, or per group of inputs (what a minmax observer sees)."""
    if args.strategy == "group":
        g = w.unflatten(1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    return w.amin(1, keepdim=True), w.amax(1, keepdim=True)


def write_with_compressed_tensors(folder: str, scheme: str):
    """(reference HF model, quantization format written)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    model = hf_tiny_model(LlamaConfig(**qp.QUANT_CONFIG), seed=5)
    ref = hf_tiny_model(LlamaConfig(**qp.QUANT_CONFIG), seed=5)
    weights, inputs = _args(scheme)
    group = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"])
    )
    ref_modules = dict(ref.named_modules())
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            scale, zero = calculate_qparams(*_observe(w, weights), weights)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero)
            ref_modules[name].weight.data.copy_(fake_quantize(w, scale, zero, weights))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(folder)
    return ref, compressor.quantization_config.format


@pytest.mark.parametrize("scheme", ["W4A16_ASYM_G32", "FP8_DYNAMIC"])
def test_checkpoint_written_by_compressed_tensors(tmp_path, scheme):
    torch.set_num_threads(1)
    ref, fmt = write_with_compressed_tensors(str(tmp_path), scheme)
    model = load_ours(str(tmp_path))
    prefill, seqs = run_ours(model, steps=4)
    tol = 1e-4
    if scheme == "FP8_DYNAMIC":
        assert fmt == "float-quantized"
        with_input_quant(ref, functools.partial(fake_fp8, static=None))
        tol = 2e-3
    else:
        assert fmt == "pack-quantized"
    for p, lg, s in zip(PROMPTS, prefill, seqs):
        assert rel_err(lg, hf_logits(ref, p)) < tol
        if scheme == "W4A16_ASYM_G32":
            assert s == hf_greedy(ref, p, steps=4)
