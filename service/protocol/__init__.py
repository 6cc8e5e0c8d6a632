"""The open v2 inference protocol (KServe / Triton) as protobuf classes and gRPC plumbing.

The messages come from ``inference.binpb``, the descriptor set ``proto/generate.py`` compiles
from ``proto/*.proto``, loaded into a private descriptor pool. Generated ``_pb2`` modules would
register ``inference.*`` in protobuf's process-wide default pool, where tritonclient registers
the same names: the second import fails with "duplicate symbol". A private pool lets the
server, its tests and tritonclient share one process.

    from service import protocol
    request = protocol.ModelInferRequest(model_name="g2p")
    server.add_generic_rpc_handlers((protocol.generic_handler(servicer),))
    response = await protocol.Stub(channel).ModelInfer(request)
"""

from __future__ import annotations

import enum
import inspect
import traceback
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

__all__ = [
    "ORCA_SERVICE",
    "ORCA_SERVICE_NAME",
    "POOL",
    "SERVICE",
    "SERVICE_NAME",
    "CudaSharedMemoryUnregisterRequest",
    "CudaSharedMemoryUnregisterResponse",
    "DataType",
    "InferBatchStatistics",
    "InferParameter",
    "InferStatistics",
    "InferTensorContents",
    "Message",
    "ModelConfig",
    "ModelConfigRequest",
    "ModelConfigResponse",
    "ModelDynamicBatching",
    "ModelInferRequest",
    "ModelInferResponse",
    "ModelInput",
    "ModelInstanceGroup",
    "ModelMetadataRequest",
    "ModelMetadataResponse",
    "ModelOutput",
    "ModelParameter",
    "ModelReadyRequest",
    "ModelReadyResponse",
    "ModelRepositoryParameter",
    "ModelStatistics",
    "ModelStatisticsRequest",
    "ModelStatisticsResponse",
    "ModelStreamInferResponse",
    "OrcaLoadReport",
    "OrcaLoadReportRequest",
    "RepositoryIndexRequest",
    "RepositoryIndexResponse",
    "RepositoryModelLoadRequest",
    "RepositoryModelLoadResponse",
    "RepositoryModelUnloadRequest",
    "RepositoryModelUnloadResponse",
    "ServerLiveRequest",
    "ServerLiveResponse",
    "ServerMetadataRequest",
    "ServerMetadataResponse",
    "ServerReadyRequest",
    "ServerReadyResponse",
    "StatisticDuration",
    "Stub",
    "SystemSharedMemoryRegisterRequest",
    "SystemSharedMemoryRegisterResponse",
    "SystemSharedMemoryStatusRequest",
    "SystemSharedMemoryStatusResponse",
    "SystemSharedMemoryUnregisterRequest",
    "SystemSharedMemoryUnregisterResponse",
    "Undecodable",
    "generic_handler",
    "message_class",
    "method_handlers",
]

PACKAGE = "inference"
SERVICE_NAME = f"{PACKAGE}.GRPCInferenceService"
_DESCRIPTOR_SET = "inference.binpb"


