"""MiniCPM and Command-R on the GPU at TP=2 with the dual-stream micro-batch forward: greedy
tokens (fp32) against HF transformers on the CPU, and every step's top-5 log-probabilities
against the GPU's TP=1 run (tiny random models repeat tokens, which the log-probabilities do
not hide). Models from tests/models/families.py; each engine runs in its own subprocess.
One device call of about 6 minutes (eight engines; give it timeout_s=600):

    run(kind="nvidia-h200-x2",
        command="python3 -m benchmarks.workloads.families_dual --out $OUT/families.json")

Exit status 1 on any mismatch. Reference result:
benchmarks/results/check_families_dual_tp2_h200.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

from lightwell.bench.results import record, script_command

RUNS = {
    "tp1": dict(tensor_parallel_size=1),
    "tp2": dict(tensor_parallel_size=2),
    # steps of 16 tokens or more (every prefill step here) as two micro-batches
    "tp2-dual": dict(tensor_parallel_size=2, dual_stream=True, dual_stream_min_tokens=16),
    "tp2-dual3-eager": dict(
        tensor_parallel_size=2,
        dual_stream=True,
        dual_stream_min_tokens=16,
        dual_stream_micro_batches=3,
        enforce_eager=True,
    ),
}
NEW_TOKENS = 16


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 33, 57, 21)]


def child(folder: str, run: str) -> None:
    from lightwell import LLM, SamplingParams

    sp = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False, logprobs=5
    )
    llm = LLM(folder, device="cuda", dtype="float32", skip_tokenizer_init=True, **RUNS[run])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(300)], sp, use_tqdm=False)
    llm.engine.shutdown()
    result = [
        (
            o.outputs[0].token_ids,
            [{t: x.logprob for t, x in d.items()} for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]
    print("RESULT " + json.dumps(result), flush=True)


def logprob_distance(a: list, b: list) -> float:
    """Largest |difference| of a top-5 log-probability both runs list, over every step."""
    worst = 0.0
    for (_, la), (_, lb) in zip(a, b):
        for da, db in zip(la, lb):
            worst = max([worst] + [abs(da[t] - db[t]) for t in set(da) & set(db)])
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    from tests.models.families import cohere, hf_generate, minicpm

    rows, ok, command = [], True, script_command()
    for name, build in (("minicpm", minicpm), ("cohere", cohere)):
        folder = tempfile.mkdtemp(prefix=name)
        hf = build(folder, 7)
        ref = [hf_generate(hf, p, NEW_TOKENS) for p in prompts(300)]
        base = None
        for run in RUNS:
            cmd = [sys.executable, "-m", "benchmarks.workloads.families_dual", "--out", args.out]
            r = subprocess.run(
                cmd + ["--child", folder, run], capture_output=True, text=True, timeout=240
            )
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            got = json.loads(line[0][7:]) if line else None
            same = sum(a[0] == b for a, b in zip(got or [], ref))
            dist, extra = None, {}
            if got is None:
                extra["log_tail"] = (r.stdout + r.stderr)[-3000:]
            else:
                base = got if run == "tp1" else base
                dist = logprob_distance(got, base) if base else float("inf")
                ok = ok and dist < 1e-3
            rows.append(record("logprob_max_abs_diff_vs_tp1", dist, workload="check-families",
                               model=name, run=run, dtype="float32", rc=r.returncode,
                               identical_to_hf=f"{same}/4", command=command, **extra))  # fmt: skip
            ok = ok and same == 4
            print(rows[-1] if got else rows[-1] | {"log_tail": "..."}, flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    print("ALL IDENTICAL" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
