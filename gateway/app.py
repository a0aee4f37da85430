"""The gateway's FastAPI app: OpenAI routes over any `Backend`, health, readiness and metrics.

    app = build_app(LocalBackend(AsyncLLMEngine.from_args(path), "my-model"))
    uvicorn.run(app, host="0.0.0.0", port=8000)

The app does not own the backend: whoever built it closes it (`await backend.close()`).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from gateway.backend import Backend
from gateway.chat import ChatServing
from gateway.completions import CompletionServing
from gateway.errors import OpenAIError, from_validation_error, install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.serving import ServingContext, StateStore, run_until_disconnect

M = TypeVar("M", bound=BaseModel)


def build_app(
    backend: Backend,
    store: StateStore | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `backend`'s model as `served_model_name` (default:
    the backend's model name). With `store`, every admitted request gets a state record. With
    `api_key`, /v1/* requires `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None)
    ctx = ServingContext(backend, GatewayMetrics(), store, served_model_name)
    app.state.serving = ctx
    install_error_handlers(app)
    _add_openai_routes(app, ctx, api_key)
    _add_ops_routes(app, ctx)
    return app


def _add_openai_routes(app: FastAPI, ctx: ServingContext, api_key: str | None) -> None:
    completions, chat = CompletionServing(ctx), ChatServing(ctx)
    auth = [Depends(_bearer_auth(api_key))]

    @app.post("/v1/completions", dependencies=auth)
    async def create_completion(raw: Request) -> Response:
        req = await _parse(raw, CompletionRequest)
        return await run_until_disconnect(raw, completions.create(req))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def create_chat_completion(raw: Request) -> Response:
        req = await _parse(raw, ChatCompletionRequest)
        return await run_until_disconnect(raw, chat.create(req))

    @app.get("/workers", dependencies=auth)
    async def workers() -> Response:
        """The workers behind this gateway and their load (`pdserve status --gateway`)."""
        return JSONResponse({"workers": await ctx.backend.workers()})

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> Response:
        facts = await ctx.backend.model_info()
        name = await ctx.model_name()
        card = ModelCard(id=name, root=facts.model_name, max_model_len=facts.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())


def _add_ops_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        try:
            is_ready = await ctx.backend.ready()
        except Exception:  # noqa: BLE001 - a backend that cannot answer is not ready
            is_ready = False
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _parse(raw: Request, model: type[M]) -> M:
    """The request body as `model`: 400 for malformed JSON or any validation error."""
    body = await raw.body()
    try:
        data: Any = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"Invalid JSON body: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _bearer_auth(api_key: str | None) -> Any:
    async def check(raw: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = raw.headers.get("authorization", "").partition(" ")
        valid = secrets.compare_digest(token.strip().encode(), api_key.encode())
        if scheme.lower() != "bearer" or not valid:
            raise OpenAIError("Invalid API key.", status=401, code="invalid_api_key")

    return check
