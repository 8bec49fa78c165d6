"""GGUF files of the MoE llama.cpp architectures, written here with gguf.GGUFWriter: qwen2moe
(shared expert, its [H] sigmoid gate), qwen3moe (q/k norms), and Mixtral as llama.cpp writes it
(arch "llama" with an expert count, q/k permuted). Experts stacked per layer (ffn_*_exps,
quantized), router ffn_gate_inp; config from the metadata; logits and greedy tokens vs HF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightwell.model_files import resolve_model
from lightwell.models.hf_config import load_hf_config
from tests.models.families import hf_generate
from tests.models.paged import PagedRunner
from tests.models.test_gguf import llama_cpp_permute, roundtrip
from tests.models.tiny import hf_logits, load_ours, randomize, rel_err

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

SMALL = dict(
    vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, num_experts_per_tok=2,
)  # fmt: skip
ATTN = {
    "attn_q": ("self_attn.q_proj", Q.Q8_0),
    "attn_k": ("self_attn.k_proj", Q.F16),
    "attn_v": ("self_attn.v_proj", Q.F32),
    "attn_output": ("self_attn.o_proj", Q.Q8_0),
}
F32_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
SHARED = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj", "ffn_down_shexp": "down_proj"}
ARCHS = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
         "llama": "MixtralForCausalLM"}  # fmt: skip


def hf_moe(arch: str, seed: int):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = dict(num_experts=4, moe_intermediate_size=32)
    if arch == "qwen2moe":
        cfg = Qwen2MoeConfig(**SMALL, **moe, shared_expert_intermediate_size=64)
    elif arch == "qwen3moe":
        cfg = Qwen3MoeConfig(**SMALL, **moe, head_dim=24, norm_topk_prob=True)
    else:
        cfg = MixtralConfig(**SMALL, num_local_experts=4)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed)
    return model


def write_moe_gguf(path: str, hf, arch: str) -> dict[str, torch.Tensor]:
    """``hf`` as llama.cpp writes it; returns HF's state dict with the quantized tensors
    replaced by what dequantization gives back."""
    cfg = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    experts = 4
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    expected: dict[str, torch.Tensor] = {}

    def put(name: str, hf_name: str, qtype, heads: int = 0, array=None) -> np.ndarray:
        array = sd[hf_name] if array is None else array
        stored = llama_cpp_permute(array, heads) if heads else array
        w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        expected[hf_name] = roundtrip(array, qtype)

    put("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for short, (hf_short, qtype) in ATTN.items():
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
            permute = heads.get(short, 0) if arch == "llama" else 0
            put(f"blk.{i}.{short}.weight", f"{pre}{hf_short}.weight", qtype, permute)
            if f"{pre}{hf_short}.bias" in sd:
                put(f"blk.{i}.{short}.bias", f"{pre}{hf_short}.bias", Q.F32)
        for short, hf_short in F32_NAMES.items():
            if f"{pre}{hf_short}.weight" in sd:
                put(f"blk.{i}.{short}.weight", f"{pre}{hf_short}.weight", Q.F32)
        gate_up = sd[f"{pre}mlp.experts.gate_up_proj"]  # [E, 2I, H]
        gate, up = np.split(gate_up, 2, axis=1)
        for short, array, qtype in (("gate", gate, Q.Q8_0), ("up", up, Q.F16)):
            w.add_tensor(f"blk.{i}.ffn_{short}_exps.weight", gguf.quants.quantize(array, qtype),
                         raw_dtype=qtype)  # fmt: skip
            half = roundtrip(array, qtype)
            expected.setdefault(f"{pre}mlp.experts.gate_up_proj", []).append(half)
        expected[f"{pre}mlp.experts.gate_up_proj"] = torch.cat(
            expected[f"{pre}mlp.experts.gate_up_proj"], dim=1
        )
        put(f"blk.{i}.ffn_down_exps.weight", f"{pre}mlp.experts.down_proj", Q.Q8_0)
        if arch == "qwen2moe":
            for short, proj in SHARED.items():
                put(f"blk.{i}.{short}.weight", f"{pre}mlp.shared_expert.{proj}.weight", Q.F32)
            gate_w = sd[f"{pre}mlp.shared_expert_gate.weight"]  # [1, H], stored as [H]
            w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", gate_w[0])
    put("output_norm.weight", "model.norm.weight", Q.F32)
    put("output.weight", "lm_head.weight", Q.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module", params=sorted(ARCHS))
def moe_gguf(request, tmp_path_factory):
    """(arch, path, HF reference holding the dequantized weights)."""
    torch.set_num_threads(1)
    arch = request.param
    hf = hf_moe(arch, seed=6)
    path = str(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf")
    expected = write_moe_gguf(path, hf, arch)
    hf.load_state_dict({**hf.state_dict(), **expected})
    return arch, path, hf


def test_config_from_metadata(moe_gguf):
    arch, path, hf = moe_gguf
    config = load_hf_config(resolve_model(path))
    assert config.architectures == [ARCHS[arch]]
    assert (config.num_experts_per_tok, config.num_key_value_heads) == (2, 2)
    if arch == "llama":
        assert (config.num_local_experts, config.intermediate_size) == (4, 64)
    else:
        assert (config.num_experts, config.moe_intermediate_size) == (4, 32)
        assert config.norm_topk_prob == (arch == "qwen3moe")
    if arch == "qwen2moe":
        assert config.shared_expert_intermediate_size == 64


def test_logits_and_greedy_tokens_match_hf(moe_gguf):
    from lightwell import LLM, SamplingParams

    _, path, hf = moe_gguf
    prompt = list(range(5, 40))
    (logits,) = PagedRunner(load_ours(path)).step([("a", prompt, 0)])
    assert rel_err(logits, hf_logits(hf, prompt)) < 1e-4
    prompts = [list(range(7, 30)), list(range(100, 109))]
    llm = LLM(model=path, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
              skip_tokenizer_init=True)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf, p, 12) for p in prompts]
