"""Find the kernel behind an illegal-address fault: the check stage's SmolLM2-shaped bf16
engine run (benchmarks/gpu_engine.py), one subprocess per variant so a sticky CUDA error in one
does not end the others, then the first failing variant under compute-sanitizer's memcheck.

A variant is a sequence of engines run one after another in one process (the check stage runs
five): ``tiny32``/``tiny16`` the tiny Llama in fp32/bf16, ``cpu32`` SmolLM2-shaped fp32 on the
CPU, ``float32``/``bfloat16``/``float16`` SmolLM2-shaped on the GPU.

    python3 benchmarks/gpu_fault_probe.py --out $OUT/probe [--sanitizer-s 240] [--variants a,b]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> (engines in order, environment, engine options)
CHECK = "tiny32,tiny16,cpu32,float32,bfloat16"
VARIANTS = {
    "check": (CHECK, {}, {}),
    "check-sync": (CHECK, {}, {"async_scheduling": False}),
    "check-eager": (CHECK, {}, {"enforce_eager": True}),
    "check-no-gemv": (CHECK, {"LIGHTWELL_SKINNY_GEMM_MAX_ROWS": "0"}, {}),
    "f32-bf16": ("float32,bfloat16", {}, {}),
    "bf16-bf16": ("bfloat16,bfloat16", {}, {}),
    "tiny16-bf16": ("tiny16,bfloat16", {}, {}),
    "cpu-bf16": ("cpu32,bfloat16", {}, {}),
}


def child(folders: str, variant: str) -> None:
    import torch
    from gpu_engine import SMOLLM2_SHAPED as SMOL
    from gpu_engine import TINY_LLAMA, rand_prompts

    from lightwell import LLM, SamplingParams

    smol_folder, tiny_folder = folders.split(",")
    engines, _, opts = VARIANTS[variant]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    for i, engine in enumerate(engines.split(",")):
        tiny = engine.startswith("tiny")
        vocab = (TINY_LLAMA if tiny else SMOL)["vocab_size"]
        prompts = [p["prompt_token_ids"] for p in rand_prompts(4, 37, vocab, 1)]
        prompts[1] = prompts[1][:5]
        dtype = {"tiny32": "float32", "tiny16": "bfloat16", "cpu32": "float32"}.get(engine, engine)
        llm = LLM(
            tiny_folder if tiny else smol_folder,
            device="cpu" if engine == "cpu32" else "cuda",
            dtype=dtype,
            skip_tokenizer_init=True,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_kv_blocks=256,
            **({} if engine == "cpu32" else opts),
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        torch.cuda.synchronize()
        print(i, engine, "tokens", [o.outputs[0].token_ids[:4] for o in outs], flush=True)
        llm.engine.shutdown()
        torch.cuda.synchronize()
        print(i, engine, "synchronized after shutdown", flush=True)
    print("CHILD-OK", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sanitizer-s", type=float, default=240.0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    from gpu_engine import SMOLLM2_SHAPED as SMOL
    from gpu_engine import TINY_LLAMA, save_hf_llama

    os.makedirs(args.out, exist_ok=True)
    folders = tempfile.mkdtemp(prefix="smol-probe"), tempfile.mkdtemp(prefix="tiny-probe")
    save_hf_llama(folders[0], **SMOL)
    save_hf_llama(folders[1], **TINY_LLAMA)
    folders = ",".join(folders)
    me = os.path.abspath(__file__)
    summary, failed = [], []
    for variant in args.variants.split(","):
        cmd = [sys.executable, me, "--out", args.out, "--child", folders, variant]
        env = {**os.environ, **VARIANTS[variant][1]}
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
            log, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            log, rc = f"TIMEOUT\n{e.stdout or ''}{e.stderr or ''}", "timeout"
        with open(os.path.join(args.out, f"{variant}.log"), "w") as f:
            f.write(log)
        ok = "CHILD-OK" in log
        failed += [] if ok else [variant]
        steps = [ln for ln in log.splitlines() if "synchronized after" in ln or "error" in ln]
        summary.append(f"{variant:14s} rc={rc} ok={ok} | " + " | ".join(steps[-3:])[:300])
        print(summary[-1], flush=True)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    if not failed:
        return 0
    cmd = [
        "compute-sanitizer",
        "--tool",
        "memcheck",
        "--print-limit",
        "20",
        sys.executable,
        me,
        "--out",
        args.out,
        "--child",
        folders,
        failed[0],
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.sanitizer_s)
        log = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        log = f"TIMEOUT after {args.sanitizer_s}s\n" + str(e.stdout or "") + str(e.stderr or "")
    with open(os.path.join(args.out, "sanitizer.log"), "w") as f:
        f.write(log)
    print(log[-4000:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