def _load_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    data = resources.files(__name__).joinpath(_DESCRIPTOR_SET).read_bytes()
    # --include_imports orders the files so that each comes after its dependencies.
    for file in descriptor_pb2.FileDescriptorSet.FromString(data).file:
        pool.AddSerializedFile(file.SerializeToString())
    # The other services a qkv server exposes, so that server reflection, which describes
    # services from this pool, can describe them too. Their names do not collide with anything.
    for module in (health_pb2, reflection_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool


POOL = _load_pool()
SERVICE: ServiceDescriptor = POOL.FindServiceByName(SERVICE_NAME)
ORCA_SERVICE_NAME = "xds.service.orca.v3.OpenRcaService"  # load reports for gRPC's balancers (gRFC A51)
ORCA_SERVICE: ServiceDescriptor = POOL.FindServiceByName(ORCA_SERVICE_NAME)


@cache
def message_class(name: str) -> type[Message]:
    """The message class for ``name``: ``"ModelInferRequest"``, ``"ModelInferRequest.InferInputTensor"``
    (both in the ``inference`` package) or a full name such as ``"grpc.health.v1.HealthCheckRequest"``."""
    for full_name in (name, f"{PACKAGE}.{name}"):
        try:
            descriptor: Descriptor = POOL.FindMessageTypeByName(full_name)
        except KeyError:
            continue
        cls: type[Message] = message_factory.GetMessageClass(descriptor)
        return cls
    raise KeyError(f"no message {name!r} in the inference protocol")


# The classes, built from the pool at run time; the type checker reads them from _messages.pyi, which
# proto/stubs.py writes from the same descriptor set (tests/protocol keeps it up to date).
if TYPE_CHECKING:
    from service.protocol._messages import (
        CudaSharedMemoryUnregisterRequest,
        CudaSharedMemoryUnregisterResponse,
        InferBatchStatistics,
        InferParameter,
        InferStatistics,
        InferTensorContents,
        ModelConfig,
        ModelConfigRequest,
        ModelConfigResponse,
        ModelDynamicBatching,
        ModelInferRequest,
        ModelInferResponse,
        ModelInput,
        ModelInstanceGroup,
        ModelMetadataRequest,
        ModelMetadataResponse,
        ModelOutput,
        ModelParameter,
        ModelReadyRequest,
        ModelReadyResponse,
        ModelRepositoryParameter,
        ModelStatistics,
        ModelStatisticsRequest,
        ModelStatisticsResponse,
        ModelStreamInferResponse,
        OrcaLoadReport,
        OrcaLoadReportRequest,
        RepositoryIndexRequest,
        RepositoryIndexResponse,
        RepositoryModelLoadRequest,
        RepositoryModelLoadResponse,
        RepositoryModelUnloadRequest,
        RepositoryModelUnloadResponse,
        ServerLiveRequest,
        ServerLiveResponse,
        ServerMetadataRequest,
        ServerMetadataResponse,
        ServerReadyRequest,
        ServerReadyResponse,
        StatisticDuration,
        SystemSharedMemoryRegisterRequest,
        SystemSharedMemoryRegisterResponse,
        SystemSharedMemoryStatusRequest,
        SystemSharedMemoryStatusResponse,
        SystemSharedMemoryUnregisterRequest,
        SystemSharedMemoryUnregisterResponse,
    )
    from service.protocol._messages import _Message as Message
else:
    from google.protobuf.message import Message  # every message class's base

    # Health and metadata
    ServerLiveRequest = message_class("ServerLiveRequest")
    ServerLiveResponse = message_class("ServerLiveResponse")
    ServerReadyRequest = message_class("ServerReadyRequest")
    ServerReadyResponse = message_class("ServerReadyResponse")
    ModelReadyRequest = message_class("ModelReadyRequest")
    ModelReadyResponse = message_class("ModelReadyResponse")
    ServerMetadataRequest = message_class("ServerMetadataRequest")
    ServerMetadataResponse = message_class("ServerMetadataResponse")
    ModelMetadataRequest = message_class("ModelMetadataRequest")
    ModelMetadataResponse = message_class("ModelMetadataResponse")
    # Inference
    InferParameter = message_class("InferParameter")
    InferTensorContents = message_class("InferTensorContents")
    ModelInferRequest = message_class("ModelInferRequest")
    ModelInferResponse = message_class("ModelInferResponse")
    ModelStreamInferResponse = message_class("ModelStreamInferResponse")
    # Triton extension: model configuration (model_config.proto)
    ModelConfigRequest = message_class("ModelConfigRequest")
    ModelConfigResponse = message_class("ModelConfigResponse")
    ModelConfig = message_class("ModelConfig")
    ModelInput = message_class("ModelInput")
    ModelOutput = message_class("ModelOutput")
    ModelDynamicBatching = message_class("ModelDynamicBatching")
    ModelInstanceGroup = message_class("ModelInstanceGroup")
    ModelParameter = message_class("ModelParameter")
    # Triton extension: statistics
    ModelStatisticsRequest = message_class("ModelStatisticsRequest")
    ModelStatisticsResponse = message_class("ModelStatisticsResponse")
    ModelStatistics = message_class("ModelStatistics")
    InferStatistics = message_class("InferStatistics")
    InferBatchStatistics = message_class("InferBatchStatistics")
    StatisticDuration = message_class("StatisticDuration")
    # Triton extension: model repository
    RepositoryIndexRequest = message_class("RepositoryIndexRequest")
    RepositoryIndexResponse = message_class("RepositoryIndexResponse")
    ModelRepositoryParameter = message_class("ModelRepositoryParameter")
    RepositoryModelLoadRequest = message_class("RepositoryModelLoadRequest")
    RepositoryModelLoadResponse = message_class("RepositoryModelLoadResponse")
    RepositoryModelUnloadRequest = message_class("RepositoryModelUnloadRequest")
    RepositoryModelUnloadResponse = message_class("RepositoryModelUnloadResponse")
    # Triton extension: system shared memory (CUDA shared memory's others: message_class, by name)
    CudaSharedMemoryUnregisterRequest = message_class("CudaSharedMemoryUnregisterRequest")
    CudaSharedMemoryUnregisterResponse = message_class("CudaSharedMemoryUnregisterResponse")
    SystemSharedMemoryStatusRequest = message_class("SystemSharedMemoryStatusRequest")
    SystemSharedMemoryStatusResponse = message_class("SystemSharedMemoryStatusResponse")
    SystemSharedMemoryRegisterRequest = message_class("SystemSharedMemoryRegisterRequest")
    SystemSharedMemoryRegisterResponse = message_class("SystemSharedMemoryRegisterResponse")
    SystemSharedMemoryUnregisterRequest = message_class("SystemSharedMemoryUnregisterRequest")
    SystemSharedMemoryUnregisterResponse = message_class("SystemSharedMemoryUnregisterResponse")
    # ORCA out-of-band load reports (proto/xds/)
    OrcaLoadReport = message_class("xds.data.orca.v3.OrcaLoadReport")
    OrcaLoadReportRequest = message_class("xds.service.orca.v3.OrcaLoadReportRequest")


class DataType(enum.IntEnum):
    """``inference.DataType`` of model_config.proto (a test keeps the two equal). The inference
    protocol itself names types by string: ``"FP32"`` is ``TYPE_FP32``, ``"BYTES"`` is ``TYPE_STRING``."""

    TYPE_INVALID = 0
    TYPE_BOOL = 1
    TYPE_UINT8 = 2
    TYPE_UINT16 = 3
    TYPE_UINT32 = 4
    TYPE_UINT64 = 5
    TYPE_INT8 = 6
    TYPE_INT16 = 7
    TYPE_INT32 = 8
    TYPE_INT64 = 9
    TYPE_FP16 = 10
    TYPE_FP32 = 11
    TYPE_FP64 = 12
    TYPE_STRING = 13
    TYPE_BF16 = 14


# (client_streaming, server_streaming) -> how to serve such a method.
_HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _classes(method: MethodDescriptor) -> tuple[type[Message], type[Message]]:
    request = message_factory.GetMessageClass(method.input_type)
    response = message_factory.GetMessageClass(method.output_type)
    return request, response


class Undecodable:
    """A request body that does not parse as the RPC's message. The server's handlers get this in its
    place: left to gRPC, the parse error would be answered UNKNOWN, with a traceback in the log."""

    def __init__(self, message: str, error: DecodeError) -> None:
        self.reason = f"the request is not a valid {message}: {error}"


def _lenient(request: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return request.FromString(data)
        except DecodeError as e:
            return Undecodable(request.DESCRIPTOR.name, e)

    return deserialize


def _refusing_undecodable(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """`behaviour` for a one-request RPC, with an undecodable request answered INVALID_ARGUMENT."""
    if inspect.iscoroutinefunction(behaviour):

        async def guarded(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            try:
                return await behaviour(request, context)
            except BaseException as e:
                # grpc keeps an aborted call's exception until the server's next call: its frames would
                # hold the request (up to --max-message-bytes) that long, so they let go of their locals.
                traceback.clear_frames(e.__traceback__)
                del request
                raise

        return guarded

    def guarded_sync(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return behaviour(request, context)

    return guarded_sync


def method_handlers(implementation: object, service: ServiceDescriptor = SERVICE) -> dict[str, grpc.RpcMethodHandler]:
    """Handlers for the RPCs of ``service`` (the inference service unless named) ``implementation`` has a
    method for, keyed by RPC name (``"ModelInfer"``).

    ``implementation.ModelInfer(request, context)`` receives and returns our message classes; it
    may be ``async`` (grpc.aio). RPCs it lacks are left out, so gRPC answers them UNIMPLEMENTED.
    A request that does not parse is answered INVALID_ARGUMENT before the method runs; on a
    client stream it arrives as an ``Undecodable``, for the method to refuse.
    For ``server.add_registered_method_handlers(SERVICE_NAME, ...)``.
    """
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        behaviour = getattr(implementation, method.name, None)
        if behaviour is None:
            continue
        request, response = _classes(method)
        make_handler = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make_handler(
            behaviour if method.client_streaming else _refusing_undecodable(behaviour),
            request_deserializer=_lenient(request),
            response_serializer=response.SerializeToString,
        )
    return handlers


def generic_handler(implementation: object, service: ServiceDescriptor = SERVICE) -> grpc.GenericRpcHandler:
    """``service`` (``inference.GRPCInferenceService`` unless named) served by ``implementation`` (see
    ``method_handlers``), for ``server.add_generic_rpc_handlers((generic_handler(servicer),))``."""
    return grpc.method_handlers_generic_handler(service.full_name, method_handlers(implementation, service))


class Stub:
    """Client callables for every RPC of the service, on a ``grpc.Channel`` or ``grpc.aio.Channel``:
    ``Stub(channel).ModelInfer(request, timeout=...)`` (awaited on an aio channel)."""

    # One attribute per RPC of SERVICE (a test keeps the list complete).
    ServerLive: Any
    ServerReady: Any
    ModelReady: Any
    ServerMetadata: Any
    ModelMetadata: Any
    ModelInfer: Any
    ModelStreamInfer: Any
    ModelConfig: Any
    ModelStatistics: Any
    RepositoryIndex: Any
    RepositoryModelLoad: Any
    RepositoryModelUnload: Any
    SystemSharedMemoryStatus: Any
    SystemSharedMemoryRegister: Any
    SystemSharedMemoryUnregister: Any
    CudaSharedMemoryStatus: Any
    CudaSharedMemoryRegister: Any
    CudaSharedMemoryUnregister: Any

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        for method in SERVICE.methods:
            request, response = _classes(method)
            make_callable = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[(method.client_streaming, method.server_streaming)]
            rpc = make_callable(
                f"/{SERVICE_NAME}/{method.name}",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
            setattr(self, method.name, rpc)
