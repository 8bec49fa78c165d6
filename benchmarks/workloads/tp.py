"""W4, tensor parallelism on 2 GPUs: W1 (batch-1 decode) at TP=1 and TP=2, TTFT of a
2,048-token prompt and the decode step at batch 64, per communication option, in two modes,
after the all-reduce table and model check of benchmarks/comm/allreduce.py. One device call of
about 8 minutes (the whole run is time-boxed by --budget-s, 470 s):

    run(kind="nvidia-h200-x2", command="python3 -m benchmarks.workloads.tp --out $OUT/tp")

``--modes nvlink`` or ``--modes pcie-emulated`` runs one mode; ``--engines tp1,tp2-auto`` (or
``pcie-emulated:tp2-nccl``) picks engine labels from ENGINES; ``--stages none`` skips the
all-reduce table and check. Reference results: benchmarks/results/W4_tp2_nvlink.json and
W4_tp2_pcie-emulated.json (engines), allreduce_tp2_*.json (the all-reduce tables and checks).

Modes (NCCL reads its environment at init, so every mode runs in its own subprocesses):
- ``nvlink``: the machine as it is;
- ``pcie-emulated``: NCCL_P2P_DISABLE=1 (NCCL goes through host memory, like a PCIe box
  without peer access) and the peer-memory all-reduce off (``custom_all_reduce=False``).
Per mode: the all-reduce table and model check (``python3 -m benchmarks.comm.allreduce``, 2
spawned ranks), then one subprocess per engine configuration (llama-3-8b shapes, dummy
weights, bf16, max_num_seqs=64, max_num_batched_tokens=2048, 16 GiB of KV cache a rank).
Every subprocess is time-boxed against the overall budget; each writes its rows to its own
JSON file under --out as it goes, so a timeout keeps what was measured. The merged rows go to
--out/tp.json (the per-engine files into --out/parts.tgz) and a short table is printed last.

``--set multi``: the two-GPU runs of pipeline, expert and context parallelism (MULTI): W1,
TTFT(2,048) and W2 (1,000 x 1,024 in / 256 out, the engine's W2 defaults; a pipeline's stage
utilisation beside it) for TP=1, PP=2 and TP=2 on llama-3-8b; W1, W2 and a batch-64 decode
profile (the all-reduce share) for Mixtral-8x7B and DeepSeek-V2-Lite at TP=2 with and without
expert parallelism; TTFT of a 32,768-token prompt at CP=1 and CP=2; PP=2 and Mixtral's expert
parallelism again with NCCL_P2P_DISABLE=1. More than one call holds: split it by engines,

    run(kind="nvidia-h200-x2", command="python3 -m benchmarks.workloads.tp --set multi "
        "--stages none --modes nvlink --engines tp1,pp2,tp2-auto --budget-s 560 "
        "--engine-cap-s 280 --out $OUT/multi")

``--set big``: DeepSeek-V3 as shipped (FP8 128 x 128 blocks) with expert parallelism over eight
GPUs (attention tensor-parallel), and Qwen2-72B GPTQ-Int4 (group 128) at TP=4 over NVLink and
emulated PCIe (NCCL, the exact and the int8 host all-reduce): W1, TTFT(2,048), the batch-64
decode step. One call each for x8 and x4; the serving runs go through workloads/w3.sh:

    run(kind="nvidia-h200-x8", command="python3 -m benchmarks.workloads.tp --set big "
        "--stages none --modes nvlink --engines v3-fp8-ep8 --budget-s 560 --engine-cap-s 540 "
        "--out $OUT/v3")
    TP=8 MODEL_NAME=deepseek-v3-fp8 VOCAB=129280 RATES=16,8,4,2,1 NUM_PROMPTS=100 \
        MODEL_JSON="$(python3 -c 'from benchmarks.workloads.tp import V3_FP8; print(V3_FP8)')" \
        SERVE_ARGS="--enable-expert-parallel --max-model-len 8192" \
        bash benchmarks/workloads/w3.sh $OUT/w3
    run(kind="nvidia-h200-x4", command="python3 -m benchmarks.workloads.tp --set big "
        "--stages none --budget-s 560 --engine-cap-s 200 --engines qwen72b-gptq-tp4-auto,"
        "pcie-emulated:qwen72b-gptq-tp4-nccl,pcie-emulated:qwen72b-gptq-tp4-hostmem-int8 "
        "--out $OUT/q72")

``--dry-run`` runs a set's engines on the CPU with tiny configs of the same families and
scaled-down stages (2 ranks over gloo, one thread each): the script's plumbing, not a
measurement (its rows say ``dry_run``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

from benchmarks.comm.allreduce import COMMON_ENV, MODE_ENV
from benchmarks.workloads.moe_v3_layers import FP8_BLOCK

# W1 floors: bytes streamed per token by each GPU over 4,221 GB/s. llama-3-8b at TP=1: 15.01 GB
# (TP=2 halves it: 562 tok/s); llama-3-70b at TP=2: 69.5e9 non-embedding params x 2 B / 2 GPUs;
# Mixtral-8x7B at TP=2: 12.75e9 active params x 2 B / 2 GPUs.
FLOOR_TOK_S = {"llama-3-8b": 281.0, "llama-3-70b": 60.7, "mixtral-8x7b": 331.0}
# the engine's W2 settings (W2 runs), and a context for the 32,768-token prompt (dummy weights:
# llama-3-8b's shapes with room for the positions)
W2_OPTS = dict(max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory_gb=None)
LONG = dict(hf_config_json='{"preset": "llama-3-8b", "max_position_embeddings": 40960}',
            max_model_len=34000, max_num_batched_tokens=8192, kv_cache_memory_gb=None)  # fmt: skip
G2048 = {"cuda_graph_prefill_tokens": 2048}
NOPDL = {"pdl": False}  # programmatic dependent launch off (the default is on, sm_90+)


def dual512(all_reduce: str, **options) -> dict:
    """Dual-stream from 512 tokens (decode steps run plain), prefills replayed from graphs."""
    return dict(all_reduce=all_reduce, dual_stream=True, dual_stream_min_tokens=512, **G2048,
                **options)  # fmt: skip


# (label, engine options, stages), most important first: the budget cuts from the end.
# Stages: w1, ttft (2,048-token prompt), decode (batch 64), profile (the 2,048-token prefill
# under torch.profiler), profile-decode (batch 64), profile-w1 (batch 1).
ENGINES = {
    "nvlink": [
        ("tp1", dict(tensor_parallel_size=1), ("w1", "ttft", "decode")),
        ("tp2-nccl", dict(all_reduce="nccl"), ("w1", "ttft", "decode")),
        ("tp2-auto", dict(all_reduce="auto"), ("w1", "ttft", "decode")),
        ("pp2", dict(tensor_parallel_size=1, pipeline_parallel_size=2), ("w1", "ttft", "decode")),
        ("tp2-mixtral", dict(all_reduce="auto", hf_config_json="mixtral-8x7b"), ("w1", "decode")),
        (
            "tp2-ep-mixtral",
            dict(all_reduce="auto", hf_config_json="mixtral-8x7b", enable_expert_parallel=True),
            ("w1", "decode"),
        ),
        ("tp2-70b", dict(all_reduce="auto", hf_config_json="llama-3-70b"), ("w1",)),
        ("tp2-auto-dual", dict(all_reduce="auto", dual_stream=True), ("w1", "ttft", "decode")),
        ("tp2-oneshot", dict(all_reduce="oneshot"), ("ttft", "decode")),
        ("tp2-hostmem", dict(all_reduce="hostmem"), ("w1", "ttft", "decode")),
        ("tp1-nopdl", dict(tensor_parallel_size=1, **NOPDL), ("w1", "ttft")),
        ("tp2-auto-nopdl", dict(all_reduce="auto", **NOPDL), ("w1", "ttft")),
        ("tp2-auto-dual-profile", dict(all_reduce="auto", dual_stream=True), ("profile",)),
        ("tp2-auto-pdec", dict(all_reduce="auto"), ("profile-decode",)),
        ("tp1-pw1", dict(tensor_parallel_size=1), ("profile-w1",)),
        ("tp2-auto-pw1", dict(all_reduce="auto"), ("profile-w1",)),
        ("tp1-pttft", dict(tensor_parallel_size=1), ("profile",)),
        ("tp2-auto-pttft", dict(all_reduce="auto"), ("profile",)),
    ],
    "pcie-emulated": [
        ("tp2-nccl", dict(all_reduce="nccl"), ("w1", "ttft", "decode")),
        ("tp2-auto", dict(all_reduce="auto"), ("w1", "ttft", "decode")),
        ("tp2-hostmem", dict(all_reduce="hostmem"), ("w1", "ttft", "decode")),
        ("tp2-hostmem-int8", dict(all_reduce="hostmem-int8"), ("w1", "ttft", "decode")),
        (
            "tp2-hostmem-copy-int8-dual512-g2048",
            dual512("hostmem-copy-int8"),
            ("w1", "ttft", "decode", "profile"),
        ),
        ("tp2-hostmem-copy-dual512-g2048", dual512("hostmem-copy"), ("w1", "ttft", "decode")),
        ("tp2-hostmem-copy", dict(all_reduce="hostmem-copy"), ("ttft", "decode")),
        (
            "tp2-hostmem-copy-dual",
            dict(all_reduce="hostmem-copy", dual_stream=True),
            ("ttft", "decode", "profile"),
        ),
        # -g2048: steps up to 2,048 tokens replay CUDA graphs (the TTFT prompt's prefill too)
        ("tp2-nccl-g2048", dict(all_reduce="nccl", **G2048), ("ttft", "decode")),
        ("tp2-hostmem-copy-g2048", dict(all_reduce="hostmem-copy", **G2048), ("ttft",)),
        (
            "tp2-hostmem-copy-dual-g2048",
            dict(all_reduce="hostmem-copy", dual_stream=True, **G2048),
            ("ttft", "decode", "profile"),
        ),
        # three or four micro-batches (--dual-stream-micro-batches)
        *[
            (
                f"tp2-hostmem-copy{kind}-dual512-g2048-m{m}",
                dual512(f"hostmem-copy{kind}", dual_stream_micro_batches=m),
                ("ttft",),
            )
            for kind in ("-int8", "")
            for m in (3, 4)
        ],
        (
            "tp2-hostmem-int8-dual512-g2048-m3",
            dual512("hostmem-int8", dual_stream_micro_batches=3),
            ("ttft",),
        ),
        (
            "tp2-hostmem-int8-dual-g2048",
            dict(all_reduce="hostmem-int8", dual_stream=True, **G2048),
            ("ttft", "decode"),
        ),
        ("tp2-hostmem-int8-g2048", dict(all_reduce="hostmem-int8", **G2048), ("ttft",)),
        (
            "tp2-hostmem-int8-dual",
            dict(all_reduce="hostmem-int8", dual_stream=True),
            ("ttft", "decode", "profile"),
        ),
        ("tp2-hostmem-dual", dict(all_reduce="hostmem", dual_stream=True), ("ttft", "decode")),
        ("tp2-nccl-dual", dict(all_reduce="nccl", dual_stream=True), ("ttft", "profile")),
        ("tp2-nccl-pdec", dict(all_reduce="nccl"), ("profile-decode",)),
        ("tp2-hostmem-int8-pdec", dict(all_reduce="hostmem-int8"), ("profile-decode",)),
    ],
}
# --set multi (issue 27): most important first in each mode
_PP2 = (
    "pp2",
    dict(tensor_parallel_size=1, pipeline_parallel_size=2, **W2_OPTS),
    ("w1", "ttft", "w2"),
)


def _moe_tp2(name: str, preset: str, expert_parallel: bool) -> tuple:
    """A MoE preset at TP=2, with or without expert parallelism: W1, W2, a decode profile."""
    options = dict(all_reduce="auto", hf_config_json=preset, **W2_OPTS)
    if expert_parallel:
        options["enable_expert_parallel"] = True
    label = f"tp2-{'ep-' if expert_parallel else ''}{name}"
    return label, options, ("w1", "w2", "profile-decode")


MULTI = {
    "nvlink": [
        ("tp1", dict(tensor_parallel_size=1, **W2_OPTS), ("w1", "ttft", "w2")),
        _PP2,
        ("tp2-auto", dict(all_reduce="auto", **W2_OPTS), ("w1", "ttft", "w2")),
        *(
            _moe_tp2(name, preset, ep)
            for name, preset in (("mixtral", "mixtral-8x7b"), ("v2lite", "deepseek-v2-lite"))
            for ep in (False, True)
        ),
        ("cp1-32k", dict(tensor_parallel_size=1, **LONG), ("ttft32k",)),
        ("cp2-32k", dict(tensor_parallel_size=1, context_parallel_size=2, **LONG), ("ttft32k",)),
    ],
    "pcie-emulated": [_PP2, *(_moe_tp2("mixtral", "mixtral-8x7b", ep) for ep in (False, True))],
}
# --set big (issue 28): DeepSeek-V3 as shipped (FP8 128 x 128 blocks) on eight GPUs with expert
# parallelism (attention tensor-parallel), and Qwen2-72B as GPTQ-Int4 (group 128) at TP=4 (its
# published intermediate size, 29,696, divides into 128-column groups at TP=4), over NVLink and
# emulated PCIe with the exact and int8 host all-reduces
GPTQ4 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
V3_FP8 = json.dumps({"preset": "deepseek-v3", "quantization_config": FP8_BLOCK})
QWEN72_GPTQ = json.dumps({"preset": "qwen2.5-7b", "hidden_size": 8192, "intermediate_size": 29696,
                          "num_hidden_layers": 80, "num_attention_heads": 64,
                          "num_key_value_heads": 8, "quantization_config": GPTQ4})  # fmt: skip


def _qwen72(all_reduce: str) -> tuple:
    return (f"qwen72b-gptq-tp4-{all_reduce}",
            dict(tensor_parallel_size=4, all_reduce=all_reduce, hf_config_json=QWEN72_GPTQ),
            ("w1", "ttft", "decode"))  # fmt: skip


BIG = {
    "nvlink": [
        ("v3-fp8-ep8", dict(tensor_parallel_size=8, enable_expert_parallel=True,
                            hf_config_json=V3_FP8, max_model_len=8192), ("w1", "ttft", "decode")),
        _qwen72("auto"),
    ],
    "pcie-emulated": [_qwen72(a) for a in ("nccl", "auto", "hostmem-int8")],
}  # fmt: skip
ENGINE_SETS = {"w4": ENGINES, "multi": MULTI, "big": BIG}
# --dry-run: tiny configs of the presets' families (the plumbing, on the CPU)
TINY = {
    "llama-3-8b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2),
    "mixtral-8x7b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2),
    "deepseek-v2-lite": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=32, num_attention_heads=4, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             n_routed_experts=8, num_experts_per_tok=2),
    # 128 x 128 FP8 blocks and 128-column GPTQ groups: dimensions of whole blocks
    # (at TP=8: 16 heads, 2 a rank, of 128 q / kv_b columns; the shared expert 1,024 / 8)
    "deepseek-v3": dict(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=256,
                        intermediate_size=1024, moe_intermediate_size=1024,
                        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=128,
                        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                        v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                        topk_group=1),
    # (at TP=4: a 128-wide head and 128 MLP columns a rank)
    "qwen2.5-7b": dict(num_hidden_layers=2, hidden_size=512, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=4),
}  # fmt: skip
ENGINE_CAP_S = 150  # one engine subprocess at most (default of --engine-cap-s)
SHARE = {"nvlink": 0.55, "pcie-emulated": 0.45}  # of the budget; --share overrides


# ---- one engine configuration (subprocess) -----------------------------------------------
def rand_prompts(n: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    # ids below 32,000: inside every preset's vocabulary (Mixtral's is 32,000)
    return [{"prompt_token_ids": [rng.randrange(32000) for _ in range(length)]} for _ in range(n)]


def make_llm(mode: str, options: dict, dual_min_tokens: int, dry_run: bool = False):
    from lightwell import LLM

    if dry_run:
        return LLM(**dry_run_options(options))
    kw = dict(
        load_format="dummy",
        hf_config_json="llama-3-8b",
        dtype="bfloat16",
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_cache_memory_gb=16.0,
        # prefill graphs up to 512 tokens (--dual-stream would raise it to 2,048), so that the
        # labels without -g2048 compare with those that set 2,048
        cuda_graph_prefill_tokens=512,
    )
    tp = options.get("tensor_parallel_size", 2)
    if tp > 1:
        kw.update(
            tensor_parallel_size=tp,
            custom_all_reduce=mode == "nvlink",
            dual_stream_min_tokens=dual_min_tokens,
        )
    kw.update(options)
    return LLM(**kw)


def dry_run_options(options: dict) -> dict:
    """``options`` for the CPU with a tiny config of the same family (``--dry-run``): the
    parallel layout kept, the GPU-only switches dropped."""
    keep = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
            "enable_expert_parallel")  # fmt: skip
    model = options.get("hf_config_json", "llama-3-8b")
    base = json.loads(model) if model.startswith("{") else {"preset": model}
    tiny = {**base, **TINY[base["preset"]]}
    kw = dict(load_format="dummy", hf_config_json=json.dumps(tiny), dtype="float32",
              device="cpu", num_threads=1, max_num_seqs=8, max_num_batched_tokens=256,
              kv_cache_memory_gb=0.05, tensor_parallel_size=2)  # fmt: skip
    kw.update({k: v for k, v in options.items() if k in keep})
    return kw


def stage_w1(llm, emit, model: str = "llama-3-8b", tokens: int = 256) -> None:
    from lightwell import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    llm.generate(
        rand_prompts(1, 128, 99),
        SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    rates, ttfts, first = [], [], None
    for seed in (1, 2, 3):
        out = llm.generate(rand_prompts(1, 128, seed), sp, use_tqdm=False)[0]
        m = out.metrics
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
        rates.append((sp.max_tokens - 1) / (m.last_token_time - m.first_token_time))
        first = first or out.outputs[0].token_ids[:32]
    rate = statistics.median(rates)
    floor = FLOOR_TOK_S.get(model)
    emit("decode_tok_s", rate, workload="W1", floor=floor, runs=rates, tokens=first)
    emit("ttft_ms", statistics.median(ttfts), workload="W1", prompt_len=128, runs=ttfts)


def stage_ttft(llm, emit, length: int = 2048, workload: str = "TTFT-2048") -> None:
    from lightwell import SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(rand_prompts(1, length, 50), one, use_tqdm=False)  # warm-up
    t = []
    for seed in (51, 52, 53):
        m = llm.generate(rand_prompts(1, length, seed), one, use_tqdm=False)[0].metrics
        t.append(1e3 * (m.first_token_time - m.arrival_time))
    emit("ttft_ms", statistics.median(t), workload=workload, prompt_len=length, runs=t)


def stage_w2(llm, emit, requests: int = 1000, prompt_len: int = 1024, output_len: int = 256):
    """W2: ``requests`` prompts at once, EOS ignored: total tok/s, and each pipeline stage's
    utilisation (busy / wall, ``PipelineStage.times``) where the engine has stages: host-timed,
    and on GPUs device-timed (``gpu_busy_s``: the host's time there includes waiting)."""
    from benchmarks.workloads.pp_cpu import stage_busy, stage_times
    from lightwell import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                        detokenize=False)  # fmt: skip
    before = stage_times(llm)
    t0 = time.perf_counter()
    outs = llm.generate(rand_prompts(requests, prompt_len, 7), sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = stage_times(llm)
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)

    def util(key: str) -> list[float] | None:
        return [round(b / wall, 4) for b in stage_busy(before, after, key)] or None

    emit("total_tok_s", tokens / wall, workload="W2", requests=requests, prompt_len=prompt_len,
         output_len=output_len, wall_s=round(wall, 2), stage_utilisation=util("busy_s"),
         stage_gpu_utilisation=util("gpu_busy_s"))  # fmt: skip


