"""The fused CPU decode (``worker/cpu_decode.py`` over ``kernels/cpu/llama_decode.c``) against
the model's own layer-by-layer forward: a tiny Llama GGUF (Q4_1, Q4_0 and Q8_0 layers; K-quant
and Q5 layers mixed within a layer; GQA,
block tables out of order, a NaN-poisoned cache), three requests of different lengths decoding
together; float32 activations and int8 ones; and through the engine."""

from __future__ import annotations

import pytest
import torch

from lightwell.attention.metadata import get_attention_metadata
from lightwell.kernels.cpu import gguf_cpu as kernels
from lightwell.worker.cpu_decode import CpuDecode
from tests.models.paged import PagedRunner, build_metadata
from tests.models.test_gguf import Q, write_tiny_gguf
from tests.models.tiny import hf_tiny_model, load_ours, rel_err, tiny_config

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler with OpenMP")
ONE_TYPE = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYERS = [{name: qtype for name in ONE_TYPE} for qtype in (Q.Q4_1, Q.Q4_0, Q.Q8_0)]
# b: 140+ keys, attended in 2 ranges of 3 tiles each
PROMPTS = {"a": [5, 17, 33, 2, 90], "b": [(7 * i) % 290 + 5 for i in range(140)], "c": [7, 8]}


# K-quant and Q5 layers, as llama.cpp's Q4_K_M / Q5_K_M recipes mix them: q, k and v of three
# types (three runs of rows in the fused qkv), of two (Q5_0 q and k, a Q8_0 v), gate and up apart
MIXED = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q5_0, "attn_v": Q.Q6_K, "attn_output": Q.Q5_1,
     "ffn_gate": Q.Q5_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
     "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_1, "ffn_down": Q.Q4_K},
]  # fmt: skip


def _tiny_gguf(tmp_path_factory, layers=LAYERS, make=None, embed=Q.Q8_0, **extra) -> str:
    shape = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=3)
    config = tiny_config(
        tie_word_embeddings=True, max_position_embeddings=256, **{**shape, **extra}
    )  # the LM head on the token table, as SmolLM2's
    path = str(tmp_path_factory.mktemp("fused") / "tiny.gguf")
    kw = {"make": make} if make is not None else {}
    write_tiny_gguf(path, hf_tiny_model(config, seed=5), layer_types=layers, embed_type=embed, **kw)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return _tiny_gguf(tmp_path_factory)  # head_dim 32: the kernels' 16-lane vector loops


@pytest.fixture(scope="module")
def tiny_gguf_d24(tmp_path_factory):
    return _tiny_gguf(tmp_path_factory, head_dim=24)  # not a multiple of 16: the plain loops


@pytest.fixture(scope="module")
def tiny_gguf_mixed(tmp_path_factory):
    """MIXED layers (K-quant rows: random blocks with sane scales) and a Q6_K token table as
    the LM head; K-quants need rows of 256 values."""
    from tests.models.test_gguf_quantized import random_blocks

    return _tiny_gguf(
        tmp_path_factory, layers=MIXED, make=random_blocks, embed=Q.Q6_K, hidden_size=256,
        intermediate_size=256, num_hidden_layers=2, head_dim=64,
    )  # fmt: skip


class Fused:
    """A stand-in for the model in PagedRunner: the fused decode with its LM head; its logits
    against the model's LM head on the same hidden states, its tokens against their argmax."""

    def __init__(self, model, cpu: CpuDecode):
        self.model, self.cpu = model, cpu

    def __call__(self, input_ids, positions):
        hidden, self.logits, tokens = self.cpu.forward(
            input_ids, positions, get_attention_metadata()
        )
        assert torch.equal(tokens, self.logits.argmax(-1))
        assert rel_err(self.logits, self.model.compute_logits(hidden)) < 1e-6  # ~1e-7
        return hidden

    def compute_logits(self, hidden):
        return self.logits


