"""Per-stage step times of a pipeline stage at llama-3-8b and llama-3-70b shapes on one GPU
(dummy weights, bf16): a stage of PP=P is the model with num_hidden_layers / P layers (the
embedding and LM head included, as on the first / last stage), so its times are what each
stage of a P-stage pipeline spends on a step. One device call from the repository root:

    run(command="python3 -m benchmarks.workloads.pp_stage --out $OUT/pp_stage.json")

Per (shape, P): batch-1 decode step (ms, from a 128-token prompt's decode), the decode step
at batch 64, and TTFT of a 2,048-token prompt; and the bytes a stage boundary sends a step
(hidden + residual, [2, T, H] bf16). The written model in docs/parallelism.md combines these
with the measured all-reduce and send/recv costs. ``--shapes``, ``--stages`` and
``--budget-s`` choose what runs (e.g. ``--shapes llama-3-70b --stages 2,4``); a stage that
does not fit the GPU is recorded as skipped. CPU smoke test:
``--device cpu --shapes tiny --stages 1,2``.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from lightwell.bench.results import record, write_json

LAYERS = {"llama-3-8b": 32, "llama-3-70b": 80, "tiny": 4}
HIDDEN = {"llama-3-8b": 4096, "llama-3-70b": 8192, "tiny": 64}
TINY = {"preset": "llama-3-8b", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip


def _config(shape: str, layers: int) -> str:
    base = dict(TINY) if shape == "tiny" else {"preset": shape}
    return json.dumps({**base, "num_hidden_layers": layers})


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]}
            for _ in range(n)]  # fmt: skip


def _decode_step_ms(llm: object, batch: int, vocab: int, out_len: int) -> float:
    from lightwell import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    outs = llm.generate(_prompts(batch, 128, vocab, seed=batch), sp, use_tqdm=False)
    m = outs[0].metrics
    return 1e3 * (m.last_token_time - m.first_token_time) / (out_len - 1)


def _ttft_ms(llm: object, length: int, vocab: int) -> float:
    from lightwell import SamplingParams

    times = []
    for seed in range(3):
        out = llm.generate(_prompts(1, length, vocab, seed=100 + seed),
                           SamplingParams(max_tokens=1), use_tqdm=False)[0]  # fmt: skip
        times.append(1e3 * (out.metrics.first_token_time - out.metrics.arrival_time))
    return sorted(times)[1]


def measure(shape: str, stages: int, args: argparse.Namespace) -> list[dict]:
    from lightwell import LLM

    layers = LAYERS[shape] // stages
    fields = dict(shape=shape, pp=stages, stage_layers=layers, device=args.device)
    try:
        llm = LLM(load_format="dummy", hf_config_json=_config(shape, layers), device=args.device,
                  dtype="bfloat16" if args.device != "cpu" else "float32",
                  max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)  # fmt: skip
    except (RuntimeError, ValueError) as e:  # does not fit
        return [record("skipped", 0, reason=str(e).splitlines()[0][:200], **fields)]
    try:
        vocab = llm.engine.model_info.vocab_size
        out_len = 8 if args.device == "cpu" else 64
        rows = [
            record("decode_step_ms_b1", _decode_step_ms(llm, 1, vocab, out_len), **fields),
            record("decode_step_ms_b64", _decode_step_ms(llm, 64, vocab, out_len), **fields),
            record("ttft_ms_2048", _ttft_ms(llm, 2048, vocab), **fields),
        ]
    finally:
        llm.engine.shutdown()
    elem = 4 if args.device == "cpu" else 2
    for tokens in (1, 64, 2048):
        rows.append(record("boundary_bytes", 2 * tokens * HIDDEN[shape] * elem, tokens=tokens,
                           **fields))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="llama-3-8b,llama-3-70b")
    ap.add_argument("--stages", default="1,2,4,8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--out", default="benchmarks/results/pp_stage.json")
    args = ap.parse_args()
    t0, rows = time.perf_counter(), []
    for shape in args.shapes.split(","):
        for stages in (int(s) for s in args.stages.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                rows.append(record("skipped", 0, reason="budget", shape=shape, pp=stages))
                continue
            rows += measure(shape, stages, args)
            print(json.dumps(rows[-4:])[:600], flush=True)
            write_json(args.out, rows)  # a timeout keeps what was measured


if __name__ == "__main__":
    main()