def _start_decoding(engine, batch: int, steps: int, tag: str) -> None:
    """``batch`` requests of 128 prompt tokens, prefilled: every next step decodes them all."""
    from lightwell import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, detokenize=False)
    for i, p in enumerate(rand_prompts(batch, 128, 70)):
        engine.add_request(f"{tag}{i}", p, sp, final_only=True)
    while engine.scheduler.waiting or _prefilling(engine):
        engine.step()


def stage_decode(llm, emit, batch: int = 64, steps: int = 24) -> None:
    """Median wall time of one engine step with ``batch`` requests all decoding."""
    engine = llm.engine
    _start_decoding(engine, batch, steps, "dec")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
    while engine.has_unfinished_requests():
        engine.step()
    emit(
        "decode_step_ms",
        statistics.median(times),
        workload="decode-batch64",
        batch=batch,
        runs=[round(x, 3) for x in times],
    )


def stage_profile(llm, emit, out: str, name: str) -> None:
    """One 2,048-token prefill under torch.profiler on rank 0: the CUDA kernels with their
    streams and times (JSON), to see what overlaps with what."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.tools.step_profile import cuda_kernels
    from lightwell import SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(rand_prompts(1, 2048, 60), one, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(rand_prompts(1, 2048, 61), one, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof)
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) if kernels else 0
    busy: dict = {}
    for k in kernels:
        busy[k["stream"]] = busy.get(k["stream"], 0) + k["dur"]
    with open(os.path.join(out, f"profile_{name}.json"), "w") as f:
        json.dump({"span_us": span, "busy_us_by_stream": busy, "kernels": kernels}, f)
    with open(os.path.join(out, f"profile_{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    emit("profile_span_us", span, workload="profile-2048", busy_us_by_stream=busy)


KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("gather", ("allgather", "all_gather")),  # greedy sampling's (value, index) exchange
    # hostmem's kernel includes the fused residual add + RMSNorm where it fuses (decode)
    ("all-reduce", ("hostmem", "nccl", "allreduce", "all_reduce")),
    ("gemm", ("gemm", "nvjet", "sm90", "cutlass", "gemv", "matmul")),
    ("attention", ("attn", "attention", "split_kv")),
    ("norm", ("rmsnorm",)),
)


def stage_profile_decode(llm, emit, out: str, name: str, batch: int = 64, steps: int = 8) -> None:
    """Rank 0's GPU over ``steps`` steady decode steps at ``batch``, per step: the span, the
    time some kernel ran (busy), and kernel time by kind (KERNEL_KINDS, else other) and by
    kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.tools.step_profile import cuda_kernels, idle_gaps

    engine = llm.engine
    _start_decoding(engine, batch, steps + 32, "pdec")
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    kernels = [k for k in cuda_kernels(prof) if k["dur"] > 0]
    by_kind: dict = {}
    for k in kernels:
        low = k["name"].lower()
        kind = next((n for n, keys in KERNEL_KINDS if any(s in low for s in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + k["dur"] / steps
    end = max((k["ts"] + k["dur"] for k in kernels), default=0.0)
    span = (end - kernels[0]["ts"]) if kernels else 0.0
    busy = span - sum(idle_gaps(kernels))
    top: dict = {}
    for k in kernels:
        top[k["name"]] = top.get(k["name"], 0.0) + k["dur"] / steps
    with open(os.path.join(out, f"profile_decode{batch}_{name}.json"), "w") as f:
        json.dump({"span_us": span, "busy_us": busy, "kernels": kernels}, f)
    emit(
        "decode_profile_us_per_step",
        span / steps,
        workload=f"decode-batch{batch}-profile",
        batch=batch,
        gpu_busy_us_per_step=busy / steps,
        by_kind_us_per_step={k: round(v, 1) for k, v in by_kind.items()},
        top_kernels_us_per_step={
            n: round(v, 1) for n, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]
        },
    )


def _prefilling(engine) -> bool:
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)


def run_engine(args: argparse.Namespace) -> int:
    from lightwell.bench.results import record

    mode, label, dry = args.mode, args.engine, args.dry_run
    _, options, stages = next(e for e in ENGINE_SETS[args.set][mode] if e[0] == label)
    rows: list[dict] = []
    path = os.path.join(args.out, f"tp_{mode}_{label}.json")
    tp = options.get("tensor_parallel_size", 2)
    model = options.get("hf_config_json", "llama-3-8b")
    common = dict(
        model=model,
        dtype="bfloat16",
        tp=tp,
        mode=mode,
        config=label,
        options={k: v for k, v in options.items() if k != "tensor_parallel_size"},
        command=args.command,
        **({"dry_run": True} if dry else {}),
    )

    def emit(metric: str, value: float, **fields) -> None:
        rows.append(record(metric, value, **common, **fields))
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"  [{mode} {label}] {metric} = {value:.4g}", flush=True)

    t0 = time.perf_counter()
    llm = make_llm(mode, options, args.dual_min_tokens, dry)
    emit("engine_start_s", time.perf_counter() - t0, workload="startup")
    run_stage = {
        "w1": lambda: stage_w1(llm, emit, model, 8 if dry else 256),
        "ttft": lambda: stage_ttft(llm, emit, 64 if dry else 2048),
        "ttft32k": lambda: stage_ttft(llm, emit, 200 if dry else 32768, "TTFT-32768"),
        "w2": lambda: stage_w2(llm, emit, *((8, 48, 4) if dry else ())),
        "decode": lambda: stage_decode(llm, emit),
        "profile": lambda: stage_profile(llm, emit, args.out, f"{mode}_{label}"),
        "profile-decode": lambda: stage_profile_decode(llm, emit, args.out, f"{mode}_{label}"),
        "profile-w1": lambda: stage_profile_decode(
            llm, emit, args.out, f"{mode}_{label}", batch=1, steps=32
        ),
    }
    for stage in stages:
        if dry and stage.startswith("profile"):  # (torch.profiler's CUDA kernels)
            print(f"  [{mode} {label}] {stage}: skipped in a dry run", flush=True)
            continue
        run_stage[stage]()
    llm.engine.shutdown()
    sys.stdout.flush()
    os._exit(0)  # results are on disk; never wait on NCCL/CUDA teardown at interpreter exit


