"""`LLM(...)` logs one line per start-up stage, with its seconds (the bars need a terminal: none
here, so stderr stays empty). A tiny random Llama checkpoint in safetensors, quantized to int8
at load so that the conversion stage runs too."""

from __future__ import annotations

import json
import logging
import re

import torch

from lightwell import LLM, SamplingParams

SECONDS = r" in \d+\.\d s"
H, FF, V, LAYERS = 64, 128, 256, 2
SHAPES = {"q_proj": (H, H), "k_proj": (H // 2, H), "v_proj": (H // 2, H), "o_proj": (H, H)}
SHAPES |= {"gate_proj": (FF, H), "up_proj": (FF, H), "down_proj": (H, FF)}


def _tiny_checkpoint(folder) -> str:
    """config.json and model.safetensors of a random 2-layer Llama (4 heads, 2 KV heads)."""
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": V, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    }  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    tensors["lm_head.weight"] = (V, H)
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        tensors |= {
            pre + "input_layernorm.weight": (H,),
            pre + "post_attention_layernorm.weight": (H,),
        }
        for name, shape in SHAPES.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensors[f"{pre}{part}.{name}.weight"] = shape
    weights = {k: 0.1 * torch.randn(shape, generator=gen) for k, shape in tensors.items()}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_llm_logs_every_start_up_stage(tmp_path, caplog, capfd):
    folder = _tiny_checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="lightwell.startup"):
        llm = LLM(
            folder, quantization="int8", skip_tokenizer_init=True, num_threads=1, num_kv_blocks=8
        )
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "lightwell.startup"]
        expected = [
            r"read the config of LlamaForCausalLM",
            r"loaded 21 weight tensors onto cpu",  # 2 layers x 9, embedding, norm, LM head
            r"converted the weights of 8 layers \(Int8WeightOnlyMethod\)",
            r"allocated the KV cache \(8 blocks, 0\.00 GiB\)",
            r"warmed up",
            r"engine ready",
        ]
        assert len(lines) == len(expected), lines
        for line, pattern in zip(lines, expected):
            assert re.fullmatch(pattern + SECONDS, line), (line, pattern)
        out = llm.generate(
            {"prompt_token_ids": [1, 2, 3]},
            SamplingParams(max_tokens=2, ignore_eos=True),
            use_tqdm=False,
        )
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
    assert "Loading weights" not in capfd.readouterr().err  # not a terminal: no bar
