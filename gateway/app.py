"""The gateway's FastAPI app: OpenAI routes over any `Backend`, health, readiness and metrics.

    app = build_app(LocalBackend(AsyncLLMEngine.from_args(path), "my-model"))
    uvicorn.run(app, host="0.0.0.0", port=8000)

The app does not own the backend: whoever built it closes it (`await backend.close()`).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from gateway.admission import AdmissionLimit
from gateway.backend import Backend
from gateway.body import DEFAULT_MAX_BODY_BYTES, read_json_body
from gateway.chat import ChatServing
from gateway.completions import CompletionServing
from gateway.errors import OpenAIError, from_validation_error, install_error_handlers
from gateway.lora import LoRAModels
from gateway.metrics import GatewayMetrics
from gateway.openapi import error_responses, install_request_schemas, json_body
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from gateway.responses.protocol import ResponseObject, ResponsesRequest
from gateway.responses.serving import ResponsesServing
from gateway.responses.store import MemoryResponses, ResponseStore
from gateway.resume import StreamResumer
from gateway.serving import ServingContext, StateStore, run_until_disconnect
from gateway.tokenize_api import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizeServing,
    VersionResponse,
    tokenize_model,
)
from gateway.tools.plan import ToolCallConfig
from pdserve import __version__
from pdserve.cluster.event_log import EventLog

M = TypeVar("M", bound=BaseModel)


def build_app(
    backend: Backend,
    store: StateStore | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_concurrent_requests: int = 0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    trust_request_chat_template: bool = False,
    metrics: GatewayMetrics | None = None,
    events: EventLog | None = None,
    tool_calls: ToolCallConfig | None = None,
    responses: ResponseStore | None = None,
    loras: LoRAModels | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `backend`'s model as `served_model_name` (default:
    the backend's model name). With `store`, every admitted request gets a state record. With
    `api_key`, /v1/*, /tokenize, /detokenize and /workers require `Authorization: Bearer
    <api_key>` (/health, /ready, /metrics and /version stay open). With
    `max_concurrent_requests`, generation requests past that many in flight get 429. Bodies
    over `max_body_bytes` get 413. A chat request's own `chat_template` (Jinja run on the
    server: a loop can hold a thread for hours) gets 400 unless `trust_request_chat_template`.
    `metrics`: the registry /metrics renders, when the backend counts into it too. With
    `events`, streams are recorded there and can be resumed (GET /v1/streams/{request_id}).
    `tool_calls`: whether tool_choice "auto" is served, and with which parser (default: not;
    "required" and a named function always are). `responses`: where /v1/responses keeps
    stored responses (default: in this process, an hour each). `loras`: the LoRA adapters served
    (--enable-lora): `model` may name one, /v1/models lists them, and POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter change them (gateway/lora.py)."""
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None)
    ctx = ServingContext(backend, metrics or GatewayMetrics(), store, served_model_name, events,
                         (tool_calls or ToolCallConfig()).auto_parser, loras)
    app.state.serving = ctx
    install_error_handlers(app)
    _add_openai_routes(app, ctx, api_key, max_body_bytes, trust_request_chat_template)
    _add_responses_routes(app, ResponsesServing(ctx, responses or MemoryResponses()),
                          api_key, max_body_bytes)
    _add_ops_routes(app, ctx)
    if loras is not None:
        _add_lora_routes(app, ctx, loras, api_key, max_body_bytes)
    install_request_schemas(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                                  TokenizeCompletionRequest, TokenizeChatRequest,
                                  DetokenizeRequest, LoadLoRAAdapterRequest,
                                  UnloadLoRAAdapterRequest])
    if max_concurrent_requests > 0:
        app.add_middleware(AdmissionLimit, limit=max_concurrent_requests,
                           on_reject=ctx.metrics.requests_rejected.inc)
    return app


