"""W5: SmolLM2-135M-Instruct's Q4_1 GGUF file on this CPU, batch 1: Lightwell on the file's
blocks (``--quantization gguf``), Lightwell on weights dequantized to float32 at load
(``--quantization none``), llama.cpp (llama-cpp-python, not a project dependency: install
it to compare) on the same file at the same thread count, and Lightwell on the blocks with
int8 activations (``--cpu-int8-activations``). 128 random prompt tokens, 256 output
tokens (EOS ignored, greedy), each token timed as it is streamed. Each run is its own process
(its peak RSS is the process's ``ru_maxrss``); the engines take turns, ``--rounds`` times, and
the medians are written. About 6 minutes on 2 idle cores:

    python3 -m benchmarks.workloads.cpu_w5 --threads 2 --rounds 5 \
        --out benchmarks/results/W5_cpu.json

``--rounds 1 --output-len 16`` checks the script in a minute. ``--requantize q4_k_m`` (or
another of llama.cpp's recipes) first rewrites the file with llama-cpp-python's quantizer (the
recipe's K-quants where a row's size allows, its fallbacks, Q5_0 / Q8_0 here, elsewhere) and
runs the engines on that file; ``--model`` runs them on another GGUF file:

    python3 -m benchmarks.workloads.cpu_w5 --threads 2 --rounds 3 --requantize q4_k_m \
        --engines lightwell-gguf,llama.cpp --out benchmarks/results/W5_q4_k_m_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ENGINES = ("lightwell-gguf", "llama.cpp", "lightwell-fp32", "lightwell-gguf-int8")


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def stream_lightwell(
    model: str, quantization: str, prompt: list[int], out_len: int, threads: int, int8: bool
):
    from lightwell import LLM, SamplingParams

    llm = LLM(
        model=model,
        quantization=quantization,
        num_threads=threads,
        kv_cache_memory_gb=0.25,
        cpu_int8_activations=int8,
    )
    engine = llm.engine
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": random_prompt(49152, len(prompt), 1)}], warm)
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(None, {"prompt_token_ids": prompt}, sp)
    times, seen = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            times += [time.perf_counter()] * (n - seen)
            seen = n
    return t0, times


def stream_llama_cpp(model: str, prompt: list[int], out_len: int, threads: int):
    from llama_cpp import Llama

    llm = Llama(
        model,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=1024,
        n_batch=512,
        verbose=False,
    )
    warm = random_prompt(49152, len(prompt), 1)
    for i, _ in enumerate(llm.generate(warm, top_k=1, temp=0.0)):
        if i == 3:
            break
    llm.reset()
    t0 = time.perf_counter()
    times = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == out_len:
            break
    return t0, times


def requantize(src: str, recipe: str) -> str:
    """``src`` rewritten by llama-cpp-python's quantizer in ``recipe`` (a temporary file)."""
    import ctypes
    import tempfile

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{recipe.upper()}", None)
    if ftype is None:
        raise SystemExit(f"--requantize: llama.cpp has no recipe {recipe!r}")
    dst = os.path.join(tempfile.mkdtemp(), f"model-{recipe.lower()}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)):
        raise SystemExit(f"--requantize: llama.cpp could not rewrite {src} as {recipe}")
    return dst


def child(engine: str, args: argparse.Namespace) -> None:
    """One engine, one run, in this process: a JSON line on stdout. llama.cpp's process
    imports neither torch nor the engine (its RSS is its own)."""
    prompt = random_prompt(49152, args.prompt_len, seed=0)
    if engine == "llama.cpp":
        t0, times = stream_llama_cpp(args.model, prompt, args.output_len, args.threads)
    else:
        import torch

        torch.set_num_threads(args.threads)
        quant = "none" if engine == "lightwell-fp32" else "gguf"
        int8 = engine == "lightwell-gguf-int8"
        t0, times = stream_lightwell(args.model, quant, prompt, args.output_len, args.threads, int8)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    decode = (len(times) - 1) / (times[-1] - times[0])
    row = {"ttft_ms": (times[0] - t0) * 1e3, "decode_tok_s": decode, "peak_rss_mb": rss_mb}
    print("RESULT " + json.dumps(row), flush=True)


def run_child(engine: str, args: argparse.Namespace) -> dict | None:
    cmd = [sys.executable, "-m", "benchmarks.workloads.cpu_w5", "--child", engine]
    cmd += ["--threads", str(args.threads), "--prompt-len", str(args.prompt_len)]
    cmd += ["--output-len", str(args.output_len), "--out", "-", "--model", args.model]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"{engine}: failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, in turn")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct's Q4_1)")
    ap.add_argument("--requantize", help="a llama.cpp recipe to rewrite it in (q4_k_m, ...)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    label = "SmolLM2-135M-Instruct Q4_1 GGUF" if args.model is None else args.model
    if args.model is None:
        from lightwell.model_files import default_model_path  # no torch: model_files.py

        args.model = default_model_path()
    if args.child:
        return child(args.child, args)
    if args.requantize:
        args.model = requantize(args.model, args.requantize)
        label += f", requantized {args.requantize} by llama.cpp"
    args.label = label
    engines = args.engines.split(",")
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for e in engines:
            res = run_child(e, args)
            if res is not None:
                runs[e].append(res)
                print(f"round {r} {e:15} " + " ".join(f"{k} {v:.1f}" for k, v in res.items()))
    from lightwell.bench.results import write_json

    write_json(args.out, _records(runs, args))
    print(f"{'engine':15} {'decode tok/s':>12} {'TTFT ms':>8} {'peak RSS MB':>11}  (medians)")
    for e, rs in runs.items():
        if rs:
            med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            tok_s, ttft, rss = med["decode_tok_s"], med["ttft_ms"], med["peak_rss_mb"]
            print(f"{e:15} {tok_s:12.1f} {ttft:8.1f} {rss:11.0f}")


def _records(runs: dict[str, list[dict]], args: argparse.Namespace) -> list[dict]:
    from lightwell.bench.results import record

    rows = []
    for engine, rs in runs.items():
        if not rs:
            continue
        common = dict(
            workload="W5",
            model=args.label,
            engine=engine,
            batch=1,
            threads=args.threads,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            rounds=len(rs),
            statistic="median",
        )
        for metric in ("decode_tok_s", "ttft_ms", "peak_rss_mb"):
            values = [x[metric] for x in rs]
            rows.append(record(metric, statistics.median(values), values=values, **common))
    return rows


if __name__ == "__main__":
    main()
