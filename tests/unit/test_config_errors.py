"""Model configs a model cannot be built from are refused in one line naming the field, before
any tensor is made; an unsupported architecture names the supported ones; a folder without
tokenizer files says so."""

from __future__ import annotations

import json

import pytest

from lightwell.engine.tokenizer import Tokenizer
from lightwell.model_files import ModelFiles
from lightwell.models.hf_config import load_hf_config

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def _folder(tmp_path, **fields) -> ModelFiles:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return ModelFiles("hf", str(tmp_path), "tiny")


def test_a_valid_config_loads(tmp_path):
    assert load_hf_config(_folder(tmp_path)).hidden_size == 64


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"hidden_size": -64}, "hidden_size must be a positive integer (got -64)"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer (got 0)"),
        ({"vocab_size": 100.5}, "Field 'vocab_size' expected int, got float (value: 100.5)"),
        ({"intermediate_size": -1}, "intermediate_size must be an integer >= 0 (got -1)"),
        ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of"),
        ({"hidden_size": 66}, "hidden size (66) is not a multiple of the number of attention"),
    ],
)
def test_sizes_a_model_cannot_have_are_one_line(tmp_path, fields, message):
    with pytest.raises(ValueError) as e:
        load_hf_config(_folder(tmp_path, **fields))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path) in str(e.value)


def test_overrides_are_checked_too(tmp_path):
    with pytest.raises(ValueError, match="with overrides: config field num_attention_heads must"):
        load_hf_config(_folder(tmp_path), '{"num_attention_heads": 0}')
    with pytest.raises(
        ValueError, match="preset 'llama-3-8b' with overrides: config field hidden_size"
    ):
        load_hf_config(None, {"preset": "llama-3-8b", "hidden_size": -1})


def test_an_unknown_architecture_names_the_supported_ones(tmp_path):
    files = _folder(tmp_path, architectures=["FooForCausalLM"], model_type="foo")
    with pytest.raises(ValueError) as e:
        load_hf_config(files)
    msg = str(e.value)
    assert "architecture FooForCausalLM is not supported" in msg and "LlamaForCausalLM" in msg
    assert "\n" not in msg


def test_a_folder_without_tokenizer_files_says_so(tmp_path):
    _folder(tmp_path)
    with pytest.raises(ValueError) as e:
        Tokenizer.load(ModelFiles("hf", str(tmp_path), "tiny"))
    msg = str(e.value)
    assert "holds none of tokenizer.json" in msg and "\n" not in msg


def test_a_config_that_is_not_json_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON: Expecting property"):
        load_hf_config(ModelFiles("hf", str(tmp_path), "tiny"))


def test_latent_attention_has_no_kv_head_rule():
    """DeepSeek's heads share one latent: fewer heads than its num_key_value_heads (the
    multi-GPU dry runs shrink the head count so) is a valid configuration."""
    cfg = load_hf_config(None, {"preset": "deepseek-v2-lite", "num_attention_heads": 4})
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 16
