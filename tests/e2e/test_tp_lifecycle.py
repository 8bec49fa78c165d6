"""Tensor parallelism on CPU starts and stops cleanly: an `LLM` going out of scope, used as a
context manager, interrupted by Ctrl-C (the engine serving on) or left to the interpreter's exit
ends every worker
process with exit code 0, with no tracebacks and no leaked semaphore or shared memory warnings.
A user's script killed by SIGTERM mid-generation exits with code 143, as cleanly, and leaves no
process of its own behind.

Tiny dummy weights (a preset's shapes cut down) keep the start-up short.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from lightwell import LLM, SamplingParams

    CFG = json.dumps({"preset": "llama-3-8b", "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "vocab_size": 256, "max_position_embeddings": 256, "bos_token_id": 1,
                      "eos_token_id": 2})

    def make():
        return LLM(load_format="dummy", hf_config_json=CFG, tensor_parallel_size=2,
                   num_threads=1, num_kv_blocks=16)

    def gen(llm, n=4):
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], p, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n

    def pids(llm):
        return " ".join(str(p.pid) for p in llm.engine.executor.procs)

    def running(pids):
        import os
        return [p for p in pids.split() if os.path.exists(f"/proc/{p}")]

    if __name__ == "__main__":
        llm = make(); gen(llm)
        ps = pids(llm)
        print("scope", ps, flush=True)
        del llm  # out of scope: its workers stop now
        print("scope-done", *running(ps), flush=True)
        with make() as llm:
            gen(llm)
            ps = pids(llm)
            print("with", ps, flush=True)
        print("with-done", *running(ps), flush=True)
        llm = make(); gen(llm)
        print("ready", pids(llm), flush=True)
        try:
            while True:  # until Ctrl-C
                gen(llm, 50)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        gen(llm)  # the workers ignored the Ctrl-C: the engine still serves
        print("exit", pids(llm), flush=True)  # left to the interpreter's exit
    """
)


def _run(tmp_path) -> tuple[int, str, str]:
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline, lines = time.time() + 300, []
        while not (lines and lines[-1].startswith("ready")) and time.time() < deadline:
            lines.append(proc.stdout.readline().strip())
            if proc.poll() is not None:
                break
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        out, err = proc.communicate(timeout=120)
    finally:  # a failed run leaves no process behind (they would spin on the shared cores)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, "\n".join(lines) + "\n" + out, err


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def _assert_clean(rc: int, out: str, err: str) -> None:
    assert rc == 0, err[-3000:]
    for bad in ("Traceback", "leaked", "terminate called", "Error", "unexpectedly"):
        assert bad not in err, err[-3000:]
    pids = [int(p) for line in out.splitlines() for p in line.split()[1:] if p.isdigit()]
    assert pids and all(_gone(p) for p in pids)


@pytest.mark.slow
def test_scope_context_manager_ctrl_c_and_exit(tmp_path):
    rc, out, err = _run(tmp_path)
    lines = out.splitlines()
    assert "scope-done" in lines and "with-done" in lines  # no worker left running
    assert "interrupted" in lines and lines[-1].startswith("exit")
    _assert_clean(rc, out, err)


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import json
    from lightwell import LLM, SamplingParams

    CFG = json.dumps({"preset": "llama-3-8b", "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "vocab_size": 256, "max_position_embeddings": 256})

    if __name__ == "__main__":
        llm = LLM(load_format="dummy", hf_config_json=CFG, tensor_parallel_size=2,
                  num_threads=1, num_kv_blocks=16)
        p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        print("ready", *(q.pid for q in llm.engine.executor.procs), flush=True)
        while True:  # until SIGTERM
            llm.generate([{"prompt_token_ids": [3, 4, 5]}], p, use_tqdm=False)
    """
)


def _session_processes(sid: int) -> list[int]:
    """Processes of session ``sid`` still running (zombies have exited)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


@pytest.mark.slow
def test_sigterm_ends_a_tp_script_and_all_its_workers(tmp_path):
    script = tmp_path / "tp_sigterm.py"
    script.write_text(SIGTERM_SCRIPT)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        ready = proc.stdout.readline().split()
        assert ready[:1] == ["ready"], proc.communicate(timeout=60)[1][-3000:]
        time.sleep(0.5)  # generating
        proc.send_signal(signal.SIGTERM)  # `kill PID`: the script's process only
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err[-3000:]
        for bad in ("Traceback", "leaked", "terminate called", "Error", "unexpectedly"):
            assert bad not in err, err[-3000:]
        workers = [int(p) for p in ready[1:]]
        assert len(workers) == 1 and all(_gone(p) for p in workers)
        deadline = time.time() + 10  # the resource tracker ends when it sees the script gone
        while _session_processes(proc.pid) and time.time() < deadline:
            time.sleep(0.1)
        assert _session_processes(proc.pid) == []
    finally:  # a failed run leaves no process behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
