"""GGUF linears kept in the file's blocks (``--quantization gguf``, CPU): K-quant layers (Q4_K,
Q5_K, Q6_K: random blocks with sane scales, gguf-py cannot quantize to them) next to Q4_0 / Q8_0
ones, against HF transformers running what gguf-py dequantizes them to; and the bytes kept."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightwell.kernels.cpu import gguf_cpu as cpu_kernels
from lightwell.models.loader import _gguf_kernels_fit
from tests.models.paged import PagedRunner
from tests.models.test_gguf import Q, gguf, write_tiny_gguf
from tests.models.tiny import hf_logits, hf_tiny_model, load_ours, rel_err, tiny_config

K_TYPES = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q5_K, "attn_output": Q.Q4_0,
     "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q8_0, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
     "ffn_gate": Q.Q6_K, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_K},
]  # fmt: skip
# where each K-quant block keeps its fp16 super-block scales (d, and dmin where it has one)
SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(array: np.ndarray, qtype, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random K-quant blocks of the array's shape (small fp16 scales), and their dequantized
    value; other types through gguf-py's quantizer."""
    if qtype not in SCALE_OFFSETS:
        blocks = gguf.quants.quantize(array, qtype)
        return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = array.shape
    rng = np.random.default_rng(seed + rows * 7 + cols)
    blocks = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.5e-3, 2e-3, (rows, cols // values)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
    blocks = blocks.reshape(rows, -1)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())


def test_k_quant_gguf_kept_quantized_matches_hf(tmp_path):
    torch.set_num_threads(1)
    config = tiny_config(
        "base",
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        num_hidden_layers=2,
        tie_word_embeddings=True,  # the Q6_K table is the LM head too
    )
    hf = hf_tiny_model(config, seed=2)
    path = str(tmp_path / "k.gguf")
    expected = write_tiny_gguf(path, hf, layer_types=K_TYPES, make=random_blocks, embed_type=Q.Q6_K)
    hf.load_state_dict({**hf.state_dict(), **expected})
    ours = load_ours(path, quantization="gguf")
    attn = ours.model.layers[0].self_attn.qkv_proj
    if cpu_kernels.available():  # every layer on the C kernels, the tied Q6_K table too
        assert [qtype for qtype, _, _ in attn.gguf_cpu] == [Q.Q4_K, Q.Q6_K, Q.Q5_K]
        linears = [m for m in ours.modules() if hasattr(m, "gguf_parts")]
        assert len(linears) == 8 and all(m.gguf_cpu is not None for m in linears)
        assert ours.model.embed_tokens.weight.gguf_type == Q.Q6_K
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
        files = SimpleNamespace(path=path)  # so auto keeps this file's blocks too
        assert _gguf_kernels_fit(files, "gguf", torch.float32, torch.device("cpu"))
    else:
        assert [qtype for qtype, _ in attn.gguf_parts] == [Q.Q4_K, Q.Q6_K, Q.Q5_K]
    prompt = list(range(5, 30))
    runner = PagedRunner(ours, block_size=4)
    (logits,) = runner.step([("a", prompt, 0)])
    assert rel_err(logits, hf_logits(hf, prompt)) < 1e-4
    seq = prompt + [int(logits[-1].argmax())]
    for _ in range(4):
        (step,) = runner.step([("a", seq[-1:], len(seq) - 1)])
        ref = hf_logits(hf, seq)[-1]
        assert rel_err(step[0], ref) < 1e-4
        assert int(step[0].argmax()) == int(ref.argmax())  # the same greedy token
        seq.append(int(step[0].argmax()))


@pytest.mark.slow
def test_smollm2_kept_quantized_holds_a_fraction_of_the_bytes(smollm2_gguf):
    """SmolLM2's linears hold the file's Q4_1 blocks (20 bytes per 32 weights), not fp32, joined
    per layer for the CPU kernels; the tied Q8_0 embedding keeps its blocks too."""
    ours = load_ours(smollm2_gguf, quantization="gguf")
    stored = weights = 0
    for module in ours.modules():
        parts = getattr(module, "gguf_parts", None) or []
        if getattr(module, "gguf_cpu", None) is not None:
            parts = [(q, blocks) for q, blocks, _ in module.gguf_cpu]
            assert len(parts) == 1  # one type: the fused parts joined
        for _, part in parts:
            stored += part.numel() * part.element_size()
            weights += part.shape[0] * module.input_size
    assert weights > 100e6  # SmolLM2-135M's linears
    assert stored < weights * 0.65  # bytes per weight (fp32: 4)
    assert not any(p.numel() > 1e6 for n, p in ours.named_parameters() if "proj" in n)
    table = ours.model.embed_tokens.weight
    assert ours.lm_head.weight is table and table.dtype == torch.uint8  # Q8_0: 34 B / 32
    assert table.gguf_type == Q.Q8_0 and table.numel() == 49152 * 576 // 32 * 34
