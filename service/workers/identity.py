"""Which worker answered: every unary gRPC answer of a worker carries trailing metadata `qkv-worker:
INDEX PID`, so that a client (and the tests) can tell the workers behind one port apart."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

__all__ = ["HEADER", "WorkerIdentity"]

HEADER = "qkv-worker"


class WorkerIdentity(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, index: int) -> None:
        self.metadata = ((HEADER, f"{index} {os.getpid()}"),)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, metadata = handler.unary_unary, self.metadata

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            context.set_trailing_metadata(metadata)
            return await inner(request, context)

        return handler._replace(unary_unary=answered)
