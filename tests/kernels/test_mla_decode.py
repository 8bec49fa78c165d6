"""The MLA decode kernel (split-KV over the paged latent cache) vs its torch reference: on CPU
under TRITON_INTERPRET=1, compiled on CUDA. Entry width not a power of two (32 + 8), heads fewer
than a tile, scattered blocks, uneven lengths, 1 and 3 splits (one split past a short request's
end; 8 splits of 16-key tiles), a poisoned cache outside the requests' blocks."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.mla_decode import mla_decode, mla_decode_ref
from tests.kernels.interpreter import DEVICE

# (these build the model on the CPU and force the kernel path: the Triton interpreter's)
CPU_MODEL = pytest.mark.skipif(DEVICE == "cuda", reason="a CPU model through the interpreter")
TOL = {torch.float32: 1e-4 if DEVICE == "cpu" else 2e-2, torch.float16: 3e-3}


def _requests(dtype, seed, lengths, rank=32, rope=8, heads=3):
    """(q, cache, block table, seq_lens) on DEVICE: scattered 4-token blocks, NaN outside
    the requests' blocks."""
    gen = torch.Generator().manual_seed(seed)
    block, num_blocks = 4, 24
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    cache = torch.full((1, num_blocks, block, 1, rank + rope), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for length in seq_lens.tolist():
        n = -(-length // block)
        tables.append(perm[used : used + n].tolist() + [0] * (10 - n))
        for b in perm[used : used + n].tolist():
            cache[0, b] = torch.randn(block, 1, rank + rope, generator=gen)
        used += n
    q = torch.randn(len(lengths), heads, rank + rope, generator=gen)
    table = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    return q.to(dtype).to(DEVICE), cache.to(dtype).to(DEVICE), table, seq_lens.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_mla_decode_matches_reference(dtype, splits):
    rank, heads = 32, 3
    args = _requests(dtype, splits, [5, 37, 1])
    # eight splits with 16-key tiles: the 37-key request spreads over three of them
    config = (16, 16, 4, 1) if splits == 8 else None
    got = mla_decode(*args, 0.2, rank, num_splits=splits, config=config)
    want = mla_decode_ref(*args, 0.2, rank)
    assert got.shape == (3, heads, rank) and not got.isnan().any()
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits", [3, 8])
def test_output_kernel_combines_the_decode_splits(dtype, splits):
    """One request's uncombined splits (``mla_decode_split``) through the output kernel's
    combining variant give W_UV applied to the reference attention, as the combine kernel then
    the output kernel do; empty splits (five of eight here) are not read (their partials are
    NaN)."""
    from lightwell.kernels.mla_decode import mla_decode_split
    from lightwell.kernels.mla_output import absorb_output

    rank, heads, nope, vdim = 32, 3, 16, 24
    args = _requests(dtype, 10 + splits, [37])
    w = torch.randn(heads * (nope + vdim), rank, generator=torch.Generator().manual_seed(1)) / 4
    w = w.to(DEVICE, dtype)
    config = (16, 16, 4, 1)  # 16-key tiles: the 37 keys over the first three splits
    part, lse = mla_decode_split(*args, 0.2, rank, splits, config=config)
    assert part.shape == (1, splits, heads, rank) and lse.shape == (1, splits, heads)
    assert (lse[:, :3] > float("-inf")).all() and (lse[:, 3:] == float("-inf")).all()
    part[:, 3:] = float("nan")
    got = absorb_output(part, w, (nope, vdim), lse)
    w_uv = w.view(heads, nope + vdim, rank)[:, nope:].float()
    want = torch.einsum("thr,hvr->thv", mla_decode_ref(*args, 0.2, rank).float(), w_uv)
    two_launches = absorb_output(mla_decode(*args, 0.2, rank, splits, config=config), w,
                                 (nope, vdim))  # fmt: skip
    assert got.shape == (1, heads * vdim) and got.dtype == dtype and not got.isnan().any()
    assert _rel(got, want.reshape(1, -1)) < TOL[dtype]
    assert _rel(got, two_launches) < TOL[dtype]
    with pytest.raises(ValueError, match="partials"):  # more tokens than the few-token kernel
        absorb_output(part.expand(2, -1, -1, -1).contiguous(), w, (nope, vdim),
                      lse.expand(2, -1, -1).contiguous())  # fmt: skip


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@CPU_MODEL
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_deepseek_decodes_through_the_kernel_match_the_torch_path(tmp_path, monkeypatch, kv):
    """A tiny DeepSeek-V3 with its decodes through the kernel (mixed with a prefill chunk in
    the same steps, then decode-only steps through the fused path) gives the torch path's
    logits; three key splits (all but one empty at these lengths), combined by the combine
    kernel, or at one request by the output kernel. An fp8 cache: both paths store the same
    bytes and read them back, the kernels through their own scale handling."""
    import lightwell.kernels.mla_decode as mla_decode_module
    from lightwell.layers.mla import LatentAttention

    monkeypatch.setattr(mla_decode_module, "pick_num_splits", lambda *args: 3)
    from tests.models.families import deepseek_v3
    from tests.models.paged import PagedRunner
    from tests.models.tiny import load_ours, rel_err

    torch.set_num_threads(1)
    deepseek_v3(str(tmp_path), 2)
    logits = {}
    for kernel in (False, True):
        model = load_ours(str(tmp_path))
        for layer in model.modules():
            if isinstance(layer, LatentAttention):
                layer.decode_kernel = kernel
        runner = PagedRunner(model, block_size=4, num_blocks=32, seed=1, kv_cache_dtype=kv)
        prompts = [list(range(3, 12)), list(range(20, 26))]
        out = runner.step([(f"r{i}", p, 0) for i, p in enumerate(prompts)])
        steps, late = [], list(range(40, 50))
        for n in range(4):  # two decodes, then a chunk of a third request
            batch = [
                (f"r{i}", [int(o[-1].argmax())], len(p) + n)
                for i, (o, p) in enumerate(zip(out, prompts))
            ]
            batch.append(("late", late[3 * n : 3 * n + 3], 3 * n))
            got = runner.step(batch)
            out = [torch.cat([o, g]) for o, g in zip(out, got[:2])]
            steps.append(torch.cat(got))
        for n in range(4, 6):  # decode-only steps: the fused path (kernels/mla_prepare.py)
            batch = [
                (f"r{i}", [int(o[-1].argmax())], len(p) + n)
                for i, (o, p) in enumerate(zip(out, prompts))
            ]
            got = runner.step(batch)
            out = [torch.cat([o, g]) for o, g in zip(out, got)]
            steps.append(torch.cat(got))
        for n in range(6, 8):  # one request alone: the output kernel combines the splits
            got = runner.step([("r0", [int(out[0][-1].argmax())], len(prompts[0]) + n)])
            out[0] = torch.cat([out[0], got[0]])
            steps.append(got[0])
        logits[kernel] = torch.cat(steps)
    assert rel_err(logits[True], logits[False]) < (1e-4 if kv == "auto" else 2e-3)


def test_store_latent_skips_padding_slots():
    from lightwell.kernels.mla_decode import store_latent, store_latent_ref

    gen = torch.Generator().manual_seed(4)
    entry = torch.randn(5, 40, generator=gen).to(DEVICE)
    cache = torch.randn(1, 6, 4, 1, 40, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 0, -1], device=DEVICE)
    want = cache.clone()
    store_latent_ref(entry, want, slots)
    store_latent(entry, cache, slots)
    assert torch.equal(cache, want) and torch.equal(cache.view(-1, 40)[17], entry[2])


@CPU_MODEL
def test_deepseek_decode_graph_padding_equals_eager(tmp_path):
    """What a decode graph's replay computes for a tiny DeepSeek-V3 (the forward over the padded
    static inputs with the capture-time metadata: 3 requests padded to 4, padding slots -1)
    equals the eager forward; no graphs for steps with prefill tokens."""
    from lightwell.layers.mla import LatentAttention
    from lightwell.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
    from lightwell.types import SamplingParams
    from lightwell.worker.model_runner import ModelRunner
    from tests.models.families import deepseek_v3
    from tests.models.tiny import load_ours

    torch.set_num_threads(1)
    deepseek_v3(str(tmp_path), 5)
    model = load_ours(str(tmp_path))
    for layer in model.modules():
        if isinstance(layer, LatentAttention):
            layer.decode_kernel = True
    runner = ModelRunner(model, block_size=4, vocab_size=300, device=torch.device("cpu"),
                         dtype=torch.float32)  # fmt: skip
    runner.init_kv_cache(32)
    runner.capture_cuda_graphs(max_batch=4, max_model_len=64, prefill_tokens=0, capture=False)
    sp = SamplingParams(max_tokens=8)
    prompts = {"a": list(range(3, 10)), "b": list(range(40, 45)), "c": list(range(60, 73))}
    blocks = {"a": [5, 9], "b": [3, 11], "c": [20, 2, 7, 14]}
    new = [NewRequestData(r, p, len(p), sp, blocks[r], 0) for r, p in prompts.items()]
    sched = SchedulerOutput(new, [], {r: len(p) for r, p in prompts.items()}, 25)
    runner.batch.apply(sched)
    inp = runner.batch.prepare(sched)
    assert not runner.graphs.can_run(inp.meta)  # prefill: eager
    runner.forward(inp.input_ids, inp.positions, inp.meta)
    cached = [CachedRequestData(r, [7], [], len(p)) for r, p in prompts.items()]
    sched = SchedulerOutput([], cached, {r: 1 for r in prompts}, 3)
    runner.batch.apply(sched)
    inp = runner.batch.prepare(sched)
    assert runner.graphs.can_run(inp.meta)
    eager = runner.forward(inp.input_ids, inp.positions, inp.meta).clone()
    padded = runner.graphs.run(inp.input_ids, inp.positions, inp.meta)
    assert padded.abs().max() > 0.1
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert runner.graphs.outputs[("decode", 4)].shape[0] == 4


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, "fp16x1e4", "bf16x1e5"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the inf head
def test_mla_decode_over_an_8bit_cache(kv_dtype, splits, q_dtype):
    """An 8-bit latent cache (one scale an entry, quant/kv_cache.py's layout) written by
    ``store_latent`` bit for bit as ``write_rows``; the decode kernel over it equals the
    reference over its dequantized copy, and stays near the unquantized attention. 16-bit
    queries take fp16 dots, a head's query past 16,384 (bf16's past fp16's range: 4e5) scaled
    down by a power of two for them; one head's inf leaves the other heads' outputs as they were."""
    from lightwell.kernels.mla_decode import store_latent
    from lightwell.quant.kv_cache import dequantize_blocks, write_rows

    rank = 32
    q, cache, table, lens = _requests(torch.float32, 20 + splits, [5, 37, 1])
    factor = {torch.float32: 1.0, torch.float16: 1.0, "fp16x1e4": 1e4, "bf16x1e5": 1e5}[q_dtype]
    dtype = torch.bfloat16 if q_dtype == "bf16x1e5" else torch.float16
    if q_dtype != torch.float32:
        q = (q * factor).to(dtype)
    scale = 0.2 / factor
    # the requests' entries, stored again into an 8-bit cache through the kernel's store
    four = torch.arange(4, device=DEVICE)
    slots = torch.cat([table[r, : -(-int(n) // 4)].long()[:, None] * 4 + four
                       for r, n in enumerate(lens.tolist())]).flatten()  # fmt: skip
    entries = cache.view(-1, cache.shape[-1])[slots]  # [S, 40]
    q8 = torch.zeros((1, 24, 4, 1, 44), dtype=kv_dtype, device=DEVICE)
    store_latent(entries, q8, slots)
    want8 = torch.zeros_like(q8)
    write_rows(want8[0], entries[:, None, :].cpu().to(DEVICE), slots)
    assert torch.equal(q8.view(torch.uint8), want8.view(torch.uint8))
    got = mla_decode(q, q8, table, lens, scale, rank, num_splits=splits)
    deq = dequantize_blocks(q8[0], torch.float32)[None]  # [1, N, B, 1, 40]
    qf = q.float()
    want = mla_decode_ref(qf, deq, table, lens, scale, rank)
    assert not got.isnan().any()
    assert _rel(got, want) < {torch.float32: TOL[torch.float32], torch.float16: 3e-3}.get(
        q.dtype, 8e-3
    )
    exact = mla_decode_ref(qf, cache, table, lens, scale, rank)
    assert _rel(got, exact) < (0.08 if kv_dtype == torch.float8_e4m3fn else 0.03)
    if q.dtype != torch.float32:  # a bad head spoils its own output only
        bad = q.clone()
        bad[1, 0, 0] = float("inf")
        out = mla_decode(bad, q8, table, lens, scale, rank, num_splits=splits)
        assert torch.equal(out[1, 1:], got[1, 1:]) and torch.equal(out[[0, 2]], got[[0, 2]])


@CPU_MODEL
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_decode_with_the_norms_in_the_gemvs(tmp_path, monkeypatch, family):
    """One request decoding (the step a GPU runs at batch 1): each layer's input norm inside
    the first projection's GEMV, a MoE layer's post-attention norm inside the router's
    (``DeferredNorm``); here allowed on the CPU's fp32 rows (on a GPU: 16-bit rows) to run
    through the interpreter. Logits equal the separate norms', and the fused GEMV did run for
    each of those norms."""
    import lightwell.kernels.gemv as gemv_module
    import tests.models.families as families
    from lightwell.layers.mla import LatentAttention
    from lightwell.layers.norm import DeferredNorm, RMSNorm
    from lightwell.models.moe_blocks import MoEBlock
    from tests.models.paged import PagedRunner
    from tests.models.tiny import load_ours, rel_err

    torch.set_num_threads(1)
    norm = RMSNorm(8).half()
    assert not DeferredNorm.defers(norm, torch.zeros(1, 8, dtype=torch.float16), None)  # CPU
    getattr(families, family)(str(tmp_path), 3)
    calls = []
    fused = gemv_module.gemv_add_norm
    monkeypatch.setattr(
        gemv_module, "gemv_add_norm", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    logits = {}
    for defer in (False, True):
        rule = lambda norm, hidden, residual, on=defer: (  # noqa: E731
            on and type(norm) is RMSNorm and hidden.shape[0] == 1
        )
        monkeypatch.setattr(DeferredNorm, "defers", staticmethod(rule))
        model = load_ours(str(tmp_path))
        for layer in model.modules():
            if isinstance(layer, LatentAttention):
                layer.decode_kernel = True
        runner = PagedRunner(model, block_size=4, num_blocks=16, seed=1)
        prompt = list(range(3, 12))
        out = runner.step([("r", prompt, 0)])[0]
        steps = []
        for n in range(3):
            got = runner.step([("r", [int(out[-1].argmax())], len(prompt) + n)])[0]
            out = torch.cat([out, got])
            steps.append(got)
        logits[defer] = torch.cat(steps)
    layers = model.model.layers
    moe = sum(isinstance(layer.mlp, MoEBlock) for layer in layers)
    assert 0 < moe < len(layers)  # (layer 0 is dense: its gate/up GEMV takes no norm)
    assert len(calls) == 3 * (len(layers) + moe)  # three decode steps
    assert rel_err(logits[True], logits[False]) < 1e-5