# ---- driver ----------------------------------------------------------------------------------
def child(args: argparse.Namespace, what: list[str], deadline: float, cap: float) -> None:
    """One subprocess in the mode's environment: the all-reduce table and check
    (benchmarks.comm.allreduce) when ``what`` is empty, else this module's engine ``what``."""
    env = {**os.environ, **COMMON_ENV, **MODE_ENV[args.mode_now]}
    common = ["--mode", args.mode_now, "--deadline", str(deadline), "--command", args.command]
    if what:
        module = "benchmarks.workloads.tp"
        rest = ["--out", args.out, "--dual-min-tokens", str(args.dual_min_tokens), "--set",
                args.set, *(["--dry-run"] if args.dry_run else []), *what]  # fmt: skip
    else:
        module = "benchmarks.comm.allreduce"
        out = os.path.join(args.out, f"tp_{args.mode_now}_allreduce.json")
        rest = ["--out", out, "--stages", args.stages]
    timeout = max(5.0, min(cap, deadline - time.time()))
    t0 = time.time()
    # Its own session, so a timeout ends it together with the rank processes it spawned.
    cmd = [sys.executable, "-m", module, *common, *rest]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    print(
        f"-- {args.mode_now} {' '.join(what) or 'allreduce'}: rc={rc} ({time.time() - t0:.0f} s)",
        flush=True,
    )


