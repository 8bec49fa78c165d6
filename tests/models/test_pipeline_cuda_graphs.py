"""CUDA graphs per pipeline stage. On CPU: two stage processes (gloo) run greedy steps through
the graph runner's padded static buffers (the graphs' computation, run eagerly: Triton under
TRITON_INTERPRET=1), the second stage's graphs reading the received (hidden, residual) from
their static buffer and the first's returning theirs; the tokens equal one rank's eager ones
(torch attention) and both stages pick the same graph for every step. On a GPU (``-m gpu``):
PP=2 with both stages on one GPU (--stages-share-gpu) replays captured graphs and gives
PP=1's greedy tokens and graph choices on SmolLM2."""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import socket
import time

import pytest
import torch

from lightwell.config import EngineConfig
from lightwell.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from lightwell.types import SamplingParams
from tests.models.tiny import hf_tiny_model, save_hf, tiny_config

# prompts a, b, c in the first step (25 tokens), d beside their second decodes (6 + 3)
PROMPTS = {"a": list(range(3, 14)), "b": list(range(40, 45)), "c": [7, 8, 9] * 3}
LATE = ("d", [60, 61, 62, 63, 64, 65])
DECODES = 2
# a step's graph: mixed 32 (25 tokens), decode 4 (3 rows), mixed 16 (9 tokens), decode 4 ...
PATHS = ["graph mixed 32", "graph decode 4", "graph mixed 16"] + ["graph decode 4"] * DECODES
OPTS = dict(device="cpu", num_threads=1, num_kv_blocks=16)


class _Steps:
    """Hand-built SchedulerOutputs for greedy decoding (two 16-token blocks a request)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}  # req_id -> output tokens
        self.computed: dict[str, int] = {}
        self.blocks = 0

    def new(self, req: str, prompt: list[int]) -> NewRequestData:
        self.tokens[req], self.computed[req] = [], len(prompt)
        self.blocks += 2
        sp = SamplingParams(temperature=0.0, max_tokens=32)
        return NewRequestData(req, prompt, len(prompt), sp, [self.blocks - 1, self.blocks], 0)

    def cached(self, req: str) -> CachedRequestData:
        data = CachedRequestData(req, [self.tokens[req][-1]], [], self.computed[req])
        self.computed[req] += 1
        return data

    def plan(self):
        """The steps, each built once the previous one's tokens are known."""
        yield [self.new(r, p) for r, p in PROMPTS.items()], []
        yield [], [self.cached(r) for r in PROMPTS]
        yield [self.new(*LATE)], [self.cached(r) for r in PROMPTS]
        for _ in range(DECODES):
            yield [], [self.cached(r) for r in self.tokens]


def _generate(runner, share) -> tuple[dict[str, list[int]], list[str]]:
    """Greedy tokens per request and each step's path; ``share(out)``: the step's sampled
    tokens on every rank (the last stage's)."""
    steps, paths = _Steps(), []
    for new, cached in steps.plan():  # the batch: running requests first, then new ones
        counts = {c.req_id: 1 for c in cached} | {r.req_id: len(r.token_ids) for r in new}
        out = runner.execute_model(SchedulerOutput(new, cached, counts, sum(counts.values())))
        paths.append(out.path)
        for req, toks in share(out).items():
            steps.tokens[req] += toks
    return steps.tokens, paths


def _runner(folder: str, rank: int = 0, init_method: str | None = None, **opts):
    from lightwell.worker.worker import Worker

    worker = Worker(EngineConfig.from_kwargs(model=folder, **OPTS, **opts), rank, init_method)
    worker.load_model()
    worker.runner.init_kv_cache(OPTS["num_kv_blocks"])
    return worker


def _stage_main(rank: int, folder: str, init_method: str, results) -> None:
    import torch.distributed as dist

    # Triton attention: graphs read the device metadata only (the torch backend reads the host
    # copies, which a replay does not update)
    worker = _runner(
        folder, rank, init_method, pipeline_parallel_size=2, attention_backend="triton"
    )
    runner = worker.runner
    runner.capture_cuda_graphs(max_batch=4, max_model_len=64, prefill_tokens=32, capture=False)

    def share(out):
        box = [out.sampled_token_ids]
        dist.broadcast_object_list(box, src=1)
        return box[0]

    with torch.inference_mode():
        tokens, paths = _generate(runner, share)
    results.put((rank, tokens, paths, runner.graphs.replays))
    worker.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(results, procs: list, timeout: float = 240.0) -> dict[int, list]:
    """Each stage's result; a stage process that fails fails the test at once."""
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            rank, *rest = results.get(timeout=1.0)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a stage process exited with {failed}"
            assert time.monotonic() < deadline, "the stages did not finish in time"
            continue
        got[rank] = rest
    return got


