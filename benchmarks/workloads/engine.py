"""The engine on one GPU (llama-3-8b shapes, dummy weights, bf16): correctness checks, W1
(batch-1 decode, TTFT of 128- and 1,024-token prompts) and W2 (1,000 x 1,024 in / 256 out),
with HF transformers' `generate` on the same shapes as the side-by-side peer. One device call
from the repository root, about 6 minutes with every stage:

    run(command="python3 -m benchmarks.workloads.engine --out $OUT/engine.json")

``--stages`` picks among check, check-async, w1, batch, w2, profile, hf (default
check,w1,w2,hf); "batch": ``--decode-batch`` (16) requests of 128-token prompts decoding 256
tokens together, the decode rate summed over them (W4A16 against bf16 at batch 16:
``--hf-config-json`` with a ``quantization_config``, as for W1);
``--scheduling async,sync`` runs W1/W2 under both step loops (default: async, the engine's
own default on a GPU); ``--budget-s S`` skips engines
started after S seconds. Reference results: benchmarks/results/W1_llama-3-8b_h200.json,
W2_llama-3-8b_h200.json, check_engine_h200.json.

W2 with long prompts, the bf16 KV cache against the fp8 one (``--kv-cache-dtype fp8``: 1.94x
the blocks); each W2 record carries ``num_kv_blocks`` and ``max_running`` (most requests in a
step), so the two runs show how many more sequences fit. Two device calls of a few minutes:

    run(command="python3 -m benchmarks.workloads.engine --stages w2 --w2-requests 512 "
        "--w2-input-len 4096 --w2-output-len 512 --max-num-seqs 512 --out $OUT/w2_4k_bf16kv.json")
    run(command="python3 -m benchmarks.workloads.engine --stages w2 --w2-requests 512 "
        "--w2-input-len 4096 --w2-output-len 512 --max-num-seqs 512 "
        "--engine-args '{\"kv_cache_dtype\": \"fp8\"}' --out $OUT/w2_4k_fp8kv.json")

Correctness (stage "check"): a tiny random HF Llama in fp32 on the GPU (CUDA graphs on) gives
HF's greedy tokens; the same in bf16 stays within bf16 tolerance of HF's fp32 logits; a
SmolLM2-shaped random model gives the same greedy tokens on the GPU (fp32) as on the CPU path.
(The real SmolLM2 GGUF is 98 MB, over the device tool's 64 MiB transfer limit.)
Each stage appends its results to --out as it finishes, so a timeout keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

from benchmarks.tools.step_profile import profiled_step, scheduled_steps
from lightwell import LLM, SamplingParams
from lightwell.bench.results import record

FLOOR_TOK_S = 281.0  # 15.01 GB / 4,221 GB/s
PEAK_TFLOPS = 788.0
PARAMS_8B = 8.03e9
ROWS: list[dict] = []
START = time.perf_counter()


def emit(args: argparse.Namespace, metric: str, value: float, **fields) -> None:
    row = record(metric, value, **fields)
    ROWS.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(ROWS, f, indent=1)
    print(f"  {metric} = {value:.4g}  {fields}", flush=True)


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(n)]


def model_prompts(llm: LLM, n: int, length: int, seed: int) -> list[dict]:
    """``rand_prompts`` over the model's vocabulary."""
    return rand_prompts(n, length, llm.engine.model_info.vocab_size, seed)


# ---- correctness --------------------------------------------------------------------------
def save_hf_llama(folder: str, **cfg) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    with torch.no_grad():  # larger weights than HF's init so greedy tokens are well separated
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)


def hf_greedy(folder: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            outs.append(g[0, len(p) :].tolist())
    return outs


TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    architectures=["LlamaForCausalLM"],
)


# SmolLM2-135M's shapes, random weights: 2,048 positions, under the GPU's default 8,192-token
# step budget (the memory-profiling forward wraps its positions at the model's length).
SMOLLM2_SHAPED = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    architectures=["LlamaForCausalLM"],
)


