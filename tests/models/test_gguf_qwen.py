"""GGUF files of the qwen2 and qwen3 llama.cpp architectures, written here with gguf.GGUFWriter:
config from the metadata, tensor names (q/k/v biases, q/k norms; no q/k permutation: NeoX RoPE),
mixed tensor types, the byte-level BPE tokenizer with Qwen's pre-tokenizer and control tokens,
and the engine end to end on the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightwell.model_files import resolve_model
from lightwell.models.hf_config import load_hf_config
from tests.models.families import hf_generate
from tests.models.paged import PagedRunner
from tests.models.test_gguf import _loaded, roundtrip
from tests.models.tiny import hf_logits, load_ours, randomize, rel_err

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

SMALL = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=1000000.0,
)  # fmt: skip
TYPES = {
    "attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.BF16,
}  # fmt: skip
HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# byte-level BPE: "hello" and " world" are single tokens after these merges
WORD_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): 256 byte symbols, 41 merges, 3 control tokens = 300."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    letters = "abcfgijkmnpqstuvxyz"  # no d, e, h, l, o, r, w: the word merges stay as they are
    pairs = [f"{a} {b}" for a in letters for b in letters]
    merges = WORD_MERGES + pairs[: 41 - len(WORD_MERGES)]
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges] + SPECIAL
    types = [1] * (len(tokens) - len(SPECIAL)) + [3] * len(SPECIAL)  # 3: CONTROL
    return tokens, merges, types


def hf_qwen(arch: str, seed: int, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = {**SMALL, **extra}
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
    else:  # head_dim 24 != 64 / 4: read from attention.key_length
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=24, tie_word_embeddings=True))
    randomize(model.eval(), seed)
    return model


def write_qwen_gguf(
    path: str, hf, arch: str, layer_types: dict = TYPES, output_type=Q.F16
) -> dict[str, torch.Tensor]:
    """``hf`` as a llama.cpp ``arch`` GGUF with a tokenizer (the matrices in ``layer_types``,
    an untied LM head in ``output_type``); returns the weights a perfect loader produces (HF
    names, dequantized)."""
    cfg = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    tokens, merges, types = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    expected: dict[str, torch.Tensor] = {}

    def put(name: str, hf_name: str, qtype) -> None:
        w.add_tensor(name, gguf.quants.quantize(sd[hf_name], qtype), raw_dtype=qtype)
        expected[hf_name] = roundtrip(sd[hf_name], qtype)

    put("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0)
    for i in range(cfg.num_hidden_layers):
        for short, hf_short in HF_NAMES.items():
            for suffix in ("weight", "bias"):
                hf_name = f"model.layers.{i}.{hf_short}.{suffix}"
                if hf_name in sd:  # qwen2: q/k/v biases; qwen3: q/k norms
                    qtype = layer_types.get(short, Q.F32) if suffix == "weight" else Q.F32
                    put(f"blk.{i}.{short}.{suffix}", hf_name, qtype)
    put("output_norm.weight", "model.norm.weight", Q.F32)
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight", output_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen_gguf(request, tmp_path_factory):
    """(arch, path, HF reference holding the dequantized weights, expected weights)."""
    torch.set_num_threads(1)
    arch = request.param
    hf = hf_qwen(arch, seed=4)
    path = str(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf")
    expected = write_qwen_gguf(path, hf, arch)
    if hf.config.tie_word_embeddings:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    hf.load_state_dict({**hf.state_dict(), **expected})
    return arch, path, hf, expected


def test_config_from_metadata(qwen_gguf):
    arch, path, hf, _ = qwen_gguf
    config = load_hf_config(resolve_model(path))
    assert config.architectures == [
        {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]
    assert config.tie_word_embeddings == (arch == "qwen3")
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (2, 96, 300)
    assert config.rope_parameters["rope_theta"] == 1000000.0
    assert getattr(config, "head_dim", None) == (24 if arch == "qwen3" else None)


def test_weights_and_logits_equal_the_original(qwen_gguf):
    arch, path, hf, expected = qwen_gguf
    loaded = _loaded(load_ours(path, quantization="none"))  # dequantized at load
    for name, want in expected.items():
        if name != "lm_head.weight" or arch == "qwen2":
            assert torch.equal(loaded[name], want), name
    prompt = list(range(5, 40))
    for quantization in ("none", "auto", "gguf"):  # auto, gguf: the file's blocks
        ours = load_ours(path, quantization=quantization)
        (logits,) = PagedRunner(ours).step([("a", prompt, 0)])
        assert rel_err(logits, hf_logits(hf, prompt)) < 1e-4


def test_tokenizer_from_gguf(qwen_gguf):
    from lightwell.engine.tokenizer import Tokenizer

    _, path, _, _ = qwen_gguf
    tok = Tokenizer.load(resolve_model(path))
    tokens, _, _ = vocabulary()
    assert tok.encode("hello world", add_special_tokens=False) == [
        tokens.index("hello"),
        tokens.index("Ġworld"),
    ]
    assert tok.eos_token_id == tokens.index("<|im_end|>")
    ids = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert ids[0] == tokens.index("<|im_start|>") and tokens.index("<|im_end|>") in ids
    text = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_llm_on_the_gguf_matches_hf_generate(qwen_gguf):
    from lightwell import LLM, SamplingParams

    _, path, hf, _ = qwen_gguf
    prompts = [list(range(7, 30)), list(range(100, 109))]
    llm = LLM(model=path, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf, p, 12) for p in prompts]
