"""GGUF loading: a tiny llama GGUF written here (q/k permuted as llama.cpp does, mixed tensor
types), and the real SmolLM2 GGUF against HF transformers' own GGUF loader."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lightwell.model_files import resolve_model
from lightwell.models.hf_config import get_rope_config, load_hf_config
from tests.models.paged import PagedRunner
from tests.models.tiny import hf_logits, hf_tiny_model, load_ours, rel_err, tiny_config

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# Per layer: tensor -> type (in_features are multiples of 32 so every quant type applies).
LAYER_TYPES = [
    {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_0},
    {"attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.BF16,
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0},
]  # fmt: skip
HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (half-split -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def roundtrip(w: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).copy())


def quantize_roundtrip(array: np.ndarray, qtype) -> tuple[np.ndarray, torch.Tensor]:
    """(stored blocks, what they dequantize to) of a float array, by gguf-py's quantizer."""
    return gguf.quants.quantize(array, qtype), roundtrip(array, qtype)


def write_tiny_gguf(
    path: str,
    hf_model,
    rope_freqs: np.ndarray | None = None,
    layer_types: list[dict] = LAYER_TYPES,
    make=quantize_roundtrip,
    embed_type=Q.Q8_0,
) -> dict:
    """Write ``hf_model`` as a llama GGUF; return the weights a perfect loader must produce
    (HF names, dequantized, original row order). ``make(array, qtype)`` gives a tensor's stored
    blocks and their dequantized value (default: gguf-py quantizes the model's weights)."""
    cfg = hf_model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    expected: dict[str, torch.Tensor] = {}

    def put(name: str, hf_name: str, array: np.ndarray, qtype, heads: int = 0) -> None:
        # Row-wise quantization commutes with the row permutation.
        blocks, expected[hf_name] = make(array, qtype)
        stored = llama_cpp_permute(blocks, heads) if heads else blocks
        w.add_tensor(name, stored, raw_dtype=qtype)

    embed = "model.embed_tokens.weight"
    put("token_embd.weight", embed, sd[embed], embed_type)
    for i in range(cfg.num_hidden_layers):
        types = layer_types[i % len(layer_types)]
        for short, qtype in types.items():
            hf_name = f"model.layers.{i}.{HF_NAMES[short]}.weight"
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
            put(f"blk.{i}.{short}.weight", hf_name, sd[hf_name], qtype, heads.get(short, 0))
        for short, hf in (("attn_norm", "input"), ("ffn_norm", "post_attention")):
            name = f"model.layers.{i}.{hf}_layernorm.weight"
            put(f"blk.{i}.{short}.weight", name, sd[name], Q.F32)
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], Q.F32)
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight", sd["lm_head.weight"], Q.F16)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def llama3_freq_factors(config) -> np.ndarray:
    """What llama.cpp stores for Llama 3 scaling: default inv_freq / llama3 inv_freq."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    d = config.head_dim
    default = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return (default / scaled).numpy()


def _loaded(model) -> dict[str, torch.Tensor]:
    """Our parameters split back into HF names (q/k/v and gate/up un-fused)."""
    out = {}
    for name, p in model.state_dict().items():
        if ".qkv_proj." in name:
            attn = model.model.layers[int(name.split(".")[2])].self_attn
            q, k, v = p.split([attn.q_size, attn.kv_size, attn.kv_size])
            for part, t in zip("qkv", (q, k, v)):
                out[name.replace("qkv_proj", f"{part}_proj")] = t
        elif ".gate_up_proj." in name:
            gate, up = p.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        elif "embed_tokens" in name or "lm_head" in name:
            out[name] = p[: model.config.vocab_size]  # drop the vocab padding rows
        else:
            out[name] = p
    return out


@pytest.mark.parametrize("variant", ["base", "tied", "llama3"])
def test_tiny_gguf(tmp_path, variant):
    torch.set_num_threads(1)
    extra = {"intermediate_size": 96, "num_hidden_layers": 2}
    kind = {"base": "base", "tied": "tied_bias", "llama3": "llama3"}[variant]
    if variant == "tied":
        extra.update(attention_bias=False, mlp_bias=False, head_dim=16)
    hf = hf_tiny_model(tiny_config(kind, **extra), seed=3)
    freqs = llama3_freq_factors(hf.config) if variant == "llama3" else None
    path = str(tmp_path / "tiny.gguf")
    expected = write_tiny_gguf(path, hf, freqs)

    config = load_hf_config(resolve_model(path))
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings == (variant == "tied")
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (2, 96, 300)
    loaded = _loaded(load_ours(path, quantization="none"))  # dequantized at load
    for name, want in expected.items():
        assert torch.equal(loaded[name], want), name
    q0 = "model.layers.0.self_attn.q_proj.weight"  # stored F32: exactly the original
    assert torch.equal(loaded[q0], hf.state_dict()[q0])
    if variant == "llama3":
        assert get_rope_config(config).scaling["rope_type"] == "freq_factors"

    hf.load_state_dict({**hf.state_dict(), **expected})  # the reference sees the same weights
    prompt = list(range(5, 40))
    for quantization in ("none", "auto", "gguf"):  # auto, gguf: the file's blocks (CPU kernels)
        ours = load_ours(path, quantization=quantization)
        (logits,) = PagedRunner(ours).step([("a", prompt, 0)])
        assert rel_err(logits, hf_logits(hf, prompt)) < 1e-4
    segments = ours.model.layers[1].mlp.gate_up_proj.gguf_cpu  # Q4_0 gate, Q4_1 up: raw blocks
    assert [(b.dtype, qtype, start) for qtype, b, start in segments] == [
        (torch.uint8, 2, 0),
        (torch.uint8, 3, 96),
    ]


def test_smollm2_gguf_matches_hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    folder, name = os.path.split(smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ref = hf_logits(hf, ids)
    del hf
    ours = load_ours(smollm2_gguf)
    (logits,) = PagedRunner(ours, block_size=16).step([("a", ids, 0)])
    assert rel_err(logits, ref) < 1e-3
    assert torch.equal(logits[-1].argmax(), ref[-1].argmax())


def test_auto_keeps_blocks_only_when_every_layer_matrix_takes_the_kernels(tmp_path):
    """``auto`` on the CPU keeps a file's blocks when its layers are all in types the CPU
    kernels take (here Q4_0 / Q8_0; K-quants: test_gguf_quantized.py), not when float matrices
    sit among them (they would be joined at every call)."""
    from types import SimpleNamespace

    from lightwell.kernels.cpu import gguf_cpu
    from lightwell.models.loader import _gguf_kernels_fit

    if not gguf_cpu.available():
        pytest.skip("no C compiler with OpenMP: auto never keeps the blocks")
    cpu = torch.device("cpu")
    config = tiny_config("base", intermediate_size=96, num_hidden_layers=2)
    hf = hf_tiny_model(config, seed=1)
    blocks = [{short: Q.Q4_0 if i % 2 else Q.Q8_0 for i, short in enumerate(HF_NAMES)}]
    for name, types in (("mixed", LAYER_TYPES), ("blocks", blocks)):
        path = str(tmp_path / f"{name}.gguf")
        write_tiny_gguf(path, hf, layer_types=types)
        fits = _gguf_kernels_fit(SimpleNamespace(path=path), "gguf", torch.float32, cpu)
        assert fits == (name == "blocks")


def test_llama_gguf_config_has_llamaconfigs_values_without_importing_it(smollm2_gguf, tmp_path):
    """A llama file's config is a plain PretrainedConfig (transformers' LlamaConfig imports
    sympy and much of transformers: ~70 MB resident) with the values LlamaConfig gives."""
    import subprocess
    import sys

    import transformers

    from lightwell.models.gguf_config import gguf_hf_config

    ours = gguf_hf_config(smollm2_gguf)
    theirs = transformers.LlamaConfig(**{k: v for k, v in ours.to_dict().items() if k not in (
        "transformers_version", "model_type")})  # fmt: skip
    fields = ["hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias",
              "mlp_bias", "num_key_value_heads", "tie_word_embeddings", "vocab_size"]  # fmt: skip
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert get_rope_config(ours) == get_rope_config(theirs)
    ours.save_pretrained(str(tmp_path))  # saved, it reads back as a LlamaConfig
    back = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert type(back) is transformers.LlamaConfig
    assert {f: getattr(back, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    code = (
        "import sys; from lightwell.models.gguf_config import gguf_hf_config; "
        f"gguf_hf_config({smollm2_gguf!r}); "
        "print('sympy' in sys.modules, 'transformers.models.llama' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
