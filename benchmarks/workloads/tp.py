"""Tensor parallelism on 2 GPUs (nvidia-h200-x2): all-reduce strategies, W1 at TP=1 and TP=2,
TTFT of a 2,048-token prompt and decode step time at batch 64, per communication option, in two
modes. One device call, about 8 minutes:

    python3 benchmarks/gpu_tp.py --out $OUT/tp

Modes (NCCL reads its environment at init, so every mode runs in its own subprocesses):
- ``nvlink``: the machine as it is;
- ``pcie-emulated``: NCCL_P2P_DISABLE=1 (NCCL goes through host memory, like a PCIe box
  without peer access) and the peer-memory all-reduce off (``custom_all_reduce=False``).
Per mode: the all-reduce table and a model-level check of every strategy (2 spawned ranks,
``tp_allreduce.py``), then one subprocess per engine configuration (llama-3-8b shapes, dummy
weights, bf16, max_num_seqs=64, max_num_batched_tokens=2048, 16 GiB of KV cache a rank).
Every subprocess is time-boxed against one overall budget (--budget-s); each writes its rows
to its own JSON file under --out as it goes, so a timeout keeps what was measured. The merged
rows go to --out/gpu_tp.json and a short table is printed last.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# W1 floors: bytes streamed per token by each GPU over 4,221 GB/s. llama-3-8b at TP=1: 15.01 GB
# (TP=2 halves it: 562 tok/s); llama-3-70b at TP=2: 69.5e9 non-embedding params x 2 B / 2 GPUs.
FLOOR_TOK_S = {"llama-3-8b": 281.0, "llama-3-70b": 60.7}
MODE_ENV = {
    "nvlink": {},
    "pcie-emulated": {"NCCL_P2P_DISABLE": "1"},
}
COMMON_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# hostmem never / always fusing the residual add + RMSNorm into its kernel (for comparison)
NOFUSE = {"LIGHTWELL_HOSTMEM_FUSE_NORM": "0"}
FUSE = {"LIGHTWELL_HOSTMEM_FUSE_NORM": "1"}
G2048 = {"cuda_graph_prefill_tokens": 2048}
NOALIGN = {"LIGHTWELL_INT8_PACK_ALIGN": "0"}  # lightwell/kernels/int8_pack.py's switch
CUBLAS_W1 = {"LIGHTWELL_SKINNY_GEMM_MAX_ROWS": "0"}  # lightwell/quant/base.py's switch
ROPE_APART = {"LIGHTWELL_FUSED_ROPE_STORE": "0"}  # attention/triton_backend.py's switch
COMBINE = {"LIGHTWELL_SPLIT_COMBINE_IN_KERNEL": "1"}  # kernels/paged_attention.py's switch
PDL = {"LIGHTWELL_PDL": "1"}  # kernels/pdl.py's switch (on by default since tp_run12)
NOPDL = {"LIGHTWELL_PDL": "0"}
PDL_AR = {"LIGHTWELL_PDL_ALLREDUCE": "1"}  # the low-latency all-reduce signals too (not default)
PF1 = {"LIGHTWELL_PDL_PREFETCH_TILES": "1"}  # its L2 prefetch of a second weight tile (run 12)


def dual512(all_reduce: str, **options) -> dict:
    """Dual-stream from 512 tokens (decode steps run plain), prefills replayed from graphs."""
    return dict(all_reduce=all_reduce, dual_stream=True, dual_stream_min_tokens=512, **G2048,
                **options)  # fmt: skip


# (label, engine options, stages), most important first: the budget cuts from the end.
ENGINES = {
    "nvlink": [
        ("tp1", dict(tensor_parallel_size=1), ("w1", "ttft", "decode")),
        ("tp2-nccl", dict(all_reduce="nccl"), ("w1", "ttft", "decode")),
        ("tp2-auto", dict(all_reduce="auto"), ("w1", "ttft", "decode")),
        ("tp2-70b", dict(all_reduce="auto", hf_config_json="llama-3-70b"), ("w1",)),
        ("tp2-auto-dual", dict(all_reduce="auto", dual_stream=True), ("w1", "ttft", "decode")),
        ("tp2-oneshot", dict(all_reduce="oneshot"), ("ttft", "decode")),
        ("tp2-hostmem", dict(all_reduce="hostmem"), ("w1", "ttft", "decode")),
        ("tp2-auto-dual-profile", dict(all_reduce="auto", dual_stream=True), ("profile",)),
        ("tp2-auto-pdec", dict(all_reduce="auto"), ("profile-decode",)),
        # W1's decode step (batch 1) under the profiler, TP=1 and TP=2 (run 10)
        ("tp1-pw1", dict(tensor_parallel_size=1), ("profile-w1",)),
        ("tp2-auto-pw1", dict(all_reduce="auto"), ("profile-w1",)),
        # cuBLAS for the batch-1 matmuls, as before run 10 (kernels/gemv.py off)
        ("tp1-cublas", dict(tensor_parallel_size=1, _env=CUBLAS_W1), ("w1",)),
        ("tp2-auto-cublas", dict(all_reduce="auto", _env=CUBLAS_W1), ("w1",)),
        # RoPE and the KV-cache store as two kernels (one since tp_run11: the default)
        ("tp1-ropeapart", dict(tensor_parallel_size=1, _env=ROPE_APART), ("w1", "profile-w1")),
        ("tp2-auto-ropeapart", dict(all_reduce="auto", _env=ROPE_APART), ("w1", "profile-w1")),
        # the split-KV combine inside the attention kernel (not yet the default)
        ("tp1-combine", dict(tensor_parallel_size=1, _env=COMBINE), ("w1", "profile-w1")),
        ("tp2-auto-combine", dict(all_reduce="auto", _env=COMBINE), ("w1", "profile-w1")),
        # programmatic dependent launch of the gemv and the norms (the default since tp_run12:
        # -pdl pins it on, -nopdl off), alone and with the combine inside the attention kernel
        # (whose o_proj then follows it); -pdlar: the all-reduce kernel signals too
        ("tp1-pdl", dict(tensor_parallel_size=1, _env=PDL), ("w1", "profile-w1")),
        ("tp1-pdl-pf1", dict(tensor_parallel_size=1, _env=PDL | PF1), ("w1",)),
        ("tp2-auto-pdl", dict(all_reduce="auto", _env=PDL), ("w1", "profile-w1")),
        ("tp1-pdl-combine", dict(tensor_parallel_size=1, _env=PDL | COMBINE), ("w1",)),
        ("tp1-nopdl", dict(tensor_parallel_size=1, _env=NOPDL), ("w1", "ttft")),
        ("tp2-auto-nopdl", dict(all_reduce="auto", _env=NOPDL), ("w1",)),
        # decode all-reduces of up to 64 KB through the peer GPU's memory (not auto's yet)
        ("tp2-peermem", dict(all_reduce="peermem"), ("w1", "decode")),
        ("tp2-auto-pdlar", dict(all_reduce="auto", _env=PDL_AR), ("w1", "profile-w1")),
        ("tp2-peermem-pdlar", dict(all_reduce="peermem", _env=PDL_AR), ("w1",)),
        # the 2,048-token prefill, PDL on and off, alone / after W1 / profiled (tp_run12 calls 5-8)
        ("tp1-pttft", dict(tensor_parallel_size=1), ("profile",)),
        ("tp1-nopdl-pttft", dict(tensor_parallel_size=1, _env=NOPDL), ("profile",)),
        ("tp1-ttft", dict(tensor_parallel_size=1), ("ttft",)),  # with no W1 before it
        ("tp1-nopdl-ttft", dict(tensor_parallel_size=1, _env=NOPDL), ("ttft",)),
        ("tp1-w1-pttft", dict(tensor_parallel_size=1), ("w1", "profile")),  # after W1
        ("tp1-nopdl-w1-pttft", dict(tensor_parallel_size=1, _env=NOPDL), ("w1", "profile")),
        ("tp2-auto-pdl-combine", dict(all_reduce="auto", _env=PDL | COMBINE), ("w1",)),
        ("tp2-peermem-pdl-combine", dict(all_reduce="peermem", _env=PDL | COMBINE), ("w1",)),
    ],
    "pcie-emulated": [
        ("tp2-nccl", dict(all_reduce="nccl"), ("w1", "ttft", "decode")),
        ("tp2-hostmem", dict(all_reduce="hostmem"), ("w1", "ttft", "decode")),
        ("tp2-hostmem-int8", dict(all_reduce="hostmem-int8"), ("w1", "ttft", "decode")),
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
        # dual-stream from 512 tokens only: decode steps run plain (hostmem's kernels)
        (
            "tp2-hostmem-copy-dual512-g2048",
            dual512("hostmem-copy"),
            ("w1", "ttft", "decode"),
        ),
        (
            "tp2-hostmem-copy-int8-dual512-g2048",
            dual512("hostmem-copy-int8"),
            ("w1", "ttft", "decode", "profile"),
        ),
        # each direction's copies taking turns on 1, 2 or 3 streams (run 9)
        *[
            (
                f"tp2-hostmem-copy-int8-dual512-g2048-l{n}",
                dual512("hostmem-copy-int8", _env={"LIGHTWELL_HOSTMEM_COPY_LANES": str(n)}),
                ("ttft", "profile") if n == 2 else ("ttft",),
            )
            for n in (1, 2, 3)
        ],
        (  # 8 smaller pieces on 2 lanes: each chunk lands sooner
            "tp2-hostmem-copy-int8-dual512-g2048-c8-l2",
            dual512(
                "hostmem-copy-int8",
                _env={"LIGHTWELL_HOSTMEM_COPY_LANES": "2", "LIGHTWELL_HOSTMEM_COPY_CHUNKS": "8"},
            ),
            ("ttft",),
        ),
        (
            "tp2-hostmem-copy-dual512-g2048-l2",
            dual512("hostmem-copy", _env={"LIGHTWELL_HOSTMEM_COPY_LANES": "2"}),
            ("ttft",),
        ),
        # the int8 kernels without their alignment hints (run 8)
        (
            "tp2-hostmem-copy-int8-dual512-g2048-noalign",
            dual512("hostmem-copy-int8", _env=NOALIGN),
            ("ttft", "decode"),
        ),
        ("tp2-hostmem-int8-noalign", dict(all_reduce="hostmem-int8", _env=NOALIGN), ("decode",)),
        # the peers' int8 copies summed inside the norm that consumes them (default: apart)
        (
            "tp2-hostmem-copy-int8-dual512-g2048-fuse",
            dual512("hostmem-copy-int8", _env={"LIGHTWELL_HOSTMEM_COPY_FUSE_NORM": "1"}),
            ("ttft",),
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
        # the copy-engine messages in 2, 3 or 8 pieces (default 4)
        *[
            (
                f"tp2-hostmem-copy-int8-dual512-g2048-c{c}",
                dual512("hostmem-copy-int8", _env={"LIGHTWELL_HOSTMEM_COPY_CHUNKS": str(c)}),
                ("ttft",) if c < 8 else ("w1", "ttft", "decode"),
            )
            for c in (2, 3, 8)
        ],
        (
            "tp2-hostmem-copy-dual512-g2048-c8",
            dual512("hostmem-copy", _env={"LIGHTWELL_HOSTMEM_COPY_CHUNKS": "8"}),
            ("ttft",),
        ),
        (
            "tp2-hostmem-int8-dual-g2048",
            dict(all_reduce="hostmem-int8", dual_stream=True, **G2048),
            ("ttft", "decode"),
        ),
        ("tp2-hostmem-int8-g2048", dict(all_reduce="hostmem-int8", **G2048), ("ttft",)),
        (
            "tp2-hostmem-int8-nofuse",
            dict(all_reduce="hostmem-int8", _env=NOFUSE),
            ("ttft", "decode"),
        ),
        ("tp2-auto", dict(all_reduce="auto"), ("w1", "ttft", "decode")),
        ("tp2-auto-nofuse", dict(all_reduce="auto", _env=NOFUSE), ("w1", "ttft", "decode")),
        ("tp2-hostmem-int8-fuse", dict(all_reduce="hostmem-int8", _env=FUSE), ("ttft", "decode")),
        ("tp2-nccl-pdec", dict(all_reduce="nccl"), ("profile-decode",)),
        ("tp2-hostmem-int8-pdec", dict(all_reduce="hostmem-int8"), ("profile-decode",)),
        (
            "tp2-hostmem-int8-dual",
            dict(all_reduce="hostmem-int8", dual_stream=True),
            ("ttft", "decode", "profile"),
        ),
        (
            "tp2-hostmem-int8-dual-p32",
            dict(
                all_reduce="hostmem-int8",
                dual_stream=True,
                _env={"LIGHTWELL_HOSTMEM_MAX_PROGRAMS": "32"},
            ),
            ("ttft", "decode", "profile"),
        ),
        (
            "tp2-hostmem-int8-noll",
            dict(all_reduce="hostmem-int8", _env={"LIGHTWELL_HOSTMEM_LL_MAX_BYTES": "0"}),
            ("w1", "decode"),
        ),
        (
            "tp2-hostmem-noll",
            dict(all_reduce="hostmem", _env={"LIGHTWELL_HOSTMEM_LL_MAX_BYTES": "0"}),
            ("w1", "decode"),
        ),
        ("tp2-hostmem-dual", dict(all_reduce="hostmem", dual_stream=True), ("ttft", "decode")),
        ("tp2-nccl-dual", dict(all_reduce="nccl", dual_stream=True), ("ttft", "profile")),
        ("tp2-int8", dict(all_reduce="int8"), ("w1", "ttft", "decode")),
        ("tp2-int8-dual", dict(all_reduce="int8", dual_stream=True), ("ttft", "decode")),
        ("tp2-host", dict(all_reduce="host"), ("ttft", "decode")),
    ],
}
ENGINE_CAP_S = 150  # one engine subprocess at most
SHARE = {"nvlink": 0.55, "pcie-emulated": 0.45}  # of the budget; --share overrides


# ---- one engine configuration (subprocess) -----------------------------------------------
def rand_prompts(n: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(128256) for _ in range(length)]} for _ in range(n)]


def make_llm(mode: str, options: dict, dual_min_tokens: int):
    from lightwell import LLM

    kw = dict(
        load_format="dummy",
        hf_config_json="llama-3-8b",
        dtype="bfloat16",
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_cache_memory_gb=16.0,
        # the engine's default when runs 1-9 measured these labels (--dual-stream now raises
        # it to 2,048): the -g2048 labels set it themselves
        cuda_graph_prefill_tokens=512,
    )
    if options.get("tensor_parallel_size", 2) == 2:
        kw.update(
            tensor_parallel_size=2,
            custom_all_reduce=mode == "nvlink",
            dual_stream_min_tokens=dual_min_tokens,
        )
    kw.update(options)
    return LLM(**kw)


def stage_w1(llm, emit, model: str = "llama-3-8b") -> None:
    from lightwell import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
    llm.generate(
        rand_prompts(1, 128, 99),
        SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    rates, ttfts, tokens = [], [], None
    for seed in (1, 2, 3):
        out = llm.generate(rand_prompts(1, 128, seed), sp, use_tqdm=False)[0]
        m = out.metrics
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
        rates.append(255 / (m.last_token_time - m.first_token_time))
        tokens = tokens or out.outputs[0].token_ids[:32]
    rate = statistics.median(rates)
    floor = FLOOR_TOK_S[model]
    emit("decode_tok_s", rate, workload="W1", floor=floor, runs=rates, tokens=tokens)
    emit("ttft_ms", statistics.median(ttfts), workload="W1", prompt_len=128, runs=ttfts)


def stage_ttft(llm, emit) -> None:
    from lightwell import SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(rand_prompts(1, 2048, 50), one, use_tqdm=False)  # warm-up
    t = []
    for seed in (51, 52, 53):
        m = llm.generate(rand_prompts(1, 2048, seed), one, use_tqdm=False)[0].metrics
        t.append(1e3 * (m.first_token_time - m.arrival_time))
    emit("ttft_ms", statistics.median(t), workload="TTFT-2048", prompt_len=2048, runs=t)


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
    from gpu_profile import cuda_kernels
    from torch.profiler import ProfilerActivity, profile

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
    from gpu_profile import cuda_kernels, idle_gaps
    from torch.profiler import ProfilerActivity, profile

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
    from results_io import record

    mode, label = args.mode, args.engine
    _, options, stages = next(e for e in ENGINES[mode] if e[0] == label)
    rows: list[dict] = []
    path = os.path.join(args.out, f"gpu_tp_{mode}_{label}.json")
    tp = options.get("tensor_parallel_size", 2)
    model = options.get("hf_config_json", "llama-3-8b")
    common = dict(
        model=model,
        dtype="bfloat16",
        tp=tp,
        mode=mode,
        config=label,
        options={k: v for k, v in options.items() if k != "tensor_parallel_size"},
    )

    def emit(metric: str, value: float, **fields) -> None:
        rows.append(record(metric, value, **common, **fields))
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"  [{mode} {label}] {metric} = {value:.4g}", flush=True)

    options = dict(options)
    os.environ.update(options.pop("_env", {}))  # before the engine spawns its ranks
    t0 = time.perf_counter()
    llm = make_llm(mode, options, args.dual_min_tokens)
    emit("engine_start_s", time.perf_counter() - t0, workload="startup")
    run_stage = {
        "w1": lambda: stage_w1(llm, emit, model),
        "ttft": lambda: stage_ttft(llm, emit),
        "decode": lambda: stage_decode(llm, emit),
        "profile": lambda: stage_profile(llm, emit, args.out, f"{mode}_{label}"),
        "profile-decode": lambda: stage_profile_decode(llm, emit, args.out, f"{mode}_{label}"),
        "profile-w1": lambda: stage_profile_decode(
            llm, emit, args.out, f"{mode}_{label}", batch=1, steps=32
        ),
    }
    for stage in stages:
        run_stage[stage]()
    llm.engine.shutdown()
    sys.stdout.flush()
    os._exit(0)  # results are on disk; never wait on NCCL/CUDA teardown at interpreter exit


# ---- all-reduce table + model check (subprocess, 2 spawned ranks) --------------------------
def run_allreduce(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp
    from tp_allreduce import run_rank

    from lightwell.executor.multiproc import free_port

    port = free_port()
    out = os.path.join(args.out, f"gpu_tp_{args.mode}_allreduce.json")
    mp.spawn(run_rank, args=(port, args.mode, out, args.deadline, args.stages), nprocs=2)
    return 0


# ---- driver ----------------------------------------------------------------------------------
def child(args: argparse.Namespace, what: list[str], deadline: float, cap: float) -> None:
    env = {**os.environ, **COMMON_ENV, **MODE_ENV[args.mode_now]}
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--out",
        args.out,
        "--mode",
        args.mode_now,
        "--deadline",
        str(deadline),
        "--stages",
        args.stages,
        "--dual-min-tokens",
        str(args.dual_min_tokens),
        *what,
    ]
    timeout = max(5.0, min(cap, deadline - time.time()))
    t0 = time.time()
    # Its own session, so a timeout ends it together with the rank processes it spawned.
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
        if {"allreduce", "check"} & set(args.stages.split(",")):
            child(args, [], min(mode_end, time.time() + args.allreduce_s), args.allreduce_s + 30)
        for label, _, _ in ENGINES[mode]:
            if args.engines != "all" and label not in wanted and f"{mode}:{label}" not in wanted:
                continue
            if mode_end - time.time() < 40:
                print(f"-- {mode} {label}: skipped (budget)", flush=True)
                continue
            child(args, ["--engine", label], min(end, mode_end + 20), ENGINE_CAP_S)
    rows = []
    for path in sorted(glob.glob(os.path.join(args.out, "gpu_tp_*.json"))):
        with open(path) as f:
            rows.extend(json.load(f))
    with open(os.path.join(args.out, "gpu_tp.json"), "w") as f:
        json.dump(rows, f, indent=1)
    _bundle(args.out)
    from tp_report import print_tables

    print_tables(rows)
    print(f"total {time.time() - start:.0f} s; {len(rows)} rows in {args.out}/gpu_tp.json")
    return 0


def _bundle(out: str) -> None:
    """The per-subprocess files into one tar (the device tool returns only a few files)."""
    import tarfile

    parts = [
        p for p in glob.glob(os.path.join(out, "*")) if not p.endswith(("gpu_tp.json", ".tgz"))
    ]
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
        help="stages of the 2-rank subprocess: allreduce, check",
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
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode is None:
        return drive(args)
    if args.engine is None:
        return run_allreduce(args)
    return run_engine(args)


if __name__ == "__main__":
    sys.exit(main())
