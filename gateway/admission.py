"""Admission control: at most N generation requests in flight at this gateway; past that, 429.

NOTE: without a bound, every request beyond what the workers can serve waits: in a worker's
queue (holding blocks reserved on a decode worker), as a task and a connection here, for as long
as the overload lasts; memory and latency grow for everyone. With `--max-concurrent-requests N`
the request that would be the (N+1)th in flight is answered at once, before its body is read:
429 with `Retry-After`, in OpenAI's error shape, so that clients back off and retry (the
`openai` client does so by itself). What the workers queue is bounded by N per gateway.

A request is in flight from its arrival to the end of its response: a stream's last byte, or
its client's disconnect. The count needs no lock: one event loop runs the whole app.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import OpenAIError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RESUME_PREFIX = "/v1/streams/"  # GET: a resumed stream may generate too
RETRY_AFTER_S = 1  # a slot frees as soon as any request in flight ends: retry soon


class AdmissionLimit:
    """ASGI middleware bounding the POSTs to `GENERATION_PATHS` and the resumes in flight to
    `limit`."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[], None]) -> None:
        if limit < 1:
            raise ValueError(f"the limit of requests in flight must be >= 1, got {limit}")
        self.app = app
        self.limit = limit
        self.on_reject = on_reject
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        counted = scope["type"] == "http" and (
            (scope["method"] == "POST" and scope["path"] in GENERATION_PATHS)
            or (scope["method"] == "GET" and scope["path"].startswith(RESUME_PREFIX)))
        if not counted:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            self.on_reject()
            await overloaded(self.limit).response({"Retry-After": str(RETRY_AFTER_S)})(
                scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def overloaded(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The server is overloaded: {limit} requests are in flight, its limit. "
        f"Please retry after {RETRY_AFTER_S} s.",
        status=429, code="rate_limit_exceeded",
    )