def _generation_responses(body: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The spec's answers of a generation route: `body` as JSON, or SSE chunks when streamed."""
    event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    sse = {"text/event-stream": {"schema": event}}  # each event's data: a JSON chunk or [DONE]
    ok = {200: {"model": body, "description": "The completion", "content": sse}}
    return {**ok, **error_responses(400, 401, 404, 413, 429, 500, 503)}


def _add_openai_routes(
    app: FastAPI, ctx: ServingContext, api_key: str | None, max_body_bytes: int,
    trust_chat_template: bool,
) -> None:
    completions, chat = CompletionServing(ctx), ChatServing(ctx)
    auth = [Depends(_bearer_auth(api_key))]

    async def parse(raw: Request, model: type[M]) -> M:
        return _validate(await read_json_body(raw, max_body_bytes), model)

    @app.post("/v1/completions", dependencies=auth, openapi_extra=json_body(CompletionRequest),
              responses=_generation_responses(CompletionResponse))
    async def create_completion(raw: Request) -> Response:
        req = await parse(raw, CompletionRequest)
        return await run_until_disconnect(raw, completions.create(req))

    @app.post("/v1/chat/completions", dependencies=auth,
              openapi_extra=json_body(ChatCompletionRequest),
              responses=_generation_responses(ChatCompletionResponse))
    async def create_chat_completion(raw: Request) -> Response:
        req = await parse(raw, ChatCompletionRequest)
        _check_request_template(req.chat_template, trust_chat_template)
        return await run_until_disconnect(raw, chat.create(req))

    _add_resume_route(app, ctx, auth)
    _add_tokenizer_routes(app, ctx, auth, max_body_bytes, trust_chat_template)

    @app.get("/workers", dependencies=auth, responses=error_responses(401, 503))
    async def workers() -> Response:
        """The workers behind this gateway and their load (`pdserve status --gateway`)."""
        return JSONResponse({"workers": await ctx.backend.workers()})

    @app.get("/v1/models", dependencies=auth,
             responses={200: {"model": ModelList}, **error_responses(401, 503)})
    async def list_models() -> Response:
        facts = await ctx.backend.model_info()
        name = await ctx.model_name()
        cards = [ModelCard(id=name, root=facts.model_name, max_model_len=facts.max_model_len)]
        for m in await ctx.loras.modules() if ctx.loras is not None else []:
            cards.append(ModelCard(id=m.name, root=m.path, parent=m.base_model_name or name,
                                   max_model_len=facts.max_model_len))
        return JSONResponse(ModelList(data=cards).model_dump())


def _add_lora_routes(app: FastAPI, ctx: ServingContext, loras: LoRAModels,
                     api_key: str | None, max_body_bytes: int) -> None:
    """vLLM's runtime LoRA routes (gateway/lora.py), behind the API key; plain-text answers."""
    auth = [Depends(_bearer_auth(api_key))]
    errors = error_responses(400, 401, 404, 409, 413, 503)

    @app.post("/v1/load_lora_adapter", dependencies=auth, response_class=PlainTextResponse,
              openapi_extra=json_body(LoadLoRAAdapterRequest), responses=errors)
    async def load_lora_adapter(raw: Request) -> Response:
        """Load a LoRA adapter (on every worker) and serve it as model `lora_name`."""
        req = _validate(await read_json_body(raw, max_body_bytes), LoadLoRAAdapterRequest)
        message = await loras.load(req.lora_name, req.lora_path, await ctx.model_name())
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter", dependencies=auth, response_class=PlainTextResponse,
              openapi_extra=json_body(UnloadLoRAAdapterRequest), responses=errors)
    async def unload_lora_adapter(raw: Request) -> Response:
        """Stop serving a LoRA adapter; 409 while requests of it run or wait."""
        req = _validate(await read_json_body(raw, max_body_bytes), UnloadLoRAAdapterRequest)
        return PlainTextResponse(await loras.unload(req.lora_name))


def _check_request_template(template: str | None, trusted: bool) -> None:
    if template is not None and not trusted:
        raise OpenAIError(
            "chat_template in the request is refused: the server was not started with "
            "--trust-request-chat-template.", param="chat_template",
        )


