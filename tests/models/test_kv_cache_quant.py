"""Quantized KV caches (--kv-cache-dtype fp8 / int8) on the torch attention backend: the
round-trip error of one stored row within its format's bound, and a tiny Llama's logits (prompts
prefilled in chunks, so cached keys/values are read back, then greedy decode steps over a
batch of unequal lengths) within a stated bound of HF transformers in fp32."""

from __future__ import annotations

import pytest
import torch

from lightwell.quant.kv_cache import (
    dequantize_blocks,
    dequantize_kv,
    quantize_blocks,
    quantize_kv,
    split_blocks,
)
from tests.models.paged import PagedRunner
from tests.models.tiny import hf_logits, hf_tiny_model, load_ours, rel_err, save_hf, tiny_config

FP8 = torch.float8_e4m3fn
# the logits' error, max |ours - HF| / max |HF|, over prefill chunks and decode steps
BOUND = {"fp8": 0.08, "int8": 0.02}


def test_kv_round_trip_within_format_bounds():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=gen) * torch.tensor([0.01, 1.0, 50.0])[None, :, None]
    q, s = quantize_kv(x, torch.int8)
    assert q.shape == (7, 3, 16) and q.dtype == torch.int8 and s.shape == (7, 3)
    step = x.abs().amax(-1, keepdim=True) / 127  # one int8 step per token and head
    assert ((dequantize_kv(q, s, torch.float32) - x).abs() <= step / 2 + 1e-7).all()
    f, s = quantize_kv(x, FP8)
    assert f.shape == (7, 3, 16) and f.dtype == FP8
    scale = x.abs().amax(-1, keepdim=True) / 448
    err = (dequantize_kv(f, s, torch.float32) - x).abs()
    normal = x.abs() >= scale * 2**-6  # e4m3's normal range: 3 mantissa bits, nearest
    assert (err[normal] <= x.abs()[normal] / 16 + 1e-7).all()
    assert (err[~normal] <= (scale * 2**-10).expand_as(x)[~normal] + 1e-9).all()


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_block_layout_values_then_head_major_scales(dtype):
    """A block of B tokens x Hkv heads: B * Hkv rows of D values (token-major), then the Hkv * B
    fp32 scales (head-major); ``split_blocks`` views them, the round trip is the rows'."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 2, 8, generator=gen)  # [N, B, Hkv, D]
    blocks = quantize_blocks(x, dtype)
    assert blocks.shape == (3, 4, 2, 12) and blocks.dtype == dtype
    q, s = quantize_kv(x, dtype)
    raw = blocks.view(torch.uint8).view(3, -1)  # a block's bytes
    assert torch.equal(raw[:, : 4 * 2 * 8], q.reshape(3, -1).view(torch.uint8))
    assert torch.equal(raw[:, 4 * 2 * 8 :].contiguous().view(torch.float32).view(3, 2, 4),
                       s.transpose(1, 2))  # fmt: skip
    values, scales = split_blocks(blocks)
    assert values.data_ptr() == blocks.data_ptr() and scales.shape == (3, 2, 4)
    torch.testing.assert_close(
        dequantize_blocks(blocks, torch.float32), dequantize_kv(q, s, torch.float32)
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    hf = hf_tiny_model(tiny_config("base", max_position_embeddings=256), seed=4)
    return hf, load_ours(save_hf(hf, str(tmp_path_factory.mktemp("kv"))))


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_cache_logits_within_bound(pair, kv):
    hf, ours = pair
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (23, 9)]
    runner = PagedRunner(ours, block_size=4, num_blocks=64, kv_cache_dtype=kv)
    assert runner.caches[0].dtype == {"fp8": FP8, "int8": torch.int8}[kv]
    errs, seqs = [], [list(p) for p in prompts]
    done = 0
    for chunk in (10, 13):  # the first prompt in two chunks: the second reads the cache
        part = [("a", prompts[0][done : done + chunk], done)]
        if done == 0:
            part.append(("b", prompts[1], 0))
        out = runner.step(part)
        done += chunk
        errs.append(rel_err(out[0], hf_logits(hf, prompts[0][:done])[done - chunk :]))
    for _ in range(6):
        for s in seqs:
            s.append(int(hf_logits(hf, s)[-1].argmax()))
        out = runner.step([(r, [s[-1]], len(s) - 1) for r, s in zip("ab", seqs)])
        errs += [rel_err(o[0], hf_logits(hf, s)[-1]) for o, s in zip(out, seqs)]
    assert max(errs) < BOUND[kv], errs
    assert max(errs) > 0  # the cache is really quantized


def test_kv_cache_dtype_sizes_the_cache_on_either_backend(pair):
    from lightwell.worker.model_runner import ModelRunner

    _, ours = pair
    kw = dict(block_size=16, vocab_size=300, device=torch.device("cpu"), dtype=torch.bfloat16)
    sizes = {kv: ModelRunner(ours, kv_cache_dtype=kv, **kw).kv_bytes_per_block() for kv in BOUND}
    auto = ModelRunner(ours, **kw).kv_bytes_per_block()
    assert sizes["fp8"] == sizes["int8"] == auto * 20 // 32  # head_dim 16: 16 + 4 bytes vs 32
    runner = ModelRunner(ours, kv_cache_dtype="int8", **kw)
    runner.set_attention_backend("triton")  # the Triton kernels read and write 8-bit caches
    assert all(a.backend.name == "triton" for a in runner.attn_layers)


def test_8bit_cache_refuses_a_head_dim_without_aligned_scales(pair, monkeypatch):
    from lightwell.layers.attention import Attention
    from lightwell.worker.model_runner import ModelRunner

    _, ours = pair
    kw = dict(block_size=16, vocab_size=300, device=torch.device("cpu"), dtype=torch.float32)
    layer = next(m for m in ours.modules() if isinstance(m, Attention))
    monkeypatch.setattr(layer, "head_dim", 18)
    with pytest.raises(ValueError, match="head_dim % 4"):
        ModelRunner(ours, kv_cache_dtype="fp8", **kw)
    ModelRunner(ours, **kw)  # the model-dtype cache takes any head_dim
    with pytest.raises(ValueError, match="head_dim % 4"):
        split_blocks(torch.zeros(2, 4, 1, 10, dtype=torch.int8))  # D = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = hf_tiny_model(tiny_config("base", max_position_embeddings=256), seed=6)
    return save_hf(hf, str(tmp_path_factory.mktemp("kv_engine")))


def _engine_run(folder: str, backend: str, kv: str) -> list:
    """Greedy generations through the engine: a prompt, then two sharing its first 8 tokens
    (prefix-cache hits on 4-token blocks); an 8-token budget chunks every prompt."""
    from lightwell import LLM
    from lightwell.types import SamplingParams

    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 300, (8,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 2, 6)]
    llm = LLM(folder, skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=48, max_num_batched_tokens=8, attention_backend=backend,
              kv_cache_dtype=kv)  # fmt: skip
    sp = SamplingParams(max_tokens=3, temperature=0.0, logprobs=0)
    try:
        outs = llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.num_cached_tokens for o in outs[1:]] == [8, 8]
    return outs


# max |logprob| difference of the sampled tokens, Triton vs torch backend on the same 8-bit
# cache (both attend over the dequantized cache, fresh prompts included: fp32 rounding only)
ENGINE_BOUND = 1e-4


def test_triton_backend_on_an_fp8_cache_generates_as_the_torch_backend(folder):
    triton_outs = _engine_run(folder, "triton", "fp8")
    torch_outs = _engine_run(folder, "torch", "fp8")
    diffs = []
    for a, b in zip(triton_outs, torch_outs):
        ca, cb = a.outputs[0], b.outputs[0]
        assert list(ca.token_ids) == list(cb.token_ids)
        for la, lb, t in zip(ca.logprobs, cb.logprobs, ca.token_ids):
            diffs.append(abs(la[t].logprob - lb[t].logprob))
    assert max(diffs) < ENGINE_BOUND, diffs


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_8bit_latent_cache_of_deepseek_within_bound(tmp_path, family):
    """DeepSeek's latent cache in fp8 / int8 (one scale an entry over its latent and RoPE
    parts): a prompt prefilled in two chunks (each reads the quantized entries back, the first
    its own, as the GPU's expanded prefill does) and greedy decode steps stay within the K/V
    caches' bounds of HF in fp32. Every layer dense:
    in a tiny random MoE the cache's rounding can flip an expert choice, which moves a step's
    logits by far more than the cache's error."""
    from tests.models import families
    from tests.models.tiny import hf_logits

    torch.set_num_threads(1)
    hf = getattr(families, family)(str(tmp_path), 3, first_k_dense_replace=3)
    ours = load_ours(str(tmp_path))
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 300, (19,), generator=gen).tolist()
    first = PagedRunner(ours, block_size=4, num_blocks=48).step([("a", prompt[:8], 0)])[0]
    for kv in ("fp8", "int8"):
        runner = PagedRunner(ours, block_size=4, num_blocks=48, kv_cache_dtype=kv)
        assert runner.caches[0].shape[-1] == 32 + 8 + 4  # kv_lora_rank + rope dims + a scale
        errs, seq, done = [], list(prompt), 0
        for chunk in (8, 11):
            out = runner.step([("a", prompt[done : done + chunk], done)])
            if done == 0:  # a fresh chunk reads its own entries back quantized too
                assert rel_err(out[0], first) > 1e-3
            done += chunk
            errs.append(rel_err(out[0], hf_logits(hf, prompt[:done])[done - chunk :]))
        for _ in range(5):
            seq.append(int(hf_logits(hf, seq)[-1].argmax()))
            out = runner.step([("a", [seq[-1]], len(seq) - 1)])
            errs.append(rel_err(out[0][0], hf_logits(hf, seq)[-1]))
        assert max(errs) < BOUND[kv], (kv, errs)


def test_latent_cache_dtype_sizes_the_cache():
    from lightwell.layers.mla import LatentAttention
    from lightwell.worker.model_runner import ModelRunner

    model = torch.nn.Sequential(LatentAttention(16, 512, 64, 1.0))
    kw = dict(block_size=16, vocab_size=300, device=torch.device("cpu"), dtype=torch.bfloat16)
    auto = ModelRunner(model, **kw).kv_bytes_per_block()
    fp8 = ModelRunner(model, kv_cache_dtype="fp8", **kw).kv_bytes_per_block()
    assert auto == 16 * 576 * 2 and fp8 == 16 * 580  # 1.99x the tokens
