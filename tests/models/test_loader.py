"""Loader routing, clear errors for bad checkpoints, dummy weights and shape presets."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightwell.model_files import resolve_model
from lightwell.models.hf_config import PRESETS, get_rope_config, load_hf_config
from lightwell.models.loader import load_model
from lightwell.models.registry import get_model_class
from tests.models.tiny import hf_tiny_model, load_ours, save_hf, tiny_config


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return save_hf(hf_tiny_model(tiny_config()), str(tmp_path_factory.mktemp("tiny")))


def _copy_with(src: str, dst: str, edit) -> str:
    """A copy of the checkpoint folder whose tensors went through ``edit(dict)``."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(config)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return os.path.join(dst, "model.safetensors")


def test_unknown_architecture(tiny_folder, tmp_path):
    _copy_with(tiny_folder, str(tmp_path), lambda t: None)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = ["FooForCausalLM"]
    path.write_text(json.dumps(config))
    hf_config = load_hf_config(resolve_model(str(tmp_path)))
    with pytest.raises(ValueError, match="FooForCausalLM.*not supported.*LlamaForCausalLM"):
        load_model(resolve_model(str(tmp_path)), hf_config, torch.float32, "cpu")


def test_wrong_shape_names_file_and_tensor(tiny_folder, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"

    def edit(t):
        t[name] = torch.zeros(64, 99)

    file = _copy_with(tiny_folder, str(tmp_path), edit)
    with pytest.raises(ValueError) as e:
        load_ours(str(tmp_path))
    msg = str(e.value)
    assert file in msg and name in msg and "(64, 99)" in msg and "(64, 100)" in msg


def test_wrong_shape_of_fused_member(tiny_folder, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(48, 64)  # 3 KV heads' rows instead of 2

    _copy_with(tiny_folder, str(tmp_path), edit)
    with pytest.raises(ValueError, match=f"{name}.*shape mismatch"):
        load_ours(str(tmp_path))


def test_missing_tensor(tiny_folder, tmp_path):
    file = _copy_with(
        tiny_folder, str(tmp_path), lambda t: t.pop("model.layers.1.self_attn.v_proj.weight")
    )
    with pytest.raises(ValueError, match="missing.*model.layers.1.self_attn.qkv_proj.weight"):
        load_ours(str(tmp_path))
    assert os.path.exists(file)


def test_unknown_tensor(tiny_folder, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # skipped, not unknown
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)

    _copy_with(tiny_folder, str(tmp_path), edit)
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra_proj.weight"):
        load_ours(str(tmp_path))


def test_load_format_mismatch(tiny_folder):
    with pytest.raises(ValueError, match="gguf"):
        load_ours(tiny_folder, load_format="gguf")


def test_no_architecture_lists_supported():
    class Cfg:
        architectures = None

    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class(Cfg())


def test_dummy_weights(tiny_folder):
    a = load_ours(tiny_folder, load_format="dummy", overrides={"num_hidden_layers": 1})
    b = load_ours(tiny_folder, load_format="dummy", overrides='{"num_hidden_layers": 1}')
    assert len(a.model.layers) == 1
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name  # seeded
        if "norm" in name:
            assert torch.all(p == 1), name
        else:
            assert 0.015 < p.std().item() < 0.025, name


def test_dummy_bias_zero(tiny_folder):
    model = load_ours(tiny_folder, load_format="dummy", overrides={"attention_bias": True})
    assert torch.all(model.model.layers[0].self_attn.qkv_proj.bias == 0)


@pytest.mark.parametrize(
    "preset, params",
    [("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496)],
)
def test_presets_build_real_shapes(preset, params):
    config = load_hf_config(None, preset)
    assert get_rope_config(config).theta == 500000.0
    model = load_model(None, config, torch.bfloat16, "meta", load_format="dummy")
    assert sum(p.numel() for p in model.parameters()) == params
    attn = model.model.layers[0].self_attn.attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (
        PRESETS[preset]["num_attention_heads"],
        8,
        128,
    )


def test_qwen_preset_builds_qwen2():
    config = load_hf_config(None, "qwen2.5-7b")
    assert config.hidden_size == 3584 and config.num_key_value_heads == 4
    assert get_model_class(config).__name__ == "Qwen2ForCausalLM"
    model = load_model(None, config, torch.bfloat16, "meta", load_format="dummy")
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512  # Qwen2.5-7B's count
    assert model.model.layers[0].self_attn.qkv_proj.bias.shape == (3584 + 2 * 512,)


def test_layer_count_override_of_a_config_with_layer_types():
    # Qwen2's config lists a type a layer: a new layer count derives them again (Qwen2-72B's
    # shapes from the 28-layer Qwen2.5-7B preset)
    config = load_hf_config(None, {"preset": "qwen2.5-7b", "num_hidden_layers": 80,
                                   "hidden_size": 8192, "num_attention_heads": 64})  # fmt: skip
    assert config.num_hidden_layers == 80 and len(config.layer_types) == 80
    assert set(config.layer_types) == {"full_attention"}
    config = load_hf_config(None, {"preset": "qwen2.5-7b", "num_hidden_layers": 2})
    assert len(config.layer_types) == 2


def test_override_rope_theta_and_preset_with_overrides():
    config = load_hf_config(None, {"preset": "llama-3-8b", "num_hidden_layers": 2})
    assert config.num_hidden_layers == 2 and config.hidden_size == 4096
    config = load_hf_config(None, {"preset": "llama-3-8b", "rope_theta": 1234.0})
    assert get_rope_config(config).theta == 1234.0
    with pytest.raises(ValueError, match="preset"):
        load_hf_config(None, "llama-9-b")