def test_pp2_graph_path_gives_one_ranks_tokens(tmp_path):
    folder = save_hf(hf_tiny_model(tiny_config(), seed=4), str(tmp_path / "llama"))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_stage_main, args=(r, folder, init, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        with torch.inference_mode():  # one rank, eagerly (torch attention: the reference)
            ref = _runner(folder, attention_backend="torch").runner
            expected, eager = _generate(ref, lambda out: out.sampled_token_ids)
        got = _collect(results, procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert set(eager) == {"eager"}
    for rank in (0, 1):
        tokens, paths, replays = got[rank]
        assert tokens == expected, rank
        assert paths == PATHS, rank  # the same graph on both stages, every step
        assert replays == len(PATHS)
    assert [len(t) for t in expected.values()] == [3 + DECODES] * 3 + [1 + DECODES]


def test_stages_share_gpu_needs_pipeline_stages_alone():
    EngineConfig.from_kwargs(pipeline_parallel_size=2, stages_share_gpu=True)
    for opts in ({}, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="stages_share_gpu needs pipeline_parallel_size > 1"):
            EngineConfig.from_kwargs(stages_share_gpu=True, **opts)
    with pytest.raises(ValueError, match="stages_share_gpu needs nnodes 1"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, stages_share_gpu=True, nnodes=2,
                                 dist_init_addr="127.0.0.1:5000")  # fmt: skip


def _gpu_run(model: str, trace, **opts) -> tuple[list[list[int]], list[str]]:
    """Greedy tokens of four prompts (chunked prefill beside decodes, then decode steps of 4)
    and each step's path from the step trace; rank 0's graphs were captured and replayed."""
    from lightwell import LLM

    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 100 + 7 * i + n))}
               for i, n in enumerate((5, 17, 30, 41))]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    llm = LLM(model, step_trace=str(trace), max_num_seqs=8, max_num_batched_tokens=64,
              skip_tokenizer_init=True, dtype="float32",
              cuda_graph_prefill_tokens=64, kv_cache_memory_gb=1.0, async_scheduling=False,
              **opts)  # fmt: skip
    try:
        staged = opts.get("pipeline_parallel_size", 1) > 1
        before = llm.engine.executor.stage_times() if staged else []
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        graphs = llm.engine.executor.worker.runner.graphs  # rank 0: the first stage's
        assert graphs is not None and len(graphs.graphs) == 7  # decode 1-8, mixed 16-64
        assert graphs.replays > 0
        if staged:  # every stage timed this run's steps on the GPU (the counters start with
            # the engine's warm-up steps)
            for a, b in zip(llm.engine.executor.stage_times(), before):
                busy = a["gpu_busy_s"] - b["gpu_busy_s"]
                assert a["steps"] > b["steps"] and 0 < busy < wall, (a, b, wall)
    finally:
        llm.shutdown()
    paths = [json.loads(line)["path"] for line in trace.read_text().splitlines()]
    return [o.outputs[0].token_ids for o in outs], paths


def _save_random_llama(folder) -> str:
    """A random 4-layer HF Llama (weights ~ N(0, 0.08): greedy tokens well apart), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                      max_position_embeddings=512)  # fmt: skip
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.normal_(0, 0.08)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.mark.gpu
def test_pp2_cuda_graphs_on_one_gpu_equal_pp1(tmp_path):
    model = _save_random_llama(tmp_path / "model")  # the GPU machine has no GGUF
    ref, ref_paths = _gpu_run(model, tmp_path / "pp1.jsonl")
    pp2 = dict(pipeline_parallel_size=2, stages_share_gpu=True)
    # one batch in flight: PP=1's batches, so the same graphs and bit-equal activations
    tokens, paths = _gpu_run(model, tmp_path / "pp2.jsonl", pipeline_in_flight=1, **pp2)
    assert tokens == ref
    assert paths == ref_paths  # the last stage replayed the graphs PP=1 did
    assert "graph decode 4" in paths and any(p.startswith("graph mixed") for p in paths)
    # two in flight (the default): stage 0 replays a batch while stage 1 runs the one before;
    # other batches (other padded sizes, other bf16 roundings) may move a near tie
    tokens, paths = _gpu_run(model, tmp_path / "pp2x2.jsonl", **pp2)
    assert [len(t) for t in tokens] == [24] * 4
    assert sum(t == r for t, r in zip(tokens, ref)) >= 3, (tokens, ref)
    assert any(p.startswith("graph decode") for p in paths)
