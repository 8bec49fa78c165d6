"""CUDA-graph padding on the CPU: what a graph replay computes (the forward over the padded
static inputs with the capture-time metadata) equals the eager forward of the real batch, for
decode graphs and for mixed (prefill) graphs. Triton kernels under TRITON_INTERPRET=1, a tiny
random Llama (fp32), through the model runner's own input preparation."""

from __future__ import annotations

import random

import pytest
import torch

from lightwell.attention.metadata import forward_context
from lightwell.dual_stream import DualStream
from lightwell.models.loader import load_model
from lightwell.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from lightwell.types import SamplingParams
from lightwell.worker.cuda_graph import mixed_capture_sizes
from lightwell.worker.model_runner import ModelRunner
from lightwell.worker.runner_startup import profile_run
from tests.models.tiny import randomize, tiny_config

BLOCK = 4


def test_mixed_capture_sizes():
    assert mixed_capture_sizes(0) == []
    assert mixed_capture_sizes(16) == [16]
    assert mixed_capture_sizes(100) == [16, 32, 64, 100]
    assert mixed_capture_sizes(512) == [16, 32, 64, 128, 256, 512]
    # above 512: every 256 tokens (a step pads by less than 256)
    assert mixed_capture_sizes(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert mixed_capture_sizes(2048)[5:] == [512, 768, 1024, 1280, 1536, 1792, 2048]
    assert mixed_capture_sizes(1024)[-3:] == [512, 768, 1024]


def _tiny_runner(
    max_model_len: int,
    prefill_tokens: int,
    seed: int,
    dual_min_tokens: int = 0,
    micro_batches: int = 2,
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    """``dual_min_tokens``: run steps of at least that many tokens as ``micro_batches``
    micro-batches (the dual-stream split, in order on CPU), in the graphs and eagerly."""
    cfg = tiny_config(num_key_value_heads=1)  # GQA 4: query tiles of 32 tokens
    model = load_model(None, cfg, torch.float32, "cpu", load_format="dummy")
    randomize(model, seed=seed)
    r = ModelRunner(model, block_size=BLOCK, vocab_size=cfg.vocab_size, device=torch.device("cpu"),
                    dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    r.set_attention_backend("triton")
    r.init_kv_cache(96)
    if dual_min_tokens:
        r.overlap = DualStream(model, dual_min_tokens, None, micro_batches)
    r.capture_cuda_graphs(
        max_batch=6, max_model_len=max_model_len, prefill_tokens=prefill_tokens, capture=False
    )
    return r


@pytest.fixture(scope="module", params=["plain", "two-batch", "three-batch"])
def runner(request):
    """plain; two-batch: steps of 32 tokens or more as two micro-batches (in the 64- and
    128-token graphs: split at the graph's middle token whatever the layout; eagerly: at the
    step's middle token); three-batch: the same in three (cuts at a third and two thirds,
    a request cut twice where it spans both)."""
    dual = 0 if request.param == "plain" else 32
    parts = 3 if request.param == "three-batch" else 2
    return _tiny_runner(max_model_len=128, prefill_tokens=128, seed=3, dual_min_tokens=dual,
                        micro_batches=parts)  # fmt: skip


class Blocks:
    """Scattered block ids, so block-table indexing errors show."""

    def __init__(self) -> None:
        self.free = list(range(1, 96))  # block 0: what padding rows read
        random.Random(5).shuffle(self.free)
        self.owned: dict[str, list[int]] = {}

    def grow(self, req: str, tokens: int) -> list[int]:
        have = self.owned.setdefault(req, [])
        new = [self.free.pop() for _ in range(-(-tokens // BLOCK) - len(have))]
        have.extend(new)
        return new


def _check_step(runner: ModelRunner, sched: SchedulerOutput, kind: str) -> None:
    runner.batch.apply(sched)
    inp = runner.batch.prepare(sched)
    assert runner.graphs.can_run(inp.meta)
    eager = runner.forward(inp.input_ids, inp.positions, inp.meta).clone()
    if runner.overlap is not None:  # both equal the forward of one batch
        with forward_context(inp.meta):
            whole = runner.model(inp.input_ids, inp.positions)
        torch.testing.assert_close(eager, whole, rtol=1e-5, atol=1e-5)
    padded = runner.graphs.run(inp.input_ids, inp.positions, inp.meta)
    assert padded.shape == eager.shape
    assert padded.abs().max() > 0.1  # real activations, not zeros
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    size = (
        next(s for s in runner.graphs.sizes if s >= inp.meta.num_reqs)
        if kind == "decode"
        else next(s for s in runner.graphs.mixed_sizes if s >= inp.meta.num_tokens)
    )
    assert runner.graphs.outputs[(kind, size)].shape[0] == size


def test_padded_replays_equal_eager_forward(runner):
    rng = random.Random(0)
    blocks = Blocks()
    sp = SamplingParams(max_tokens=50)
    toks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}

    def new(req: str, length: int, chunk: int | None = None) -> NewRequestData:
        toks[req] = [rng.randrange(300) for _ in range(length)]
        n = chunk or length
        computed[req] = n
        return NewRequestData(req, toks[req], length, sp, blocks.grow(req, n), 0)

    def cont(req: str, n: int = 1) -> CachedRequestData:
        fed = []
        if computed[req] >= len(toks[req]):  # decoding: feed a "sampled" token
            fed = [rng.randrange(300)]
            toks[req] += fed
        data = CachedRequestData(req, fed, blocks.grow(req, computed[req] + n), computed[req])
        computed[req] += n
        return data

    def step(new_reqs, cached, counts, kind):
        sched = SchedulerOutput(new_reqs, cached, counts, sum(counts.values()))
        _check_step(runner, sched, kind)

    # two prompts, 16 tokens: the 16-token graph (one query tile per request)
    step([new("a", 5), new("b", 11)], [], {"a": 5, "b": 11}, "mixed")
    # decodes of a and b beside a 20-token prompt: 22 tokens -> the 32-token graph
    step([new("c", 20)], [cont("a"), cont("b")], {"a": 1, "b": 1, "c": 20}, "mixed")
    # decode-only batch of 3 -> the decode graph of 4
    step([], [cont("a"), cont("b"), cont("c")], {"a": 1, "b": 1, "c": 1}, "decode")
    # a long prompt's first chunk exactly fills the 64-token graph (no padding tokens)
    step([new("d", 90, chunk=61)], [cont(r) for r in "abc"],
         {"a": 1, "b": 1, "c": 1, "d": 61}, "mixed")  # fmt: skip
    # its second chunk (attending to the cached first one) with decodes: 33 -> 64
    step([], [cont("a"), cont("d", 29), cont("c")], {"a": 1, "d": 29, "c": 1}, "mixed")
    # several query tiles per request: 100 tokens of a new prompt + decodes -> 128
    step([new("e", 100)], [cont(r) for r in "abcd"],
         {"a": 1, "b": 1, "c": 1, "d": 1, "e": 100}, "mixed")  # fmt: skip
    # after the mixed graphs: decode graphs still see their own layout (6 = max batch)
    step([new("f", 1)], [cont(r) for r in "abcde"],
         {**{r: 1 for r in "abcde"}, "f": 1}, "decode")  # fmt: skip


def test_padding_longer_than_the_context():
    """Graphs of more tokens than the context length: the padding request's keys (P - T of
    them) still fit its block-table row (a short max_model_len beside 64-token graphs)."""
    r = _tiny_runner(max_model_len=8, prefill_tokens=64, seed=4)
    assert r.graphs.block_table.shape[1] == 64 // BLOCK
    rng, blocks = random.Random(1), Blocks()
    sp = SamplingParams(max_tokens=2)
    new = [
        NewRequestData(
            f"r{i}", [rng.randrange(300) for _ in range(6)], 6, sp, blocks.grow(f"r{i}", 6), 0
        )  # fmt: skip
        for i in range(6)
    ]
    # 36 tokens of 6 requests -> the 64-token graph: the padding request (the last row) has 28
    _check_step(r, SchedulerOutput(new, [], {f"r{i}": 6 for i in range(6)}, 36), "mixed")


def test_steps_beyond_the_graphs_run_eagerly(runner):
    from tests.models.paged import build_metadata

    meta, _ = build_metadata([129], [129], [list(range(1, 34))], BLOCK, torch.device("cpu"))
    assert not runner.graphs.can_run(meta)  # more tokens than the largest mixed graph
    meta, _ = build_metadata([1] * 7, [3] * 7, [[1]] * 7, BLOCK, torch.device("cpu"))
    assert not runner.graphs.can_run(meta)  # more decodes than the largest decode graph


def test_few_long_decodes_beside_a_chunk_run_eagerly(runner, monkeypatch):
    """Decode rows that the eager path would give split-KV (few rows, long contexts: decided
    by auto_num_splits, which answers 1 on CPU, so it is stubbed here) skip the mixed graphs."""
    import lightwell.kernels.split_kv as split_kv
    from lightwell.worker import cuda_graph
    from tests.models.paged import build_metadata

    calls = []

    def splits(programs, keys, device):
        calls.append((programs, keys))
        return 4 if keys >= 100 else 1

    monkeypatch.setattr(split_kv, "auto_num_splits", splits)
    cpu = torch.device("cpu")
    long_ctx, _ = build_metadata([1, 20], [120, 20], [list(range(1, 31)), [31, 32, 33, 34, 35]],
                                 BLOCK, cpu)  # fmt: skip
    assert not runner.graphs.can_run(long_ctx)
    assert calls == [(1 * runner.graphs.num_kv_heads, 120)]  # 1 decode row x KV heads
    short_ctx, _ = build_metadata([1, 20], [30, 20], [list(range(1, 9)), [31, 32, 33, 34, 35]],
                                  BLOCK, cpu)  # fmt: skip
    assert runner.graphs.can_run(short_ctx)
    prefill_only, _ = build_metadata([20], [120], [list(range(1, 31))], BLOCK, cpu)
    assert runner.graphs.can_run(prefill_only)  # no decode rows: nothing to split
    # with enough prefill tokens beside them, the graph runs the long decode rows unsplit
    monkeypatch.setattr(cuda_graph, "SPLIT_KV_EAGER_MAX_PREFILL", 20)
    assert runner.graphs.can_run(long_ctx)  # 20 prefill tokens
    monkeypatch.setattr(cuda_graph, "SPLIT_KV_EAGER_MAX_PREFILL", 21)
    assert not runner.graphs.can_run(long_ctx)


def test_profile_run_wraps_positions_at_the_model_length():
    """The memory-profiling forward takes the step budget's tokens (8,192 on a GPU), which can
    exceed the model's positions (2,048 on SmolLM2): its positions must stay inside RoPE's
    table. On the GPU the overrun was silent (an illegal address in a later engine); on the CPU
    the table lookup raises, which this test would show."""
    cfg = tiny_config()
    model = load_model(None, cfg, torch.float32, "cpu", load_format="dummy")
    r = ModelRunner(model, block_size=BLOCK, vocab_size=cfg.vocab_size, device=torch.device("cpu"),
                    dtype=torch.float32)  # fmt: skip
    r.set_attention_backend("torch")
    steps = cfg.max_position_embeddings + 40
    with pytest.raises(IndexError):  # the unwrapped positions overrun the table
        model.model.layers[0].self_attn.rotary_emb._cos_sin(torch.arange(steps))
    profile_run(r, steps, cfg.max_position_embeddings)


def test_padded_replays_on_an_fp8_cache():
    """The graphs' padding (slot -1 rows not stored, padding requests reading block 0) on an
    8-bit cache: a mixed and a decode replay equal the eager forward."""
    r = _tiny_runner(max_model_len=32, prefill_tokens=16, seed=6, kv_cache_dtype="fp8")
    assert r.kv_caches[0].dtype == torch.float8_e4m3fn
    rng, blocks = random.Random(2), Blocks()
    sp = SamplingParams(max_tokens=4)
    new = [
        NewRequestData(
            f"r{i}", [rng.randrange(300) for _ in range(5)], 5, sp, blocks.grow(f"r{i}", 5), 0
        )  # fmt: skip
        for i in range(3)
    ]
    _check_step(r, SchedulerOutput(new, [], {f"r{i}": 5 for i in range(3)}, 15), "mixed")
    cont = [
        CachedRequestData(f"r{i}", [rng.randrange(300)], blocks.grow(f"r{i}", 6), 5)
        for i in range(3)
    ]
    _check_step(r, SchedulerOutput([], cont, {f"r{i}": 1 for i in range(3)}, 3), "decode")


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_replays_take_tokens_still_being_sampled(kind):
    """Async scheduling: a step's input tokens that the previous step is still sampling come
    from that step's sampled tokens on the device (``token_src``), in decode and mixed graphs:
    the replay equals the eager forward of the same tokens known on the host."""
    r = _tiny_runner(max_model_len=32, prefill_tokens=16, seed=7)
    rng, blocks = random.Random(3), Blocks()
    sp = SamplingParams(max_tokens=4)
    prompts = {f"r{i}": [rng.randrange(300) for _ in range(5)] for i in range(3)}
    new = [NewRequestData(q, p, 5, sp, blocks.grow(q, 5), 0) for q, p in prompts.items()]
    _check_step(r, SchedulerOutput(new, [], {q: 5 for q in prompts}, 15), "mixed")
    sampled = torch.tensor([211, 17, 96])  # the previous step's rows: r2, r0, r1
    rows = ["r2", "r0", "r1"]
    cont = [CachedRequestData(q, [], blocks.grow(q, 6), 5) for q in prompts]  # tokens unknown
    counts = {q: 1 for q in prompts}
    later = []
    if kind == "mixed":  # beside a new prompt: the 16-token graph
        later = [NewRequestData("r3", [5, 6, 7], 3, sp, blocks.grow("r3", 3), 0)]
        counts["r3"] = 3
    sched = SchedulerOutput(later, cont, counts, sum(counts.values()))
    r.batch.apply(sched)
    inp = r.batch.prepare(sched, rows)
    assert inp.token_src.tolist()[:3] == [1, 2, 0]
    assert r.graphs.graph_for(inp.meta)[0] == kind
    known = inp.input_ids.clone()
    known[:3] = torch.tensor([17, 96, 211])
    eager = r.forward(known, inp.positions, inp.meta).clone()
    replay = r.graphs.run(inp.input_ids, inp.positions, inp.meta, deferred=(inp.token_src, sampled))
    torch.testing.assert_close(replay, eager, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="sampled no token for"):
        r.batch.prepare(sched, ["r0"])