def stage_check(args: argparse.Namespace) -> bool:
    ok = True
    tiny, smol = TINY_LLAMA, SMOLLM2_SHAPED
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    for name, cfg in (("tiny-llama", tiny), ("smollm2-shaped", smol)):
        folder = tempfile.mkdtemp(prefix=name)
        save_hf_llama(folder, **cfg)
        prompts = [p["prompt_token_ids"] for p in rand_prompts(4, 37, cfg["vocab_size"], 1)]
        prompts[1] = prompts[1][:5]
        ref = (
            hf_greedy(folder, prompts, 24)
            if name == "tiny-llama"
            else _engine_tokens(folder, prompts, sp, device="cpu", dtype="float32")
        )
        for dev, dtype in (("cuda", "float32"), ("cuda", "bfloat16")):
            got = _engine_tokens(folder, prompts, sp, device=dev, dtype=dtype)
            same = sum(a == b for a, b in zip(got, ref))
            match = sum(x == y for a, b in zip(got, ref) for x, y in zip(a, b)) / (24 * 4)
            emit(
                args,
                "greedy_token_match",
                match,
                workload="check",
                model=name,
                dtype=dtype,
                sequences_identical=f"{same}/4",
            )
            if dtype == "float32" and same != 4:
                ok = False
        if name == "smollm2-shaped":
            ok = _check_skinny(args, folder, prompts, sp) and ok
    return ok


def _check_skinny(args: argparse.Namespace, folder: str, prompts, sp) -> bool:
    """One prompt at a time (batch-1 decode: kernels/gemv.py, silu fused into the down
    projection), fp16 and bf16, against the same with cuBLAS and the activation apart: how far
    each one's top-5 log-probabilities are from an fp32 run's, over the steps before it first
    picks a different token (random weights leave near-ties that 16-bit rounding flips). The
    gemv path passes when its distance is at most 1.5x cuBLAS's (+0.01)."""
    from lightwell.quant import base

    lp = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False, logprobs=5
    )

    def run(dtype: str, rows: int) -> list:
        before, base.SKINNY_GEMM_MAX_ROWS = base.SKINNY_GEMM_MAX_ROWS, rows
        try:
            llm = LLM(folder, device="cuda", dtype=dtype, skip_tokenizer_init=True)
            outs = [
                llm.generate([{"prompt_token_ids": p}], lp, use_tqdm=False)[0].outputs[0]
                for p in prompts
            ]
            llm.engine.shutdown()
        finally:
            base.SKINNY_GEMM_MAX_ROWS = before
        return outs

    def distance(outs: list, ref: list) -> tuple[float, int, int]:
        worst, steps, same = 0.0, 0, 0
        for a, b in zip(outs, ref):
            same += a.token_ids == b.token_ids
            for x, y, pa, pb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
                common = set(pa) & set(pb)
                worst = max([worst] + [abs(pa[t].logprob - pb[t].logprob) for t in common])
                steps += 1
                if x != y:
                    break
        return worst, steps, same

    ok = True
    ref = run("float32", 1)  # fp32 never takes the gemv
    for dtype in ("float16", "bfloat16"):
        (gw, gs, gsame), (cw, cs, csame) = (distance(run(dtype, r), ref) for r in (1, 0))
        passed = gw <= 1.5 * cw + 0.01
        emit(
            args,
            "logprob_max_abs_diff_vs_fp32",
            gw,
            workload="check-gemv-vs-cublas",
            model="smollm2-shaped",
            dtype=dtype,
            cublas=cw,
            steps_compared={"gemv": gs, "cublas": cs},
            sequences_identical_to_fp32={"gemv": f"{gsame}/4", "cublas": f"{csame}/4"},
            passed=passed,
        )
        ok = ok and passed
    return ok


def _engine_tokens(folder, prompts, sp, device, dtype, **opts) -> list[list[int]]:
    return _engine_run(folder, prompts, sp, device, dtype, **opts)[0]


def _engine_run(folder, prompts, sp, device, dtype, num_kv_blocks=256, **opts):
    """(token ids of every sequence, number of preemptions) of one engine run."""
    llm = LLM(
        folder,
        device=device,
        dtype=dtype,
        skip_tokenizer_init=True,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_kv_blocks=num_kv_blocks,
        **opts,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    preemptions = llm.engine.stats().num_preemptions
    llm.engine.shutdown()
    return [c.token_ids for o in outs for c in o.outputs], preemptions


def stage_check_async(args: argparse.Namespace) -> bool:
    """--async-scheduling on the GPU (CUDA graphs, pinned copies, tokens fed on the device)
    gives the plain loop's tokens: greedy, seeded, penalties, n=2, under preemption."""
    folder = tempfile.mkdtemp(prefix="tiny-async")
    save_hf_llama(folder, **TINY_LLAMA)
    prompts = [p["prompt_token_ids"] for p in rand_prompts(6, 37, 512, 2)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=0.9, seed=5, max_tokens=33, ignore_eos=True, detokenize=False),
        SamplingParams(
            temperature=0.7,
            seed=3,
            max_tokens=30,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            ignore_eos=True,
            detokenize=False,
        ),
        SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=25, top_k=50, detokenize=False),
        SamplingParams(temperature=0.0, max_tokens=45, min_tokens=10, detokenize=False),
        SamplingParams(temperature=0.6, top_p=0.9, seed=1, max_tokens=38, detokenize=False),
    ]
    ok = True
    for blocks in (256, 14):  # 14 blocks of 16 tokens: preemption
        runs = {}
        for mode in (False, True):
            t0 = time.perf_counter()
            runs[mode], preempted = _engine_run(
                folder, prompts, params, "cuda", "float32", blocks, async_scheduling=mode
            )
            print(f"  async={mode} blocks={blocks} {time.perf_counter() - t0:.1f}s", flush=True)
        same = sum(a == b for a, b in zip(runs[True], runs[False]))
        emit(
            args,
            "async_equal_sequences",
            same,
            of=len(runs[False]),
            num_kv_blocks=blocks,
            preemptions=preempted,
        )
        ok = ok and same == len(runs[False])
    return ok


