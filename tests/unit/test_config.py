from __future__ import annotations

import pytest

from lightwell.config import EngineConfig, resolve_config


def test_from_kwargs_routes_flat_names():
    cfg = EngineConfig.from_kwargs(dtype="float32", max_num_seqs=8, block_size=32)
    assert cfg.model.dtype == "float32"
    assert cfg.scheduler.max_num_seqs == 8
    assert cfg.cache.block_size == 32


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="max_num_seq\\b.*Known options"):
        EngineConfig.from_kwargs(max_num_seq=8)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"dtype": "float64"}, "float64"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"grammar_fill_threads": 0}, "grammar_fill_threads must be >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_invalid_values_rejected(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        EngineConfig.from_kwargs(**kwargs)


def test_resolve_fills_device_defaults_and_caps_by_kv_capacity():
    cfg = EngineConfig.from_kwargs()
    cpu = resolve_config(cfg, on_gpu=False, model_max_len=8192, kv_capacity_tokens=4096)
    assert cpu.device.device == "cpu"
    assert cpu.model.max_model_len == 4096
    assert cpu.scheduler.max_num_batched_tokens == 512
    assert cpu.scheduler.max_num_seqs == 64
    gpu = resolve_config(cfg, on_gpu=True, model_max_len=8192)
    assert (gpu.scheduler.max_num_batched_tokens, gpu.scheduler.max_num_seqs) == (8192, 256)
    # a MoE model takes more requests a step on GPU; an explicit choice stays
    assert (
        resolve_config(cfg, on_gpu=True, model_max_len=8192, moe=True).scheduler.max_num_seqs == 512
    )
    assert (
        resolve_config(cfg, on_gpu=False, model_max_len=8192, moe=True).scheduler.max_num_seqs == 64
    )
    fixed = EngineConfig.from_kwargs(max_num_seqs=100)
    assert (
        resolve_config(fixed, on_gpu=True, model_max_len=8192, moe=True).scheduler.max_num_seqs
        == 100
    )
    # async scheduling: on by default where it pays (GPU), off on CPU; an explicit choice stays
    assert cfg.scheduler.async_scheduling is None
    assert (gpu.scheduler.async_scheduling, cpu.scheduler.async_scheduling) == (True, False)
    for explicit in (True, False):
        c = EngineConfig.from_kwargs(async_scheduling=explicit)
        for on_gpu in (True, False):
            r = resolve_config(c, on_gpu=on_gpu, model_max_len=8192)
            assert r.scheduler.async_scheduling is explicit


def test_resolve_refuses_context_beyond_the_model():
    cfg = EngineConfig.from_kwargs(max_model_len=10000)
    with pytest.raises(ValueError, match="exceeds the model's 8192 positions"):
        resolve_config(cfg, on_gpu=False, model_max_len=8192)


def test_chunked_prefill_off_budget_holds_the_longest_prompt():
    cfg = EngineConfig.from_kwargs(enable_chunked_prefill=False, max_num_batched_tokens=256)
    r = resolve_config(cfg, on_gpu=False, model_max_len=2048)
    assert r.scheduler.max_num_batched_tokens == 2048


def test_serving_defaults_on_gpu():
    """`lightwell serve` on GPU: 2,048-token steps and prefill graphs up to 2,048 tokens
    (latency); offline: 8,192-token steps and graphs to 512 (throughput); CPU alike either way;
    explicit values stay, the graph size never above the step budget."""

    def resolved(serving: bool, on_gpu: bool = True, **kwargs):
        cfg = EngineConfig.from_kwargs(**kwargs).replace(serving=serving)
        r = resolve_config(cfg, on_gpu=on_gpu, model_max_len=8192)
        return r.scheduler.max_num_batched_tokens, r.device.cuda_graph_prefill_tokens

    assert resolved(True) == (2048, 2048)
    assert resolved(False) == (8192, 512)
    assert resolved(True, on_gpu=False) == resolved(False, on_gpu=False) == (512, 512)
    assert resolved(True, max_num_batched_tokens=8192) == (8192, 2048)
    assert resolved(True, max_num_batched_tokens=1000) == (1000, 1000)
    assert resolved(False, cuda_graph_prefill_tokens=1024) == (8192, 1024)
    assert resolved(True, cuda_graph_prefill_tokens=0) == (2048, 0)
    # --dual-stream pays inside graphs only: offline it takes the larger graphs too
    assert resolved(False, dual_stream=True) == (8192, 2048)
    assert resolved(False, dual_stream=True, cuda_graph_prefill_tokens=512) == (8192, 512)


def test_serve_builds_its_engine_with_serving_defaults(monkeypatch):
    import lightwell.engine.llm_engine as llm_engine
    from lightwell.cli import _register_extra, build_parser

    seen = []

    class Stop(Exception):
        pass

    def fake_engine(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(llm_engine, "LLMEngine", fake_engine)
    _register_extra()
    args = build_parser().parse_args(["serve", "--max-num-seqs", "8"])
    with pytest.raises(Stop):
        args.handler(args)
    assert seen[0].serving and seen[0].scheduler.max_num_seqs == 8
