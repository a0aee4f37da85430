"""A server of an earlier version for the tests: one that serves only some of a service's unary
methods (a kept-open call such as PrefillStreams is UNIMPLEMENTED there)."""

from __future__ import annotations

from typing import Any

import grpc


def add_unary_methods(server: grpc.aio.Server, service: str, servicer: Any,
                      methods: list[tuple[str, Any, Any]]) -> None:
    """Serve `servicer`'s methods named in `methods` ((name, request type, response type))
    under `service` on `server`, and nothing else of it."""
    handlers = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), request_deserializer=req.FromString,
        response_serializer=resp.SerializeToString) for name, req, resp in methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
