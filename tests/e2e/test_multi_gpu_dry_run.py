"""The two-GPU runner of pipeline, expert and context parallelism (benchmarks/workloads/tp.py
``--set multi``) dry-run on the CPU: tiny configs of its families through the same driver,
subprocesses and stages, so the script a two-GPU machine will run is known to work end to end
(its numbers here mean nothing)."""

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
