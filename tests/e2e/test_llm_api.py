"""The offline API on the real SmolLM2: bad input, n > 1, seeds, stops, logprobs, abort, CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from lightwell import LLM, FinishReason, SamplingParams

CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=64, num_threads=2)


def _ok(llm: LLM) -> None:
    """The engine still serves a normal request."""
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ({"prompt_token_ids": [1, 10**9]}, "out of range"),
        ({"prompt_token_ids": [5] * 9000}, "context is 8192 tokens"),
        ({"nothing": 1}, "prompt dict needs"),
    ],
)
def test_bad_prompts_are_refused_and_the_engine_goes_on(llm, prompt, message):
    free = llm.engine.scheduler.num_free_blocks
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.engine.scheduler.num_free_blocks == free
    _ok(llm)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop strings"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_out_of_vocab_logit_bias_refused(llm):
    with pytest.raises(ValueError, match="vocab size"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    _ok(llm)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model="/no/such/model")


def test_n_samples_share_prompt_blocks_and_differ(llm):
    hits = llm.engine.stats().prefix_cache_hits
    prompt = {"prompt_token_ids": llm.get_tokenizer().apply_chat_template(CHAT) * 3}
    out = llm.generate(
        prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # siblings 1 and 2 waited for sibling 0's prefill and reused its full prompt blocks
    full_blocks = (len(out.prompt_token_ids) - 1) // 16
    assert llm.engine.stats().prefix_cache_hits - hits >= 2 * full_blocks * 16


def test_seed_gives_the_same_text_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(3)]
    batch = llm.chat(
        others[:2] + [CHAT] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=16)] * 2
        + [sp]
        + [SamplingParams(max_tokens=16)],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone


def test_stop_string_is_cut_and_reported(llm):
    greedy = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    text = greedy.outputs[0].text
    stop = text[8:11]  # somewhere in the middle, likely across a token boundary
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop
    kept = llm.chat(
        CHAT,
        SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_length_finish_and_min_tokens(llm):
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == FinishReason.LENGTH
    eos = llm.get_tokenizer().eos_token_id
    long = llm.chat(
        CHAT, SamplingParams(temperature=0, min_tokens=60, max_tokens=60), use_tqdm=False
    )[0].outputs[0]
    assert len(long.token_ids) == 60 and eos not in long.token_ids


def test_logprobs_and_prompt_logprobs(llm):
    sp = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate("One, two, three,", sp, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for tok, pos in zip(comp.token_ids, comp.logprobs):
        first = next(iter(pos))
        assert first == tok and pos[tok].rank == 1  # greedy: the chosen token is the top one
        assert 3 <= len(pos) <= 4 and all(lp.logprob <= 0 for lp in pos.values())
    assert math.isclose(
        comp.cumulative_logprob,
        sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs)),
        rel_tol=1e-6,
    )
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, pos in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in pos


def test_abort_frees_every_block(llm):
    engine = llm.engine
    total = engine.scheduler.num_free_blocks
    rid = engine.add_request(None, "Write a long story.", SamplingParams(max_tokens=500))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_free_blocks < total
    final = engine.abort_request(rid)
    assert final.finished and final.outputs[0].finish_reason == FinishReason.ABORT
    assert engine.scheduler.num_free_blocks == total
    _ok(llm)


def test_cli_generate_streams_text():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightwell.cli",
            "generate",
            "What is 2+2?",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "--num-threads",
            "1",
            "--show-stats",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    assert "output 12 tokens" in run.stderr or "finish ['stop']" in run.stderr


def test_cli_reports_bad_input_cleanly():
    run = subprocess.run(
        [sys.executable, "-m", "lightwell.cli", "generate", "hi", "--top-p", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "top_p" in run.stderr and "Traceback" not in run.stderr


def test_step_trace_writes_a_line_per_step(tmp_path):
    """--step-trace: a JSON line per step that ran tokens; the tokens add up to every prompt
    token plus every output token but each request's last (never fed back), within the step
    budget, on the CPU's paths."""
    path = tmp_path / "steps.jsonl"
    traced = LLM(max_num_batched_tokens=16, num_threads=2, step_trace=str(path))
    prompts = [{"prompt_token_ids": list(range(100, 120))}, {"prompt_token_ids": [7] * 7}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = traced.generate(prompts, params, use_tqdm=False)
    traced.engine.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(r["tokens"] for r in rows) == 20 + 7 + 2 * 4
    assert max(r["tokens"] for r in rows) <= 16 and min(r["tokens"] for r in rows) >= 1
    # the 20-token prompt leaves the long-prefill reserve (4 of 16) to the prompt behind it
    assert (rows[0]["tokens"], rows[0]["new_requests"], rows[0]["waiting"]) == (16, 2, 0)
    assert sum(r["new_requests"] for r in rows) == 2
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    # prompt steps run eagerly, decode-only steps through the fused CPU decode (the default)
    assert {r["path"] for r in rows} == {"eager", "fused cpu"} and all(r["ms"] >= 0 for r in rows)
    assert rows[-1]["one_token_rows"] >= 1 and rows[-1]["running"] <= 2
    with pytest.raises(ValueError, match="step_trace: cannot write"):  # before the model loads
        LLM(step_trace=str(tmp_path / "missing" / "steps.jsonl"))


def test_eos_ids_outside_the_vocabulary_are_dropped(tmp_path, caplog):
    """A generation_config listing an EOS id the model cannot produce (999 of a 300-token
    vocabulary): min_tokens used to mask it as a logit column and fail the step; the id is
    dropped at start-up with a warning, and the in-vocabulary EOS still stops."""
    from tests.models.families import mistral

    mistral(str(tmp_path), 3)
    gen_path = tmp_path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [2, 999]
    gen_path.write_text(json.dumps(gen))
    with caplog.at_level("WARNING"):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=32)
    assert any("EOS ids [999]" in r.getMessage() for r in caplog.records)
    engine = llm.engine
    assert (engine.eos_token_id, engine._extra_eos) == (2, [])  # 2 listed once, 999 dropped
    sp = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)[0].outputs[0]
    assert 3 <= len(out.token_ids) <= 5
    engine.shutdown()