def _add_tokenizer_routes(
    app: FastAPI, ctx: ServingContext, auth: list[Any], max_body_bytes: int,
    trust_chat_template: bool,
) -> None:
    """vLLM's /tokenize and /detokenize (gateway/tokenize_api.py), behind the API key."""
    serving = TokenizeServing(ctx)
    errors = error_responses(400, 401, 404, 413, 500, 503)
    either = {"anyOf": [json_body(m)["requestBody"]["content"]["application/json"]["schema"]
                        for m in (TokenizeCompletionRequest, TokenizeChatRequest)]}
    body = {"requestBody": {"required": True, "content": {"application/json": {"schema": either}}}}

    @app.post("/tokenize", dependencies=auth, openapi_extra=body,
              responses={200: {"model": TokenizeResponse}, **errors})
    async def tokenize(raw: Request) -> Response:
        """A prompt's token ids as /v1/completions gets them, or a conversation's (`messages`)
        after the chat template as /v1/chat/completions does."""
        data = await read_json_body(raw, max_body_bytes)
        req = _validate(data, tokenize_model(data))
        if isinstance(req, TokenizeChatRequest):
            _check_request_template(req.chat_template, trust_chat_template)
        return JSONResponse((await serving.tokenize(req)).model_dump())

    @app.post("/detokenize", dependencies=auth, openapi_extra=json_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **errors})
    async def detokenize(raw: Request) -> Response:
        """The text of token ids."""
        req = _validate(await read_json_body(raw, max_body_bytes), DetokenizeRequest)
        return JSONResponse((await serving.detokenize(req)).model_dump())


def _add_responses_routes(app: FastAPI, serving: ResponsesServing, api_key: str | None,
                          max_body_bytes: int) -> None:
    auth = [Depends(_bearer_auth(api_key))]

    @app.post("/v1/responses", dependencies=auth, openapi_extra=json_body(ResponsesRequest),
              responses=_generation_responses(ResponseObject))
    async def create_response(raw: Request) -> Response:
        """The Responses API (gateway/responses/): a conversation's next response, whole or
        streamed as typed events; function tools; `previous_response_id`."""
        req = _validate(await read_json_body(raw, max_body_bytes), ResponsesRequest)
        return await run_until_disconnect(raw, serving.create(req))

    @app.get("/v1/responses/{response_id}", dependencies=auth,
             responses={200: {"model": ResponseObject, "description": "A stored response"},
                        **error_responses(401, 404)})
    async def retrieve_response(response_id: str) -> Response:
        return await serving.retrieve(response_id)


def _add_resume_route(app: FastAPI, ctx: ServingContext, auth: list[Any]) -> None:
    resumer = StreamResumer(ctx)
    errors = error_responses(400, 401, 404, 503, described={
        404: "No such stream: unknown, not streamed, expired, or this gateway records none "
             "(no Redis)"})
    event = {"type": "object", "properties": {"id": {"type": "string"},
                                              "data": {"type": "string"}}}
    ok = {200: {"description": "The stream's events after the last one received",
                "content": {"text/event-stream": {"schema": event}}}}

    @app.get("/v1/streams/{request_id}", dependencies=auth, responses={**ok, **errors})
    async def resume_stream(
        raw: Request, request_id: str,
        header_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
        query_id: Annotated[str | None, Query(alias="last_event_id")] = None,
    ) -> Response:
        """Resume a streamed completion (or chat completion) through any gateway of the
        cluster: the SSE events after the `Last-Event-ID` header's (or `last_event_id`'s)
        event id, or all of them; the stream goes on to [DONE] as it would have."""
        after = _last_event_id(header_id if header_id is not None else query_id)
        return await run_until_disconnect(raw, resumer.resume(request_id, after))


def _last_event_id(value: str | None) -> int:
    """The client's last event id; -1 (none yet) when absent. 400 unless a number >= 0."""
    text = (value or "").strip()
    if not text:
        return -1
    if not (text.isascii() and text.isdecimal()) or len(text) > 18:
        raise OpenAIError(f"Last-Event-ID must be an event id (an integer >= 0), got "
                          f"{text[:40]!r}.", param="Last-Event-ID")
    return int(text)


def _add_ops_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health", response_class=Response)  # an empty 200: no media type in the spec
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready", responses={503: {"description": "Not ready: no model or no workers"}})
    async def ready() -> Response:
        try:
            is_ready = await ctx.backend.ready()
        except Exception:  # noqa: BLE001 - a backend that cannot answer is not ready
            is_ready = False
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    @app.get("/version", responses={200: {"model": VersionResponse}})
    async def version() -> Response:
        """pdserve's version."""
        return JSONResponse(VersionResponse(version=__version__).model_dump())

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        await ctx.metrics.refresh()
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _validate(data: Any, model: type[M]) -> M:
    """The parsed body as `model`: 400 naming the field for any validation error."""
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
