"""Every failure as OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.

Handlers turn each kind of exception into its status: request mistakes 4xx (pydantic errors are
400, not FastAPI's 422; so is `RequestRejected`, the engine refusing the request), other
`BackendError`s 503 with `Retry-After` when retryable else 500, anything unexpected 500 with a
generic message; the stack trace goes to the log, never into the body.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from gateway.backend import BackendError, RequestRejected
from gateway.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)
# A retryable backend failure (no worker free, the registry unreachable) is answered 503 with
# `Retry-After`: heartbeats re-register workers within about a second of Redis coming back.
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """A request that cannot be served, with the HTTP status and OpenAI fields to answer."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def info(self) -> ErrorInfo:
        return ErrorInfo(
            message=self.message, type=error_type(self.status), param=self.param, code=self.code
        )

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = ErrorResponse(error=self.info()).model_dump()
        return JSONResponse(body, status_code=self.status, headers=headers)


def error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """400 naming the first offending field (its top-level name is the `param`)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(loc)
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return OpenAIError(message, param=loc[0] if loc else None)


def from_backend_error(exc: BackendError) -> OpenAIError:
    if isinstance(exc, RequestRejected):  # the engine refused the request as given
        return OpenAIError(str(exc))
    if exc.retryable:
        return OpenAIError(
            f"The server is temporarily unable to serve the request: {exc}. Please retry.",
            status=503,
            code="service_unavailable",
        )
    return OpenAIError(f"The server failed to generate a response: {exc}", status=500)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that answer every error in OpenAI's shape."""

    async def on_openai(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (ValidationError, RequestValidationError))
        return from_validation_error(exc).response()

    async def on_backend(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BackendError)
        logger.warning("backend error: %s (retryable=%s)", exc, exc.retryable)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.retryable else None
        return from_backend_error(exc).response(headers)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        return OpenAIError(message, status=exc.status_code).response(exc.headers)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises `exc` after this answer, so the server logs its traceback.
        return OpenAIError("Internal server error", status=500).response()

    app.add_exception_handler(OpenAIError, on_openai)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(BackendError, on_backend)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
