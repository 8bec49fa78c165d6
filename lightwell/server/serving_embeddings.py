"""POST /v1/embeddings: texts or token ids -> pooled, normalised vectors (``--task embed``)."""

from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request

from lightwell.server.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from lightwell.server.serving_common import (
    ServingContext,
    bad_request,
    check_prompt_fits,
    collect,
    new_id,
    submit,
    until_disconnect,
)
from lightwell.types import PoolingParams, SamplingParams


async def create_embedding(
    ctx: ServingContext, req: EmbeddingRequest, raw: Request
) -> EmbeddingResponse:
    ctx.check_model(req.model)
    if ctx.engine.engine.task != "embed":
        raise bad_request(
            "this server generates text: start it with --task embed to serve embeddings",
            param="model",
        )
    prompts = [_token_ids(ctx, x) for x in req.input_list()]
    for p in prompts:
        check_prompt_fits(ctx, len(p), None, "input")
    try:
        params = SamplingParams(pooling=PoolingParams(dimensions=req.dimensions))
    except ValueError as e:
        raise bad_request(str(e), param="dimensions") from None
    streams = await submit(ctx, new_id("embd"), prompts, params, stream=False)
    finals = await until_disconnect(raw, collect(ctx, streams))
    data = [
        EmbeddingData(index=i, embedding=_encode(out.embedding or [], req.encoding_format))
        for i, out in enumerate(finals)
    ]
    tokens = sum(len(p) for p in prompts)
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return EmbeddingResponse(data=data, model=ctx.model_name, usage=usage)


def _token_ids(ctx: ServingContext, x: str | list[int]) -> list[int]:
    if isinstance(x, str):
        return ctx.tokenizer.encode(x)
    try:
        ctx.engine.engine.check_token_ids(x)
    except ValueError as e:
        raise bad_request(str(e), "input") from None
    return list(x)


def _encode(vector: list[float], encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
