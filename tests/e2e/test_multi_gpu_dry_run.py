"""The multi-GPU runners of benchmarks/workloads/tp.py dry-run on the CPU: ``--set multi``
(pipeline, expert and context parallelism on two GPUs) and ``--set big`` (DeepSeek-V3 FP8 with
expert parallelism over eight, Qwen2-72B GPTQ at TP=4). Tiny configs of their families go
through the same driver, subprocesses and stages, so the scripts the multi-GPU machines will
run are known to work end to end (their numbers here mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_multi_set_dry_run_covers_pp_ep_and_cp(tmp_path):
    out = tmp_path / "multi"
    cmd = [sys.executable, "-m", "benchmarks.workloads.tp", "--set", "multi", "--dry-run",
           "--stages", "none", "--modes", "nvlink", "--engines", "pp2,tp2-ep-v2lite,cp2-32k",
           "--budget-s", "300", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((out / "tp.json").read_text())
    assert rows and all(r["dry_run"] and r["mode"] == "nvlink" for r in rows)
    got = {(r["config"], r["metric"], r.get("workload")): r for r in rows}
    w2 = got[("pp2", "total_tok_s", "W2")]
    assert w2["value"] > 0 and len(w2["stage_utilisation"]) == 2
    assert all(0 < u <= 1 for u in w2["stage_utilisation"])
    assert got[("tp2-ep-v2lite", "decode_tok_s", "W1")]["value"] > 0
    assert got[("tp2-ep-v2lite", "total_tok_s", "W2")]["value"] > 0
    assert got[("cp2-32k", "ttft_ms", "TTFT-32768")]["value"] > 0
    assert "profile-decode: skipped in a dry run" in done.stdout


@pytest.mark.slow
def test_big_set_dry_run_runs_v3_at_eight_ranks_and_gptq_at_four(tmp_path):
    out = tmp_path / "big"
    cmd = [sys.executable, "-m", "benchmarks.workloads.tp", "--set", "big", "--dry-run",
           "--stages", "none",
           "--engines", "v3-fp8-ep8,pcie-emulated:qwen72b-gptq-tp4-hostmem-int8",
           "--budget-s", "500", "--engine-cap-s", "240", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((out / "tp.json").read_text())
    got = {(r["mode"], r["config"], r["metric"], r.get("workload")): r for r in rows}
    for mode, config, tp in (("nvlink", "v3-fp8-ep8", 8),
                             ("pcie-emulated", "qwen72b-gptq-tp4-hostmem-int8", 4)):  # fmt: skip
        w1 = got[(mode, config, "decode_tok_s", "W1")]
        assert w1["value"] > 0 and w1["tp"] == tp and w1["dry_run"]
        assert got[(mode, config, "ttft_ms", "TTFT-2048")]["value"] > 0
        assert got[(mode, config, "decode_step_ms", "decode-batch64")]["value"] > 0