def drive(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    start, modes = time.time(), args.modes.split(",")
    end = start + args.budget_s
    weights = {**SHARE, **json.loads(args.share)}
    wanted = args.engines.split(",")
    for i, mode in enumerate(modes):
        args.mode_now = mode
        share = sum(weights[m] for m in modes[: i + 1]) / sum(weights[m] for m in modes)
        mode_end = start + args.budget_s * share
        print(f"== mode {mode} (until +{mode_end - start:.0f} s)", flush=True)
        if {"allreduce", "check"} & set(args.stages.split(",")) and not args.dry_run:
            child(args, [], min(mode_end, time.time() + args.allreduce_s), args.allreduce_s + 30)
        for label, _, _ in ENGINE_SETS[args.set][mode]:
            if args.engines != "all" and label not in wanted and f"{mode}:{label}" not in wanted:
                continue
            if mode_end - time.time() < 40:
                print(f"-- {mode} {label}: skipped (budget)", flush=True)
                continue
            child(args, ["--engine", label], min(end, mode_end + 20), args.engine_cap_s)
    rows = []
    for path in sorted(glob.glob(os.path.join(args.out, "tp_*.json"))):
        with open(path) as f:
            rows.extend(json.load(f))
    with open(os.path.join(args.out, "tp.json"), "w") as f:
        json.dump(rows, f, indent=1)
    _bundle(args.out)
    from benchmarks.tools.tp_report import print_tables

    print_tables(rows)
    print(f"total {time.time() - start:.0f} s; {len(rows)} rows in {args.out}/tp.json")
    return 0


def _bundle(out: str) -> None:
    """The per-subprocess files into one tar (the device tool returns only a few files)."""
    import tarfile

    parts = [p for p in glob.glob(os.path.join(out, "*")) if not p.endswith(("tp.json", ".tgz"))]
    with tarfile.open(os.path.join(out, "parts.tgz"), "w:gz") as tar:
        for path in parts:
            tar.add(path, arcname=os.path.basename(path))
    for path in parts:
        os.remove(path)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="folder for the JSON results")
    ap.add_argument("--modes", default="nvlink,pcie-emulated")
    ap.add_argument(
        "--stages",
        default="allreduce,check",
        help="stages of benchmarks.comm.allreduce run first in each mode: allreduce, check, none",
    )
    ap.add_argument(
        "--engines",
        default="all",
        help="engine labels to run, optionally as mode:label (default all)",
    )
    ap.add_argument("--budget-s", type=float, default=470.0, help="the whole run's time box")
    ap.add_argument("--allreduce-s", type=float, default=60.0)
    ap.add_argument("--share", default="{}", help='budget weights per mode, JSON: {"nvlink": 0.3}')
    ap.add_argument("--dual-min-tokens", type=int, default=64)
    ap.add_argument(
        "--set",
        default="w4",
        choices=sorted(ENGINE_SETS),
        help="w4: the TP comparison (ENGINES); multi: PP / EP / CP runs (MULTI)",
    )
    ap.add_argument(
        "--engine-cap-s", type=float, default=ENGINE_CAP_S, help="one engine subprocess's time box"
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny configs on the CPU: the plumbing, not a measurement",
    )
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--command", help=argparse.SUPPRESS)  # the driver's, recorded by children
    args = ap.parse_args()
    if args.mode is None:
        from lightwell.bench.results import script_command

        args.command = script_command()
        return drive(args)
    return run_engine(args)


if __name__ == "__main__":
    sys.exit(main())
