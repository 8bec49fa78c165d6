"""Embeddings vs HF transformers (fp32, CPU) on tiny random checkpoints: a bare Qwen3Model
(Qwen3-Embedding's architecture, task auto -> embed) and a generative Llama served with
task="embed"; last-token and mean pooling, chunked prefill, dimensions, normalisation."""

from __future__ import annotations

import pytest
import torch

from lightwell import LLM
from lightwell.types import PoolingParams, SamplingParams
from tests.models.tiny import hf_tiny_model, randomize, save_hf, tiny_config

PROMPTS = [[5, 9, 17, 33, 2, 71, 8, 120, 44, 3, 19, 250], [7, 7, 64], list(range(40, 61))]
# an 8-token step budget: the longer prompts are pooled over several prefill chunks
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=16, max_num_batched_tokens=8)


def _qwen3_embedding(folder: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        architectures=["Qwen3Model"],
    )
    torch.manual_seed(0)
    model = Qwen3Model(config).eval()
    randomize(model, 1)
    save_hf(model, folder)
    return model


@torch.no_grad()
def _hf_states(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:  # [L, H]
    return model(torch.tensor([ids])).last_hidden_state[0].float()


def _unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=0)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_embedding"))
    hf = _qwen3_embedding(folder)
    llm = LLM(folder, skip_tokenizer_init=True, **ENGINE)
    yield hf, llm
    llm.engine.shutdown()


def test_qwen3_model_last_and_mean_pooling_match_hf(qwen3):
    hf, llm = qwen3
    assert llm.engine.task == "embed"
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    last = llm.embed(prompts, use_tqdm=False)
    mean = llm.embed(prompts, PoolingParams(pooling="mean"), use_tqdm=False)
    for ids, a, b in zip(PROMPTS, last, mean):
        states = _hf_states(hf, ids)
        torch.testing.assert_close(torch.tensor(a.embedding), _unit(states[-1]), atol=2e-5, rtol=0)
        torch.testing.assert_close(
            torch.tensor(b.embedding), _unit(states.mean(0)), atol=2e-5, rtol=0
        )
    assert llm.engine.scheduler.num_free_blocks == llm.engine.num_kv_blocks


def test_dimensions_and_unnormalised(qwen3):
    hf, llm = qwen3
    (out,) = llm.embed(
        [{"prompt_token_ids": PROMPTS[0]}],
        PoolingParams(dimensions=16, normalize=False),
        use_tqdm=False,
    )
    want = _hf_states(hf, PROMPTS[0])[-1, :16]
    torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(), use_tqdm=False)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_generative_checkpoint_served_with_task_embed(tmp_path, async_scheduling):
    hf = hf_tiny_model(tiny_config())
    save_hf(hf, str(tmp_path))
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        task="embed",
        pooling="mean",
        async_scheduling=async_scheduling,
        **ENGINE,
    )
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS[:2]], use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        want = _unit(_hf_states(hf.model, ids).mean(0))
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=0)
    llm.engine.shutdown()


def test_v1_embeddings_with_the_openai_sdk(qwen3):
    """/v1/embeddings in process (ASGI): token-id inputs, a batch, float and base64 (the SDK's
    default, decoded by it), dimensions, and a generation request refused by an embed server."""
    import asyncio

    import httpx
    import openai

    from lightwell.engine.async_engine import AsyncEngine
    from lightwell.server.api_server import build_app
    from lightwell.server.metrics import ServerMetrics

    hf, llm = qwen3
    metrics = ServerMetrics("emb")
    engine = AsyncEngine(llm.engine, on_finished=metrics.observe_finished)
    metrics.attach(lambda: engine.stats)
    app = build_app(engine, "emb", metrics)

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="-", http_client=http)
        batch = await client.embeddings.create(model="emb", input=PROMPTS[:2])  # base64
        floats = await client.embeddings.create(
            model="emb", input=PROMPTS[0], encoding_format="float", dimensions=8
        )
        with pytest.raises(openai.BadRequestError, match="does not generate"):
            await client.completions.create(model="emb", prompt=[1, 2], max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="dimensions=999"):
            await client.embeddings.create(model="emb", input=[1, 2], dimensions=999)
        await http.aclose()
        return batch, floats

    try:
        batch, floats = asyncio.run(run())
    finally:
        engine.shutdown(timeout=5)
    assert [d.index for d in batch.data] == [0, 1]
    assert batch.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    for ids, d in zip(PROMPTS, batch.data):
        want = _unit(_hf_states(hf, ids)[-1])
        torch.testing.assert_close(torch.tensor(d.embedding), want, atol=2e-5, rtol=0)
    want = _unit(_hf_states(hf, PROMPTS[0])[-1, :8])
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), want, atol=2e-5, rtol=0)
