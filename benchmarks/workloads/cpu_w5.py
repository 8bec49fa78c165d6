"""W5: SmolLM2-135M-Instruct on this CPU, Lightwell against HF transformers: batch-1 decode
(128 prompt tokens, 256 output tokens, EOS ignored) and a 32-request batch, both engines fp32
at the same thread count, in one run of about 3 minutes on 2 idle cores:

    python3 -m benchmarks.workloads.cpu_w5 --threads 2 --out benchmarks/results/W5_cpu.json

``--batch 2 --output-len 8 --skip-hf`` checks the script in seconds.
"""

from __future__ import annotations

import argparse
import os
import time

from lightwell.bench.results import record, write_json


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def bench_lightwell(prompts: list[list[int]], out_len: int, batch: int) -> dict:
    from lightwell import LLM, SamplingParams

    llm = LLM(max_num_seqs=max(batch, 1), max_num_batched_tokens=max(512, 128 * batch // 4))
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    warm = random_prompts(49152, 1, len(prompts[0]), seed=12345)[0]  # no prefix-cache hits
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    m = outs[0].metrics
    ttft = m.first_token_time - m.arrival_time
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_rate = (out_len - 1) / (m.last_token_time - m.first_token_time)
    return {
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "ttft_s": ttft,
        "decode_tok_s_per_seq": decode_rate,
    }


def bench_hf(prompts: list[list[int]], out_len: int, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lightwell.model_files import default_model_path

    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    ids = torch.tensor(prompts[:batch])
    kw = dict(do_sample=False, min_new_tokens=out_len, max_new_tokens=out_len, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        model.generate(ids[:, :], max_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        wall = time.perf_counter() - t0
    n_out = (out.shape[1] - ids.shape[1]) * batch
    return {
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "ttft_s": ttft,
        "decode_tok_s_per_seq": (out_len - 1) / max(wall - ttft, 1e-9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    prompts = random_prompts(49152, args.batch, args.prompt_len, seed=0)
    rows, table = [], []
    engines = [("lightwell", bench_lightwell)] + ([] if args.skip_hf else [("hf", bench_hf)])
    for name, fn in engines:
        for batch in (1, args.batch):
            r = fn(prompts, args.output_len, batch)
            table.append((name, batch, r))
            common = dict(
                workload="W5",
                model="SmolLM2-135M-Instruct",
                dtype="float32",
                engine=name,
                batch=batch,
                threads=args.threads,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
            )
            rows.append(record("output_tok_s", r["output_tok_s"], **common))
            rows.append(record("ttft_ms", r["ttft_s"] * 1e3, **common))
            if batch == 1:
                rows.append(record("decode_tok_s", r["decode_tok_s_per_seq"], **common))
    write_json(args.out, rows)
    print(f"{'engine':10} {'batch':>5} {'out tok/s':>10} {'TTFT ms':>9} {'decode tok/s/seq':>17}")
    for name, batch, r in table:
        print(
            f"{name:10} {batch:5d} {r['output_tok_s']:10.1f} {r['ttft_s'] * 1e3:9.1f} "
            f"{r['decode_tok_s_per_seq']:17.1f}"
        )


if __name__ == "__main__":
    main()