def _decode(
    path: str, fused: bool, steps: int = 6, int8: bool = False, threads: int = 2
) -> list[torch.Tensor]:
    """Prefill PROMPTS layer by layer, then ``steps`` decode steps of all three (fed the
    same tokens whatever comes out); each step's logits [3, V]."""
    torch.set_num_threads(threads)
    model = load_ours(path, quantization="gguf", cpu_int8_activations=int8)
    runner = PagedRunner(model, block_size=4, num_blocks=64, seed=1)
    runner.step([(r, ids, 0) for r, ids in PROMPTS.items()])
    cpu = CpuDecode.build(model, torch.float32)
    assert cpu is not None and cpu.decoder.vocab == model.lm_head.org_vocab_size  # head fused
    if fused:
        runner.model = Fused(model, cpu)
    lens = {r: len(ids) for r, ids in PROMPTS.items()}
    out = []
    for step in range(steps):
        batch = [(r, [(11 * step + 3 * i) % 300], lens[r]) for i, r in enumerate(PROMPTS)]
        out.append(torch.cat(runner.step(batch)))
        lens = {r: n + 1 for r, n in lens.items()}
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_decode_matches_the_layer_by_layer_forward(tiny_gguf, threads):
    """Also with more threads than this machine's 2 cores: a thread the OS pauses has its
    share of a phase's chunks taken by the others."""
    ref = _decode(tiny_gguf, fused=False)
    got = _decode(tiny_gguf, fused=True, threads=threads)
    for want, have in zip(ref, got):
        assert rel_err(have, want) < 5e-6  # ~5e-7: float32 sums in another order
        assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_fused_decode_with_a_head_dim_off_the_vector_width(tiny_gguf_d24):
    ref, got = _decode(tiny_gguf_d24, fused=False), _decode(tiny_gguf_d24, fused=True)
    for want, have in zip(ref, got):
        assert rel_err(have, want) < 5e-6
        assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_fused_decode_runs_k_quant_and_q5_layers(tiny_gguf_mixed):
    """Matrices in runs of rows of different types, K-quant rows (float32 inputs also under
    int8 activations) and a K-quant LM head, in the one call."""
    ref = _decode(tiny_gguf_mixed, fused=False)
    got = _decode(tiny_gguf_mixed, fused=True)
    for want, have in zip(ref, got):
        assert rel_err(have, want) < 5e-6
        assert torch.equal(have.argmax(-1), want.argmax(-1))
    layerwise = _decode(tiny_gguf_mixed, False, int8=True)
    fused = _decode(tiny_gguf_mixed, True, int8=True)
    for want, a, b in zip(ref, layerwise, fused):
        assert 1e-4 < rel_err(a, want) < 4e-2  # the blocks of 32's inputs rounded
        rows = [rel_err(b[i : i + 1], a[i : i + 1]) for i in range(a.shape[0])]
        assert max(rows) < 2e-2 and min(rows) < 1e-5, rows


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen_gguf(request, tmp_path_factory):
    """Qwen2 (q/k/v biases, an untied Q8_0 LM head) and Qwen3 (per-head q/k norms, head_dim
    24, the tied Q8_0 table) on blocks the kernels read."""
    from tests.models.test_gguf_qwen import hf_qwen, write_qwen_gguf

    types = {"attn_q": Q.Q5_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0,
             "ffn_gate": Q.Q5_1, "ffn_up": Q.Q5_1, "ffn_down": Q.Q8_0}  # fmt: skip
    # eps 1e-2: the q/k norms' eps (not the default) is what the call uses
    hf = hf_qwen(request.param, seed=6, max_position_embeddings=256, rms_norm_eps=1e-2)
    path = str(tmp_path_factory.mktemp(request.param) / "tiny.gguf")
    write_qwen_gguf(path, hf, request.param, layer_types=types, output_type=Q.Q8_0)
    return path


def test_fused_decode_runs_qwen_layers(qwen_gguf):
    ref, got = _decode(qwen_gguf, fused=False), _decode(qwen_gguf, fused=True)
    for want, have in zip(ref, got):
        assert rel_err(have, want) < 5e-6
        assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_fused_decode_on_each_instruction_set(tiny_gguf_mixed, gguf_isa_lib, monkeypatch):
    """The mixed-type model through the AVX2 and the portable builds of the kernels."""
    ref = _decode(tiny_gguf_mixed, fused=False, steps=3)
    monkeypatch.setattr(kernels, "_lib", lambda: gguf_isa_lib[1])
    got = _decode(tiny_gguf_mixed, fused=True, steps=3)
    for want, have in zip(ref, got):
        assert rel_err(have, want) < 5e-6
        assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_int8_activations_stay_near_float32(tiny_gguf):
    """Both int8 paths round the same blocks the same way, so their rows agree to float32
    rounding (~5e-7). Their float sums run in different orders (the fused norm's vector width
    follows the CPU), so a value within an ulp of a rounding boundary can round the other way
    in one path; that row then differs by about int8's own error (~1e-2), and a request's cache
    can carry it on (seen on AVX-512 and AMD machines: one request from the first step, another
    at two steps of six). So: every row within int8's error, and each step has rows that agree
    to float32 rounding (a path that rounded differently would differ in every row)."""
    exact = _decode(tiny_gguf, fused=False)
    layerwise, fused = _decode(tiny_gguf, False, int8=True), _decode(tiny_gguf, True, int8=True)
    for want, a, b in zip(exact, layerwise, fused):
        assert 1e-3 < rel_err(a, want) < 4e-2  # rounded (~2e-2 here), and not by much
        rows = [rel_err(b[i : i + 1], a[i : i + 1]) for i in range(a.shape[0])]
        assert max(rows) < 2e-2, rows
        assert min(rows) < 1e-5, rows  # the same rounding


