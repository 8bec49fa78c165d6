"""W3 on any machine: start `lightwell serve`, load it with `lightwell bench serve`, stop it;
print the result as a markdown table and write the raw records (vLLM's `bench serve` metrics).
The scaled-down CPU run (SmolLM2-135M on 2 cores, 50 requests of 128 in / 32 out a rate, about
6 minutes) that writes benchmarks/results/W3_cpu.json:

    python3 -m benchmarks.workloads.serve_w3 --input-len 128 --output-len 32 --num-prompts 50 \
        --request-rate 0.5,1,2,4 --serve-args="--num-threads 1 --log-level WARNING" \
        --bench-args=--no-progress --out benchmarks/results/W3_cpu.json

Full W3 (500 requests of 1,024 in / 256 out, Poisson at 2, 8 and 32 req/s) on the registry-less
GPU machine runs through workloads/w3.sh, which installs the server's wheels first. Server
options go in --serve-args (one string), extra client options in --bench-args (write them with
"=", e.g. --bench-args="--metadata dtype=bfloat16", so they are not read as options of this
script). The client cannot see the server's dtype: pass it as metadata to record it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

from lightwell.bench.results import script_command

COLUMNS = [("request_s", "req/s"), ("output_tok_s", "out tok/s"), ("total_tok_s", "total tok/s")]
LATENCY_STEMS = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"lightwell serve exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    proc.terminate()
    sys.exit(f"lightwell serve was not ready after {timeout:.0f} s")


def markdown_table(rows: list[dict]) -> str:
    """One line per request rate: throughputs, then mean / P50 / P95 / P99 of each latency."""
    by_rate: dict[str, dict[str, float]] = {}
    for r in rows:
        by_rate.setdefault(r["request_rate"], {})[r["metric"]] = r["value"]
    head = ["rate (req/s)"] + [name for _, name in COLUMNS]
    for _, name in LATENCY_STEMS:
        head.append(f"{name} ms mean / P50 / P95 / P99")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate, m in by_rate.items():
        cells = [rate] + [f"{m[k]:.2f}" for k, _ in COLUMNS]
        for stem, _ in LATENCY_STEMS:
            cells.append(
                " / ".join(f"{m[f'{stem}_ms_{s}']:.1f}" for s in ("mean", "p50", "p95", "p99"))
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_command(args: argparse.Namespace, url: str, plot: str) -> list[str]:
    command = script_command()
    bench = [sys.executable, "-m", "lightwell.cli", "bench", "serve", "--base-url", url]
    bench += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    bench += ["--num-prompts", str(args.num_prompts), "--request-rate", args.request_rate]
    bench += ["--ignore-eos", "--result-json", args.out, "--plot", plot]
    bench += ["--metadata", f"command={command}", f"serve_args={args.serve_args}"]
    return bench + shlex.split(args.bench_args)


def run(args: argparse.Namespace) -> int:
    """Start the server, run the benchmark against it, stop the server; the bench's exit code."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    serve = [sys.executable, "-m", "lightwell.cli", "serve", "--host", "127.0.0.1"]
    serve += ["--port", str(port), *shlex.split(args.serve_args)]
    print("$", shlex.join(serve), flush=True)
    proc = subprocess.Popen(serve, env=env)
    try:
        wait_ready(url, proc, args.ready_timeout)
        bench = bench_command(args, url, args.plot or os.path.splitext(args.out)[0] + ".png")
        print("$", shlex.join(bench), flush=True)
        return subprocess.call(bench, env=env)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--request-rate", default="2,8,32")
    ap.add_argument("--serve-args", default="", help="Options for `lightwell serve`.")
    ap.add_argument("--bench-args", default="", help="More options for `lightwell bench serve`.")
    ap.add_argument("--out", default="w3.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png).")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args()
    rc = run(args)
    if rc != 0 or not os.path.exists(args.out):
        sys.exit(f"bench serve failed (exit code {rc})")
    with open(args.out) as f:
        print(markdown_table(json.load(f)))


if __name__ == "__main__":
    main()