# ---- W1 / W2 ------------------------------------------------------------------------------
def make_llm(args: argparse.Namespace, max_num_seqs: int | None, async_scheduling: bool) -> LLM:
    t0 = time.perf_counter()
    llm = LLM(
        load_format="dummy",
        hf_config_json=args.hf_config_json,
        dtype="bfloat16",
        **json.loads(args.engine_args),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        enforce_eager=args.eager,
        async_scheduling=async_scheduling,
        **(
            {}
            if args.cuda_graph_prefill_tokens is None
            else {"cuda_graph_prefill_tokens": args.cuda_graph_prefill_tokens}
        ),
    )
    print(f"engine ready in {time.perf_counter() - t0:.1f}s, {llm.engine.num_kv_blocks} blocks")
    return llm


def _over_budget(args: argparse.Namespace, stage: str) -> bool:
    spent = time.perf_counter() - START
    if spent < args.budget_s:
        return False
    print(f"== skipping {stage}: {spent:.0f}s spent of --budget-s {args.budget_s}", flush=True)
    return True


def stage_w1(args: argparse.Namespace, llm: LLM) -> None:
    import lightwell.quant.base as qb

    common = dict(
        workload="W1",
        model=args.hf_config_json,
        engine_args=json.loads(args.engine_args),
        dtype="bfloat16",
        tp=1,
        mode="single",
        eager=args.eager,
        skinny_gemm_rows=qb.SKINNY_GEMM_MAX_ROWS,
        async_scheduling=llm.engine.scheduler.async_scheduling,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
    llm.generate(model_prompts(llm, 1, 128, 99), sp, use_tqdm=False)  # warm-up
    rates, ttfts = [], []
    for seed in (1, 2, 3):
        out = llm.generate(model_prompts(llm, 1, 128, seed), sp, use_tqdm=False)[0]
        m = out.metrics
        ttfts.append(m.first_token_time - m.arrival_time)
        rates.append(255 / (m.last_token_time - m.first_token_time))
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
    for seed in (11, 12, 13, 14):  # more TTFT samples (short requests)
        m = llm.generate(model_prompts(llm, 1, 128, seed), short, use_tqdm=False)[0].metrics
        ttfts.append(m.first_token_time - m.arrival_time)
    emit(args, "step_trace_ms", 0.0, traces=_step_trace(llm, short), **common)
    rate = sorted(rates)[1]
    emit(
        args,
        "decode_tok_s",
        rate,
        floor=FLOOR_TOK_S,
        pct_of_floor=100 * rate / FLOOR_TOK_S,
        peer={"name": "gpt-fast", "value": 173.0},
        runs=rates,
        **common,
    )
    ttft = 1e3 * sorted(ttfts)[len(ttfts) // 2]  # the median
    emit(args, "ttft_ms", ttft, prompt_len=128, runs=ttfts, **common)
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    t = []
    for seed in (4, 5, 6):
        out = llm.generate(model_prompts(llm, 1, 1024, seed), one, use_tqdm=False)[0]
        t.append(out.metrics.first_token_time - out.metrics.arrival_time)
    floor_ms = 1024 * 2 * PARAMS_8B / (PEAK_TFLOPS * 1e12) * 1e3
    emit(args, "ttft_ms", 1e3 * sorted(t)[1], prompt_len=1024, floor=floor_ms, runs=t, **common)


def stage_batch(args: argparse.Namespace, llm: LLM) -> None:
    """``--decode-batch`` requests admitted in one step, decoding together: the summed decode
    rate from the last first token to the first last token (every request in the batch)."""
    b = args.decode_batch
    sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
    llm.generate(model_prompts(llm, b, 128, 98), sp, use_tqdm=False)  # warm-up
    rates = []
    for seed in (31, 32, 33):
        outs = llm.generate(model_prompts(llm, b, 128, seed), sp, use_tqdm=False)
        first = max(o.metrics.first_token_time for o in outs)
        last = min(o.metrics.last_token_time for o in outs)
        steps = min(len(o.outputs[0].token_ids) for o in outs) - 1
        rates.append(b * steps / (last - first))
    emit(
        args,
        "decode_tok_s",
        sorted(rates)[1],
        workload=f"decode_batch_{b}",
        model=args.hf_config_json,
        batch=b,
        runs=rates,
        engine_args=json.loads(args.engine_args),
    )


def _step_trace(llm: LLM, sp: SamplingParams) -> list[list[tuple[float, float, int]]]:
    """Per engine.step() call of a lone 128-token request: (start ms, duration ms, outputs)."""
    engine, traces = llm.engine, []
    for seed in (21, 22):
        engine.add_request(None, model_prompts(llm, 1, 128, seed)[0], sp)
        t0, calls = time.perf_counter(), []
        while engine.has_unfinished_requests():
            a = time.perf_counter()
            n = len(engine.step())
            calls.append((round(1e3 * (a - t0), 2), round(1e3 * (time.perf_counter() - a), 2), n))
        traces.append(calls)
    return traces


def stage_w2(args: argparse.Namespace, llm: LLM) -> None:
    n, n_in = args.w2_requests, args.w2_input_len
    sp = SamplingParams(
        temperature=0.0, max_tokens=args.w2_output_len, ignore_eos=True, detokenize=False
    )
    prompts = model_prompts(llm, n, n_in, 7)
    t0 = time.perf_counter()
    with scheduled_steps(llm.engine) as steps:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps.append((t0 + wall, 0, 0, 0))
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    total = out_toks + n_in * n
    common = dict(
        workload="W2",
        model=args.hf_config_json,
        dtype="bfloat16",
        tp=1,
        requests=n,
        input_len=n_in,
        output_len=args.w2_output_len,
        engine_args=json.loads(args.engine_args),
        wall_s=wall,
        eager=args.eager,
        async_scheduling=llm.engine.scheduler.async_scheduling,
        num_kv_blocks=llm.engine.num_kv_blocks,  # the KV cache's capacity (--kv-cache-dtype)
        max_num_seqs=llm.engine.config.scheduler.max_num_seqs,  # (a MoE model's default: 512)
        max_running=max((reqs for _, _, reqs, _ in steps), default=0),  # most requests a step
    )
    emit(args, "w2_step_summary", len(steps) - 1, **_w2_step_summary(steps), **common)
    emit(args, "output_tok_s", out_toks / wall, **common)
    emit(args, "total_tok_s", total / wall, **common)
    emit(args, "mfu", total * 2 * _params(args) / wall / (PEAK_TFLOPS * 1e12), **common)


def _params(args: argparse.Namespace) -> float:
    """The parameters a token runs through: llama-3-8b's, or a MoE preset's active ones."""
    from lightwell.models.hf_config import PRESETS

    cfg = PRESETS.get(args.hf_config_json, {})
    if cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
        from benchmarks.workloads.moe import active_params

        return active_params(cfg)[0]
    return PARAMS_8B


def _w2_step_summary(steps: list[tuple[float, int, int, int]]) -> dict:
    """Wall time between consecutive schedules, split by step kind (decode-only or with prefill)."""
    kinds: dict[str, list[float]] = {"decode": [0, 0.0, 0, 0], "mixed": [0, 0.0, 0, 0]}
    for (t, tokens, reqs, ones), (t_next, *_rest) in zip(steps, steps[1:]):
        if tokens == 0:
            continue
        k = kinds["decode" if ones == reqs else "mixed"]
        k[0] += 1
        k[1] += t_next - t
        k[2] += tokens
        k[3] += reqs
    out = {}
    for name, (n, secs, tokens, reqs) in kinds.items():
        out[name] = dict(
            steps=n,
            seconds=round(secs, 3),
            mean_step_ms=round(1e3 * secs / max(n, 1), 3),
            mean_tokens=round(tokens / max(n, 1), 1),
            mean_requests=round(reqs / max(n, 1), 1),
        )
    return out


def stage_profile(args: argparse.Namespace, llm: LLM) -> None:
    """Where a step's time goes: torch.profiler over one 128-token prefill and one decode."""
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
    for label in ("prefill128", "decode"):
        if label == "prefill128":
            engine.add_request("prof", model_prompts(llm, 1, 128, 42)[0], sp)
        prof, wall = profiled_step(engine)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
        gpu = prof.key_averages().table(sort_by="device_time_total", row_limit=40)
        with open(os.path.join(os.path.dirname(args.out), f"profile_{label}.txt"), "w") as f:
            f.write(f"step wall {wall * 1e3:.2f} ms\n{table}\nby GPU time\n{gpu}")
        print(f"profile {label}: step wall {wall * 1e3:.2f} ms", flush=True)
    while engine.has_unfinished_requests():
        engine.step()
    _cprofile_steps(args, engine)


def _cprofile_steps(args: argparse.Namespace, engine) -> None:
    """Host-side view of a warmed-up prefill step and decode step (cProfile, by self time)."""
    import cProfile
    import io
    import pstats

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    for i, label in enumerate(("cprof_prefill128", "cprof_decode")):
        if i == 0:
            engine.add_request(
                "cprof", rand_prompts(1, 128, engine.model_info.vocab_size, 43)[0], sp
            )
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        engine.step()
        torch.cuda.synchronize()
        prof.disable()
        wall = time.perf_counter() - t0
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
        with open(os.path.join(os.path.dirname(args.out), f"{label}.txt"), "w") as f:
            f.write(f"step wall {wall * 1e3:.2f} ms\n{buf.getvalue()}")
        print(f"{label}: step wall {wall * 1e3:.2f} ms", flush=True)
    while engine.has_unfinished_requests():
        engine.step()


# ---- HF peer --------------------------------------------------------------------------------
def stage_hf(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from lightwell.models.hf_config import load_hf_config

    cfg = load_hf_config(None, "llama-3-8b")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    common = dict(model="llama-3-8b", dtype="bfloat16", engine="hf-transformers")
    ids = torch.randint(0, 128256, (1, 128), device="cuda")
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        torch.cuda.synchronize()
        emit(args, "decode_tok_s", 64 / (time.perf_counter() - t0), workload="W1", **common)
        b = args.hf_batch
        ids = torch.randint(0, 128256, (b, 1024), device="cuda")
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        new = (out.shape[1] - 1024) * b
        emit(args, "output_tok_s", new / wall, workload="W2", batch=b, wall_s=wall, **common)
        emit(args, "total_tok_s", (new + 1024 * b) / wall, workload="W2", batch=b, **common)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="check,w1,w2,hf")
    ap.add_argument("--w2-requests", type=int, default=1000)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--max-num-seqs", type=int, default=None, help="(default: the engine's for the model)"
    )
    ap.add_argument(
        "--cuda-graph-prefill-tokens", type=int, default=None, help="(default: the engine's)"
    )
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=16, help="the batch stage's requests")
    ap.add_argument("--hf-config-json", default="llama-3-8b", help="the model's shapes (W1/W2)")
    ap.add_argument(
        "--engine-args",
        default="{}",
        help='more LLM options as JSON for W1/W2, e.g. \'{"quantization": "fp8"}\'',
    )
    ap.add_argument("--w2-input-len", type=int, default=1024)
    ap.add_argument("--w2-output-len", type=int, default=256)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--scheduling",
        default="async",
        help="comma list of step loops to measure: async (--async-scheduling, the engine's "
        "GPU default), sync (the plain loop)",
    )
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="skip engines/W2 started after this many s"
    )
    ap.add_argument(
        "--skinny-rows",
        type=int,
        default=None,
        help="rows up to which decode linears use the Triton gemv (0: cuBLAS)",
    )
    args = ap.parse_args()
    stages = args.stages.split(",")
    ok = True
    if "check" in stages:
        print("== check", flush=True)
        ok = stage_check(args)
    if args.skinny_rows is not None:
        import lightwell.quant.base as qb

        qb.SKINNY_GEMM_MAX_ROWS = args.skinny_rows
    if "check-async" in stages:
        print("== check-async", flush=True)
        ok = stage_check_async(args) and ok
    for mode in args.scheduling.split(","):
        if not any(s in stages for s in ("w1", "batch", "w2", "profile")) or _over_budget(
            args, mode
        ):
            continue
        llm = make_llm(args, args.max_num_seqs, async_scheduling=mode == "async")
        if "profile" in stages:
            stage_profile(args, llm)
        if "w1" in stages:
            print(f"== W1 ({mode})", flush=True)
            stage_w1(args, llm)
        if "batch" in stages:
            print(f"== batch {args.decode_batch} ({mode})", flush=True)
            stage_batch(args, llm)
        if "w2" in stages and not _over_budget(args, f"W2 {mode}"):
            print(f"== W2 ({mode})", flush=True)
            stage_w2(args, llm)
        llm.engine.shutdown()  # frees the weights, KV cache and graphs for the next engine
        del llm
    if "hf" in stages:
        print("== HF peer", flush=True)
        stage_hf(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