def test_int8_activations_are_each_models_own(tiny_gguf):
    """Two models of one process, int8 activations on in one only: each keeps its setting
    (its linears, its LM head, its fused decode), whatever was loaded after it."""
    torch.set_num_threads(2)
    a = load_ours(tiny_gguf, quantization="gguf", cpu_int8_activations=True)
    b = load_ours(tiny_gguf, quantization="gguf")
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))  # [2, H]
    for model, int8 in ((a, True), (b, False)):
        PagedRunner(model)  # binds the KV caches
        assert CpuDecode.build(model, torch.float32).decoder._model.int8_act == int8
        qkv, head = model.model.layers[0].self_attn.qkv_proj, model.lm_head
        assert head.int8_act is int8
        for out, (qtype, w) in ((qkv(x), qkv.gguf_cpu[0][:2]), (model.compute_logits(x),
                                (head.weight.gguf_type, head.weight))):  # fmt: skip
            want = kernels.gguf_mm_ref(x, w, qtype, int8_act=int8)
            assert rel_err(out, want) < 1e-5  # ~1e-7: its own rounding, not the other's
            assert rel_err(out, kernels.gguf_mm_ref(x, w, qtype, int8_act=not int8)) > 1e-4


def test_applies_to_small_decode_steps_only(tiny_gguf):
    def meta(query_lens, seq_lens):
        tables = [[i] * 4 for i in range(len(query_lens))]
        return build_metadata(query_lens, seq_lens, tables, 4, torch.device("cpu"))[0]

    assert CpuDecode.applies(meta([1], [9]))
    assert CpuDecode.applies(meta([1] * 8, [5] * 8))
    assert not CpuDecode.applies(meta([1] * 9, [5] * 9))  # more rows than the kernel takes
    assert not CpuDecode.applies(meta([1, 3], [4, 6]))  # a prefill chunk in the step
    assert not CpuDecode.applies(meta([2], [6]))


def test_build_declines_what_the_kernel_does_not_run(tiny_gguf, tmp_path):
    model = load_ours(tiny_gguf, quantization="none")  # float32 weights
    PagedRunner(model)
    assert CpuDecode.build(model, torch.float32) is None
    model = load_ours(tiny_gguf, quantization="gguf")
    assert CpuDecode.build(model, torch.float32) is None  # no KV cache bound yet
    PagedRunner(model)
    assert CpuDecode.build(model, torch.float32) is not None
    PagedRunner(model, kv_cache_dtype="int8")
    assert CpuDecode.build(model, torch.float32) is None  # an 8-bit cache


def test_build_declines_layers_it_would_get_wrong(tiny_gguf):
    """An output-projection or MLP bias, a sliding window: the layer-by-layer forward."""
    model = load_ours(tiny_gguf, quantization="gguf")
    PagedRunner(model)
    assert CpuDecode.build(model, torch.float32) is not None
    layer = model.model.layers[1]
    for module, attr, value in (
        (layer.self_attn.o_proj, "bias", torch.nn.Parameter(torch.zeros(128))),
        (layer.mlp.down_proj, "bias", torch.nn.Parameter(torch.zeros(128))),
        (layer.self_attn.attn, "sliding_window", 8),
    ):
        before = getattr(module, attr)
        setattr(module, attr, value)
        assert CpuDecode.build(model, torch.float32) is None, attr
        setattr(module, attr, before)
    assert CpuDecode.build(model, torch.float32) is not None


def test_the_decoder_refuses_values_outside_the_cache(tiny_gguf):
    """Positions, slots, lengths and block ids outside the model and its cache: a clear
    ValueError, never a read or write out of bounds."""
    torch.set_num_threads(1)
    model = load_ours(tiny_gguf, quantization="gguf")
    PagedRunner(model, block_size=4, num_blocks=8, seed=1)  # (allocates the caches)
    dec = CpuDecode.build(model, torch.float32).decoder
    x = torch.zeros(2, 128)
    pos, slots = torch.tensor([3, 9]), torch.tensor([3, 9])
    table, lens = (
        torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
        torch.tensor([4, 10], dtype=torch.int32),
    )
    dec(x, pos, slots, table, lens)  # in range: runs
    cases = [
        ((torch.tensor([3, 256]), slots, table, lens), "positions must lie in"),
        ((pos, torch.tensor([3, 32]), table, lens), "slots must lie in"),
        ((pos, slots, table, torch.tensor([4, 13], dtype=torch.int32)), "seq_lens must lie in"),
        ((pos, slots, torch.tensor([[0, 1, 2], [3, 8, 5]], dtype=torch.int32), lens),
         "block ids must lie in"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            dec(x, *args)


def _generate(path: str, fused: bool) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of PROMPTS through the engine, and the paths its steps took."""
    from lightwell import LLM, SamplingParams

    llm = LLM(
        model=path, skip_tokenizer_init=True, num_threads=2, fused_cpu_decode=fused,
        num_kv_blocks=64,
    )  # fmt: skip
    runner, seen = llm.engine.executor.worker.runner, []
    execute = runner.execute_model

    def traced(sched):
        out = execute(sched)
        seen.append(out.path)
        return out

    runner.execute_model = traced
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS.values()]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], set(seen)


def test_engine_takes_the_fused_path_with_the_same_tokens(tiny_gguf):
    tokens, paths = _generate(tiny_gguf, fused=True)
    want, plain_paths = _generate(tiny_gguf, fused=False)
    assert tokens == want
    assert "fused cpu" in paths and "fused cpu" not in plain_paths
