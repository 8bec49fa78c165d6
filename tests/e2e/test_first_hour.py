"""A new user's first commands on the real SmolLM2: sensible defaults, errors before the load.

Bad options are refused in one line with exit code 2 before any model loads; truncated model
files are named in one line; Ctrl-C exits quietly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from lightwell.cli import CLI_FALLBACK_SAMPLING, main
from lightwell.engine.llm_engine import LLMEngine, load_generation_defaults
from lightwell.file_checks import check_gguf_file, check_safetensors_file
from lightwell.model_files import ModelFiles


def test_readme_first_command_answers(capsys):
    """`lightwell generate "What is the capital of France?"`: a right answer, thread count shown
    (logprobs asked for too, to share the load: greedy either way)."""
    argv = ["generate", "What is the capital of France?", "--max-tokens", "8"]
    assert main([*argv, "--logprobs", "2", "--prompt-logprobs", "1"]) == 0
    out, err = capsys.readouterr()
    text, _, tables = out.partition("-- prompt logprobs")
    assert "Paris" in text
    assert "1 CPU thread" in err and "loaded in" in err
    prompt, _, output = tables.partition("-- output [0] logprobs")
    rows = [line.split("\t") for line in output.strip().splitlines()[1:]]
    assert len(rows) == 8 and all(float(r[1]) <= 0 and int(r[2]) >= 1 for r in rows)
    assert "'<|im_start|>'" in prompt and "' France'" in prompt


def _engine_with(defaults: dict) -> LLMEngine:
    eng = LLMEngine.__new__(LLMEngine)  # the real method, without loading a model
    eng.generation_defaults = defaults
    return eng


def test_sampling_defaults_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7]})
    )
    files = ModelFiles("hf", str(tmp_path), "m")
    gen = load_generation_defaults(files)
    assert gen == {"temperature": 0.6, "top_p": 0.9, "eos_token_ids": [2, 7]}
    assert load_generation_defaults(files, "vllm") == {}
    assert load_generation_defaults(None, str(tmp_path))["temperature"] == 0.6
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_defaults(None, str(tmp_path / "nowhere"))
    # the model's values win over the CLI's fallback; options win over both
    gen.pop("eos_token_ids")  # as LLMEngine does
    eng = _engine_with(gen)
    assert eng.default_sampling_params(CLI_FALLBACK_SAMPLING).temperature == 0.6
    assert eng.default_sampling_params(CLI_FALLBACK_SAMPLING, temperature=0.1).temperature == 0.1
    # no sampling field in the model's config: the fallback (greedy) for generate / chat
    eng = _engine_with({})
    assert eng.default_sampling_params(CLI_FALLBACK_SAMPLING).temperature == 0.0
    assert eng.default_sampling_params().temperature == 1.0  # the API's OpenAI default


def _busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--temperature", "-1"], "temperature must be in"),
        (["generate", "--temperature", "nan"], "temperature must be in"),
        (["generate", "--temperature", "inf"], "temperature must be in"),
        (["generate", "--repetition-penalty", "inf"], "repetition_penalty must be in"),
        (["generate", "--top-p", "nan"], "top_p must be in"),
        (["generate", "--logit-bias", "{nope"], "--logit-bias must be a JSON object"),
        (["generate", "--logit-bias", '{"1": "x"}'], "--logit-bias must be a JSON object"),
        (["chat", "--max-tokens", "0"], "max_tokens must be"),
        (["generate", "--device", "cuda"], "--device cuda: PyTorch sees no CUDA GPU"),
        (["generate", "--num-threads", "0"], "num_threads must be >= 1"),
        (["serve", "--port", "70000"], "--port 70000"),
        (["generate", "--generation-config", "/nonexistent"], "no generation_config.json"),
        (["generate", "--skip-tokenizer-init"], "generate needs a tokenizer"),
        (["chat", "--load-format", "dummy", "--hf-config-json", "llama-3-8b"], "needs a tokenizer"),
    ],
)
def test_bad_options_fail_before_loading(argv, message, capsys):
    t0 = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "loading" not in err
    assert err.strip().count("\n") == 0, err
    assert time.perf_counter() - t0 < 10


def test_busy_port_fails_before_loading(capsys):
    with _busy_port() as sock:
        port = sock.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "another --port" in err


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["generate", "--device", "cpu", "--attention-backend", "triton"]) == 2
    assert "--attention-backend triton needs a CUDA GPU" in capsys.readouterr().err


@pytest.fixture(scope="module")
def truncated(smollm2_gguf, tmp_path_factory):
    """A GGUF cut inside its tensor data and one cut inside its header; a safetensors folder
    cut inside its data."""
    root = tmp_path_factory.mktemp("truncated")
    with open(smollm2_gguf, "rb") as f:
        head = f.read(4_000_000)
    (root / "data.gguf").write_bytes(head)
    (root / "header.gguf").write_bytes(head[:5000])
    st = root / "hf"
    st.mkdir()
    (st / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 16384]}})
    raw = header.encode()
    (st / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 1000)
    return root


def test_truncated_files_are_named_in_one_line(truncated, smollm2_gguf, capsys):
    check_gguf_file(smollm2_gguf)  # the real file passes
    with pytest.raises(ValueError, match="ends at byte .* but the file has 4000000 bytes"):
        check_gguf_file(str(truncated / "data.gguf"))
    with pytest.raises(ValueError, match="header ends early"):
        check_gguf_file(str(truncated / "header.gguf"))
    with pytest.raises(ValueError, match="the tensors end at byte"):
        check_safetensors_file(str(truncated / "hf" / "model.safetensors"))
    for model in ("data.gguf", "header.gguf", "hf"):
        assert main(["generate", "--model", str(truncated / model)]) == 2
        err = capsys.readouterr().err
        assert "truncated or corrupt" in err and "Traceback" not in err
        assert err.strip().splitlines()[1:] == [err.strip().splitlines()[-1]], err  # loading, error


def _reader(stream, sink: list[str]) -> threading.Thread:
    def run() -> None:
        for chunk in iter(lambda: stream.read(1), ""):
            sink.append(chunk)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_for(sink: list[str], text: str, timeout: float = 180, start: int = 0) -> None:
    deadline = time.time() + timeout
    while text not in "".join(sink)[start:]:
        assert time.time() < deadline, "".join(sink)[-2000:]
        time.sleep(0.05)


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_session():
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "lightwell.cli", "chat", "--max-tokens", "400", "--ignore-eos"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        text=True,
    )  # fmt: skip
    out: list[str] = []
    err: list[str] = []
    _reader(proc.stdout, out), _reader(proc.stderr, err)
    _wait_for(out, "> ")
    start = len("".join(out))
    proc.stdin.write("Count from one to one hundred.\n")
    proc.stdin.flush()
    _wait_for(out, ",", start=start)  # the answer is streaming
    proc.send_signal(signal.SIGINT)
    _wait_for(err, "[interrupted]", 60)
    before = len("".join(out))
    proc.stdin.write("What is the capital of France?\n")  # the session goes on
    proc.stdin.flush()
    deadline = time.time() + 120
    while "Paris" not in "".join(out)[before:]:
        assert time.time() < deadline and proc.poll() is None, "".join(out)[-500:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    deadline = time.time() + 60
    while "".join(err).count("[interrupted]") < 2:
        assert time.time() < deadline, "".join(err)[-500:]
        time.sleep(0.05)
    proc.stdin.write("/exit\n")
    proc.stdin.flush()
    assert proc.wait(60) == 0
    assert "Traceback" not in "".join(err) and "KeyboardInterrupt" not in "".join(err)
