"""What the gateway's OpenAPI spec says about its routes: request bodies and error responses.

The OpenAI routes parse their bodies themselves (gateway/body.py: size limit, strict UTF-8 and
JSON, OpenAI-shaped errors), so FastAPI never sees the request models; `json_body` declares them
in the spec anyway, and `install_request_schemas` adds their schemas to its components. Clients
and the fuzz test (tests/test_fuzz_gateway.py) read the spec to know what to send.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from gateway.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Malformed or out-of-range request (the error's `param` names the field)",
    401: "Missing or wrong bearer API key",
    404: "Unknown model",
    409: "The LoRA adapter is in use: requests of it run or wait",
    413: "Request body larger than --max-body-bytes",
    429: "Too many requests queued: retry after the Retry-After header's seconds",
    500: "The server failed the request",
    503: "No worker can serve the request now: retry",
}


def error_responses(
    *statuses: int, described: dict[int, str] | None = None
) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these statuses, each with OpenAI's error body; `described`
    overrides the usual description of some."""
    text = {**_ERRORS, **(described or {})}
    return {s: {"model": ErrorResponse, "description": text[s]} for s in statuses}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra=` declaring a required JSON body of `model`."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` carry `models`' JSON schemas (and their nested models') under
    components/schemas, where `json_body`'s references point."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = build()
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            schema = model.model_json_schema(ref_template=_REF)
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
