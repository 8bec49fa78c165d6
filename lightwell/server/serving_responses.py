"""POST /v1/responses: OpenAI's Responses API for plain text generation (no tools, no stored
state, not streamed), through the chat template and the same engine path as chat."""

from __future__ import annotations

from starlette.requests import Request

from lightwell.server.protocol_responses import (
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
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
from lightwell.types import FinishReason


async def create_response(
    ctx: ServingContext, req: ResponsesRequest, raw: Request
) -> ResponseObject:
    ctx.check_model(req.model)
    try:
        prompt_ids = ctx.tokenizer.apply_chat_template(req.messages(), add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - Jinja raises its own types; all are the client's
        raise bad_request(f"could not apply the chat template: {e}", param="input") from None
    check_prompt_fits(ctx, len(prompt_ids), req.max_output_tokens, "input")
    overrides = {"temperature": req.temperature, "top_p": req.top_p}
    kw = {k: v for k, v in overrides.items() if v is not None}
    try:
        params = ctx.engine.engine.default_sampling_params(max_tokens=req.max_output_tokens, **kw)
    except ValueError as e:
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
    response_id = new_id("resp")
    streams = await submit(ctx, response_id, [prompt_ids], params, stream=False)
    (final,) = await until_disconnect(raw, collect(ctx, streams))
    c = final.outputs[0]
    cut = c.finish_reason == FinishReason.LENGTH
    status = "incomplete" if cut else "completed"
    message = OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text=c.text)])
    n_in, n_out = len(final.prompt_token_ids), len(c.token_ids)
    return ResponseObject(
        id=response_id,
        status=status,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
        model=ctx.model_name,
        output=[message],
        usage=ResponseUsage(
            input_tokens=n_in,
            output_tokens=n_out,
            total_tokens=n_in + n_out,
            input_tokens_details={"cached_tokens": final.num_cached_tokens},
        ),
        temperature=req.temperature,
        top_p=req.top_p,
        max_output_tokens=req.max_output_tokens,
        instructions=req.instructions,
    )
