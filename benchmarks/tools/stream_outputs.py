"""What turning each step's results into streamed RequestOutputs costs the engine's host
loop: 64 streams, one token each a step, no tokenizer (token ids only), one CPU thread. On the
CPU, about 30 seconds:

    OMP_NUM_THREADS=1 python3 -m benchmarks.tools.stream_outputs \
        --out benchmarks/results/stream_outputs_cpu.json

Prints the mean ms a step over the last 100 steps of 256-, 4,096- and 16,384-token streams
(a snapshot that copied every token so far made this grow with the stream's length); with
``--out``, also writes them as result records.
"""

from __future__ import annotations

import argparse
import sys
import time

from lightwell.bench.results import record, write_json
from lightwell.engine.output_processor import OutputProcessor
from lightwell.scheduler.output import EngineCoreOutput
from lightwell.types import SamplingParams

STREAMS = 64


def late_step_ms(tokens: int) -> float:
    op = OutputProcessor(None)
    params = SamplingParams(max_tokens=tokens)
    for r in range(STREAMS):
        op.add_request(f"r{r}", [f"r{r}c"], None, [1, 2, 3], params, time.time())
    late = 0.0
    for step in range(tokens):
        outs = [EngineCoreOutput(f"r{r}c", [step % 1000]) for r in range(STREAMS)]
        t = time.perf_counter()
        op.process(outs)
        if step >= tokens - 100:
            late += time.perf_counter() - t
    return 1e3 * late / 100


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures here (JSON records)")
    args = ap.parse_args()
    rows = []
    for tokens in (256, 4096, 16384):
        ms = late_step_ms(tokens)
        print(f"{tokens:6d} tokens x {STREAMS} streams: {ms:6.2f} ms a step")
        rows.append(record("output_step_ms", round(ms, 3), workload="stream-outputs",
                           tokens=tokens, streams=STREAMS, threads=1))  # fmt: skip
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
