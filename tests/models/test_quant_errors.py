"""Quantization configs that cannot load are refused with an error naming the method and what is
supported: unknown methods, options a format does not support, a config that does not match the
checkpoint's tensors (either way), and --quantization values that contradict the checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightwell.config import EngineConfig
from tests.models import quant_pack as qp
from tests.models.test_quant_formats import build
from tests.models.tiny import load_ours


def _set_quant_config(folder: str, quant_config: dict | None) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    with open(path, "w") as f:
        json.dump(cfg, f)


def _load(folder: str, quantization: str = "auto"):
    from lightwell.model_files import resolve_model
    from lightwell.models.hf_config import load_hf_config
    from lightwell.models.loader import load_model

    files = resolve_model(folder)
    return load_model(files, load_hf_config(files), torch.float32, "cpu", quantization=quantization)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return build(tmp_path_factory.mktemp("q"), "plain", None, None)[1]


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    return build(tmp_path_factory.mktemp("q"), "gptq", cfg, qp.gptq_tensors)[1]


def test_awq_config_over_plain_tensors_is_refused(plain):
    _set_quant_config(plain, {"quant_method": "awq", "bits": 4, "group_size": 32})
    try:
        with pytest.raises(
            ValueError, match=r"does not match its quantization config.*AWQ.*qweight"
        ):
            load_ours(plain)
    finally:
        _set_quant_config(plain, None)


def test_quantized_tensors_without_config_are_refused(gptq):
    with open(os.path.join(gptq, "config.json")) as f:
        saved = json.load(f)["quantization_config"]
    _set_quant_config(gptq, None)
    try:
        with pytest.raises(ValueError, match="quantized tensor, but config.json has no quant"):
            load_ours(gptq)
    finally:
        _set_quant_config(gptq, saved)


@pytest.mark.parametrize(
    "quant_config, message",
    [
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported; supported: gptq, awq"),
        (
            {"quant_method": "gptq", "bits": 3},
            r"gptq: 3-bit weights are not supported \(supported: 2, 4, 8",
        ),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        (
            {"quant_method": "awq", "version": "gemv"},
            r"awq: version 'gemv' is not supported \(supported: gemm",
        ),
        ({"quant_method": "awq", "zero_point": False}, "zero_point false"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8: activation_scheme 'static'"),
        ({"quant_method": "fp8"}, "fp8: weight_block_size None is not supported"),
        (
            qp.ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "tensor"}),
            "compressed-tensors: pack-quantized with strategy 'tensor'.*supported: pack-quantized",
        ),
        (
            {
                **qp.ct_config(
                    "float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}
                ),
                "ignore": ["model.layers.0.mlp.down_proj"],
            },
            "compressed-tensors: ignore names layers other than lm_head",
        ),
        (
            {
                **qp.ct_config(
                    "float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}
                ),
                "kv_cache_scheme": {"num_bits": 8, "type": "float"},
            },
            "compressed-tensors: a kv_cache_scheme",
        ),
    ],
)
def test_unsupported_configs_name_method_and_supported(plain, quant_config, message):
    _set_quant_config(plain, quant_config)
    try:
        with pytest.raises(ValueError, match=message):
            load_ours(plain)
    finally:
        _set_quant_config(plain, None)


def test_quantization_option_must_fit_the_checkpoint(plain, gptq):
    with pytest.raises(ValueError, match="no quantization_config; to quantize .* int8 or fp8"):
        _load(plain, "gptq")
    with pytest.raises(ValueError, match=r"quantized \(gptq\); quantization 'none' cannot load"):
        _load(gptq, "none")
    with pytest.raises(ValueError, match=r"'awq' does not match .* \(quant_method 'gptq'\)"):
        _load(gptq, "awq")
    assert type(_load(gptq, "gptq").model.layers[0].mlp.down_proj.quant_method).__name__ == (
        "GPTQMethod"
    )


def test_quantization_config_field_is_validated():
    assert EngineConfig.from_kwargs(quantization="fp8").model.quantization == "fp8"
    with pytest.raises(ValueError, match="'int4' is not one of auto, none, int8, fp8, gptq"):
        EngineConfig.from_kwargs(quantization="int4")
