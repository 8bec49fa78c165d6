"""What filling a step's structured-output token bitmask costs the engine: 64 constrained
requests under one JSON schema, SmolLM2's tokenizer (49,152 tokens), each request walked along
its own valid document so the matchers sit in different states. On the CPU, about 10 seconds:

    OMP_NUM_THREADS=1 python3 -m benchmarks.tools.grammar_fill \
        --out benchmarks/results/grammar_fill_cpu.json

Prints the mean ms a step of ``StructuredOutputManager.bitmask`` (the rows one after another on
the engine thread, and xgrammar's batched fill on 2 and 4 threads); with ``--out``, also writes
them as result records.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

from lightwell.bench.results import record, write_json
from lightwell.engine.tokenizer import Tokenizer
from lightwell.model_files import resolve_model
from lightwell.scheduler.output import EngineCoreOutput, SchedulerOutput
from lightwell.structured.manager import StructuredOutputManager
from lightwell.types import SamplingParams

ROWS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def fill_ms(tokenizer: Tokenizer, threads: int, repeats: int = 5) -> float:
    """Mean ms a step over the documents' common length, ``repeats`` times."""
    docs = [
        tokenizer.encode(json.dumps({"name": f"user {i}", "age": i, "tags": ["a"] * (i % 4)}))
        for i in range(ROWS)
    ]
    steps = min(map(len, docs))
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    total = 0.0
    for rep in range(repeats):
        manager = StructuredOutputManager(
            tokenizer, len(tokenizer.hf), [tokenizer.eos_token_id], fill_threads=threads
        )
        ids = [f"{rep}-{i}" for i in range(ROWS)]
        for r in ids:
            manager.add(r, params)
        sched = SchedulerOutput([], [], dict.fromkeys(ids, 1), ROWS)
        requests = dict.fromkeys(ids, SimpleNamespace(num_computed_tokens=1, num_tokens=1))
        for step in range(steps):
            t = time.perf_counter()
            manager.bitmask(sched, requests)
            total += time.perf_counter() - t
            manager.accept([EngineCoreOutput(r, [d[step]]) for r, d in zip(ids, docs)])
    return 1e3 * total / (steps * repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures here (JSON records)")
    args = ap.parse_args()
    tokenizer = Tokenizer.load(resolve_model(None))
    rows = []
    for threads in (1, 2, 4):
        ms = fill_ms(tokenizer, threads)
        print(f"{ROWS} rows, {threads} thread(s): {ms:6.3f} ms a step")
        rows.append(record("grammar_fill_ms", round(ms, 3), workload="grammar-fill",
                           rows=ROWS, fill_threads=threads))  # fmt: skip
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
