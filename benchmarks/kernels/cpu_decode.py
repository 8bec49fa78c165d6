"""The fused CPU decode call (``kernels/cpu/llama_decode.c``) on SmolLM2-135M's Q4_1 GGUF file,
one request, at several context lengths: the call alone (no scheduler, no sampling), float32
activations and, with ``--int8``, int8 ones. The KV cache holds random values and the
request's blocks are drawn at random from it (a cache that has served other requests). The
call's median over ``--calls`` calls after a warm-up, per length; W5's engine step adds the
Python around it. Under a minute on 2 cores:

    python -m benchmarks.kernels.cpu_decode --threads 2 --int8 --out cpu_decode.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_call(decoder, context: int, calls: int, seed: int) -> list[float]:
    """Seconds a call of ``decoder`` takes for one request with ``context`` tokens cached."""
    cache = decoder._keep[2][0].kv_cache  # [2, N, B, Hkv, D]
    num_blocks, block = cache.shape[1], cache.shape[2]
    gen = torch.Generator().manual_seed(seed)
    used = (context + block - 1) // block
    if used > num_blocks:
        raise SystemExit(f"{context} tokens need {used} cache blocks; the cache has {num_blocks}")
    table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32).reshape(1, -1)
    last = context - 1
    positions = torch.tensor([last])
    slots = torch.tensor([int(table[0, last // block]) * block + last % block])
    seq_lens = torch.tensor([context], dtype=torch.int32)
    x = torch.randn(1, decoder.shape.hidden, generator=gen)
    args = (x, positions, slots, table, seq_lens)
    for _ in range(3):
        decoder(*args)
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        decoder(*args)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="64,128,256,384,1024", help="comma-separated")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--int8", action="store_true", help="also with --cpu-int8-activations")
    ap.add_argument("--out", help="write the records here (a JSON list)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lightwell import LLM

    rows = []
    for int8 in (False, True) if args.int8 else (False,):
        llm = LLM(
            quantization="gguf",
            num_threads=args.threads,
            kv_cache_memory_gb=0.25,
            cpu_int8_activations=int8,
        )
        cpu = llm.engine.executor.worker.runner.cpu_decode
        if cpu is None:
            raise SystemExit("the fused CPU decode does not apply here (no C compiler?)")
        decoder = cpu.decoder
        for layer in decoder._keep[2]:  # random keys and values, not zeros
            layer.kv_cache.normal_(generator=torch.Generator().manual_seed(0))
        activations = "int8" if int8 else "float32"
        for context in (int(c) for c in args.contexts.split(",")):
            times = time_call(decoder, context, args.calls, seed=context)
            ms = statistics.median(times) * 1e3
            print(f"{activations:8} context {context:5}: {ms:6.2f} ms a call", flush=True)
            rows.append((ms, [t * 1e3 for t in times], activations, context))
        del llm
    if args.out:
        from lightwell.bench.results import record, write_json

        records = [
            record(
                "call_ms",
                ms,
                values=values,
                model="SmolLM2-135M-Instruct Q4_1 GGUF",
                activations=activations,
                context=context,
                threads=args.threads,
                statistic="median",
            )
            for ms, values, activations, context in rows
        ]
        write_json(args.out, records)


if __name__ == "__main__":
    main()