# ---- structured output -------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def test_json_schema_output_validates_greedy_and_n2(llm):
    import jsonschema

    so = {"json": PERSON}
    outs = llm.chat(
        [ASK, ASK],
        [
            SamplingParams(temperature=0, max_tokens=48, structured_outputs=so),
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=48, structured_outputs=so),
        ],
        use_tqdm=False,
    )
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 3 and len(set(texts[1:])) == 2  # the two samples differ
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == FinishReason.STOP, c.text
            jsonschema.validate(json.loads(c.text), PERSON)
    assert not llm.engine.structured.matchers  # every matcher is released with its request


@pytest.mark.parametrize(
    "so,check",
    [
        ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, r"[0-9]{3}-[a-z]{2,5}"),
        ({"choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ({"grammar": 'root ::= "(" [a-z]+ ("," [a-z]+)? ")"'}, r"\([a-z]+(,[a-z]+)?\)"),
    ],
)
def test_regex_choice_and_grammar_outputs_match(llm, so, check):
    import re

    sp = SamplingParams(temperature=0.7, seed=1, max_tokens=16, structured_outputs=so)
    c = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == FinishReason.STOP and re.fullmatch(check, c.text), c.text


def test_uncompilable_schema_is_refused_before_queueing(llm):
    free = llm.engine.scheduler.num_free_blocks
    sp = SamplingParams(structured_outputs={"json": {"type": "objectx"}})
    with pytest.raises(ValueError, match='invalid JSON schema: Unsupported type "objectx"'):
        llm.chat(CHAT, sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.num_free_blocks == free
    stats = llm.engine.structured.stats
    assert stats.compiles >= 4 and stats.cache_hits >= 2  # n=2 and greedy share one grammar
    _ok(llm)
