"""A request body as the OpenAI routes accept it, or the 4xx that says why not.

    at most `limit` bytes   413, counted as the body arrives: a missing or lying Content-Length
                            cannot make the gateway buffer more than the limit
    UTF-8                   400 (json.loads would guess UTF-16/32 from the bytes instead)
    strict JSON             400 for NaN/Infinity (not JSON), nesting deep enough to exhaust the
                            parser's recursion, integers longer than Python converts, and lone
                            surrogates (escaped as \\ud800: they cannot be encoded back into a
                            response, an error message naming the model included)
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from gateway.errors import OpenAIError

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt as text or ids is ~1 MiB
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs into one char


async def read_json_body(raw: Request, limit: int) -> Any:
    """The body parsed as JSON; OpenAIError (400 or 413) when it is not acceptable."""
    return parse_json(await read_body(raw, limit))


async def read_body(raw: Request, limit: int) -> bytes:
    """The raw body, at most `limit` bytes (413 beyond, without reading the rest)."""
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in raw.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # The client left mid-upload: nothing was started, and nobody reads the answer. An
        # OpenAIError ends the request quietly (no "Exception in ASGI application" traceback).
        raise OpenAIError("The client disconnected before sending the whole body.",
                          status=400, code="client_disconnected") from None
    return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(
            f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}.",
            code="invalid_encoding",
        ) from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise OpenAIError("Invalid JSON body: nested too deeply.") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an over-long integer
        raise OpenAIError(f"Invalid JSON body: {exc}") from None
    if "\\u" in text and _has_lone_surrogate(data):
        raise OpenAIError(
            "The request body is not valid UTF-8: it escapes a lone surrogate (\\ud800-\\udfff).",
            code="invalid_encoding",
        )
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether any string (key or value) holds a lone surrogate. Iterative: depth is no issue."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
    return False


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The request body is larger than the gateway accepts ({limit} bytes).",
        status=413, code="request_too_large",
    )
