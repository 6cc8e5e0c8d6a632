"""Triton's shared memory RPCs over gRPC: system shared memory (the regions of service/frontends/
shared_memory.py), and CUDA shared memory answered UNIMPLEMENTED (qkv has no GPU memory to share)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar, overload

import grpc
from grpc.aio import ServicerContext as Context

from service import protocol
from service.errors import ServingError
from service.frontends import shared_memory
from service.frontends.peers import Address, grpc_peer_uid
from service.frontends.security import BearerTokens

__all__ = ["SharedMemoryService"]

T = TypeVar("T")


class SharedMemoryService:
    """Triton's shared memory RPCs (service/frontends/shared_memory.py): system shared memory, and CUDA shared
    memory answered UNIMPLEMENTED. Served beside InferenceService, on the same service name."""

    def __init__(
        self, regions: shared_memory.SharedMemoryRegistry, tokens: BearerTokens, address: Callable[[], Address]
    ) -> None:
        self.regions, self.tokens, self.address = regions, tokens, address  # address: the server's (host, port)

    def _may_change(self, context: grpc.aio.ServicerContext, what: str) -> None:
        authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        host = shared_memory.peer_host(context.peer())
        shared_memory.check_may_change(
            host, authorization if isinstance(authorization, str) else None, self.tokens, what
        )

    @overload
    async def _call(self, context: Context, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...
    @overload
    async def _call(self, context: Context, fn: Callable[..., T], *args: Any) -> T: ...
    async def _call(self, context: Context, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result
        except ServingError as e:
            await context.abort(grpc.StatusCode[e.code], e.message)
            raise AssertionError("abort raises") from e  # grpc's abort raises, untyped

    async def _uid(self, context: grpc.aio.ServicerContext) -> int | None:
        """The local user of the peer, when it is one of this host's (service/frontends/peers.py): on a thread,
        as where the kernel has no sock_diag it is looked for in /proc/net/tcp, 10-20 ms."""
        return await asyncio.to_thread(grpc_peer_uid, context.peer(), self.address())

    async def SystemSharedMemoryStatus(
        self, request: protocol.SystemSharedMemoryStatusRequest, context: Context
    ) -> protocol.SystemSharedMemoryStatusResponse:
        response = protocol.SystemSharedMemoryStatusResponse()
        caller = self.tokens.caller_of(context.invocation_metadata())
        for s in await self._call(context, self.regions.status, request.name, caller):
            response.regions[s.name].CopyFrom(response.RegionStatus(**vars(s)))
        return response

    async def SystemSharedMemoryRegister(
        self, request: protocol.SystemSharedMemoryRegisterRequest, context: Context
    ) -> protocol.SystemSharedMemoryRegisterResponse:
        await self._call(context, self._may_change, context, "registering shared memory")
        where = (request.name, request.key, request.offset, request.byte_size)
        uid, caller = await self._uid(context), self.tokens.caller_of(context.invocation_metadata())
        await self._call(context, self.regions.change, "register", *where, uid, caller)
        return protocol.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, request: protocol.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> protocol.SystemSharedMemoryUnregisterResponse:
        await self._call(context, self._may_change, context, "unregistering shared memory")
        caller = self.tokens.caller_of(context.invocation_metadata())
        await self._call(context, self.regions.change, "unregister", request.name, caller)
        return protocol.SystemSharedMemoryUnregisterResponse()

    async def _no_cuda(self, request: protocol.Message, context: Context) -> NoReturn:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, shared_memory.CUDA_UNIMPLEMENTED)
        raise AssertionError("abort raises")

    CudaSharedMemoryStatus = CudaSharedMemoryRegister = _no_cuda

    async def CudaSharedMemoryUnregister(
        self, request: protocol.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> protocol.CudaSharedMemoryUnregisterResponse:
        # Every region (no name): there is none, so done; Triton's examples begin so.
        if request.name:
            await self._no_cuda(request, context)
        return protocol.CudaSharedMemoryUnregisterResponse()
