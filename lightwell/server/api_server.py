"""The FastAPI app: OpenAI-compatible routes, errors in OpenAI's envelope, metrics, health.

Every failure is answered as ``{"error": {"message", "type", "param", "code"}}``: invalid input
is a 400 (never FastAPI's 422), a missing or wrong key 401 on every /v1 route when an API key is
set, an unknown model 404, a dead engine 503. Nothing a client sends produces a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightwell import __version__
from lightwell.engine.async_engine import AsyncEngine, EngineDeadError
from lightwell.server.limits import LimitsMiddleware, ServerLimits, TooBusy, cors_origins, limited
from lightwell.server.metrics import ServerMetrics
from lightwell.server.observability import RequestContextMiddleware
from lightwell.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ParamError,
    TokenizeRequest,
    TokenizeResponse,
)
from lightwell.server.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from lightwell.server.protocol_responses import ResponseObject, ResponsesRequest
from lightwell.server.serving_chat import chat_prompt_ids, create_chat_completion
from lightwell.server.serving_common import APIError, ServingContext, bad_request, engine_dead
from lightwell.server.serving_completions import create_completion
from lightwell.server.serving_embeddings import create_embedding
from lightwell.server.serving_responses import create_response

logger = logging.getLogger("lightwell.server")

# Pydantic's tags for the member of a union that failed; not field names.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 503)
}


def build_app(
    engine: AsyncEngine,
    model_name: str,
    metrics: ServerMetrics,
    api_key: str | None = None,
    stats_interval: float = 10.0,
    tool_call_parser: str = "auto",
    aliases: tuple[str, ...] = (),
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The app serving ``engine`` as ``model_name`` (and ``aliases``, also accepted and
    listed); ``metrics`` must be attached to it."""
    limits = limits or ServerLimits()
    ctx = ServingContext(engine, model_name, tool_call_parser, tuple(aliases), limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(metrics.log_periodically(stats_interval))
        yield
        task.cancel()

    app = FastAPI(title="Lightwell", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(LimitsMiddleware, api_key=api_key, limits=limits, metrics_path="/metrics")
    app.add_middleware(RequestContextMiddleware, metrics=metrics)  # outside: counts the above
    if cors_origins(limits):
        app.add_middleware(
            CORSMiddleware, allow_origins=cors_origins(limits), allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    _add_error_handlers(app)
    app.include_router(_v1_router(ctx, api_key))
    app.include_router(_misc_router(ctx, metrics))
    return app


def _v1_router(ctx: ServingContext, api_key: str | None) -> APIRouter:
    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    router = APIRouter(prefix="/v1", dependencies=[Depends(check_key)], responses=_ERRORS)

    @router.post("/completions", responses={200: {"model": CompletionResponse}})
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return _respond(await limited(ctx, create_completion(ctx, req, raw)))

    @router.post("/chat/completions", responses={200: {"model": ChatCompletionResponse}})
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return _respond(await limited(ctx, create_chat_completion(ctx, req, raw)))

    @router.post("/responses", response_model=ResponseObject)
    async def responses(req: ResponsesRequest, raw: Request) -> ResponseObject:
        return await create_response(ctx, req, raw)

    @router.post("/embeddings", response_model=EmbeddingResponse)
    async def embeddings(req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        return await create_embedding(ctx, req, raw)

    @router.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[_card(ctx, name) for name in (ctx.model_name, *ctx.aliases)])

    @router.get("/models/{model:path}", response_model=ModelCard)
    async def model(model: str) -> ModelCard:
        ctx.check_model(model)
        return _card(ctx, model)

    return router


def _misc_router(ctx: ServingContext, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter(responses=_ERRORS)

    @router.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_alive:
            raise engine_dead("the engine loop is not running")
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(req.model)
        if req.messages is not None:  # off the event loop, as the completions routes
            add_gen = req.add_generation_prompt is not False
            tokens = await asyncio.to_thread(chat_prompt_ids, ctx, req.messages, add_gen)
        else:
            special = req.add_special_tokens is not False
            tokens = await asyncio.to_thread(
                ctx.tokenizer.encode, req.prompt or "", add_special_tokens=special
            )
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens)

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(req.model)
        try:
            ctx.engine.engine.check_token_ids(req.tokens, "token ids")
        except ValueError as e:
            raise bad_request(str(e), param="tokens") from None
        text = await asyncio.to_thread(ctx.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)

    return router


class BannerServer(uvicorn.Server):
    """uvicorn's server, printing a start-up banner once the port is open."""

    def __init__(self, config: uvicorn.Config, banner: str) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)


def _card(ctx: ServingContext, name: str) -> ModelCard:
    # the served name, not the model's path on this machine
    return ModelCard(id=name, root=name, max_model_len=ctx.max_model_len)


def _respond(result: BaseModel | Response) -> Response:
    if isinstance(result, Response):
        return result
    return JSONResponse(result.model_dump(mode="json"))


# ---- errors ------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ParamError)
    async def param_error(request: Request, exc: ParamError) -> JSONResponse:
        err = bad_request(exc.message, exc.param)  # one found after the request's validation
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(TooBusy)
    async def too_busy(request: Request, exc: TooBusy) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        err = engine_dead(str(exc))
        return JSONResponse(err.body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 naming the offending field, from pydantic's list of errors."""
    first = errors[0]
    reason = (first.get("ctx") or {}).get("error")
    if isinstance(reason, ParamError):
        return bad_request(reason.message, reason.param)
    kind, param = first["type"], _param(first["loc"])
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {reason}")
    if param is None:
        return bad_request("the request body must be a JSON object")
    if kind == "extra_forbidden":
        return bad_request(
            f"unsupported request field '{param}': this server does not implement it and "
            "refuses it rather than ignore it",
            param,
        )
    if kind == "missing":
        return bad_request(f"missing required field '{param}'", param)
    msgs = []
    for e in errors:
        msg = str(e["msg"]).removeprefix("Value error, ")
        if _param(e["loc"]) == param and msg not in msgs:
            msgs.append(msg)
    return bad_request(f"invalid value for '{param}': " + "; or ".join(msgs[:4]), param)


def _param(loc: tuple | list) -> str | None:
    parts: list[str] = []
    for item in list(loc)[1:]:  # loc[0] is "body"
        if isinstance(item, str) and (item in _UNION_TAGS or "[" in item):
            break
        parts.append(str(item))
    return ".".join(parts) or None
