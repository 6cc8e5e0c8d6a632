"""The gRPC server: the v2 inference service, health, reflection, metrics, drain.

Each RPC method decodes the protobuf request, awaits the protocol-free model (service/models/kinds.py)
and encodes the answer. Models are loaded before the port opens; a model that fails to load
stops the start. Who may call it (TLS, bearer tokens) is service/frontends/security.py.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from ipaddress import ip_address
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import __version__, priority, protocol
from service.config import ServerSettings
from service.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ServingError,
    Unavailable,
    clip,
    quote,
)
from service.frontends import shared_memory
from service.frontends.codec import decode_tensor, element_count
from service.frontends.security import BearerTokens, TokenAuth, bearer_tokens, server_credentials, ssl_context
from service.models.kinds import ModelStats, TensorModel
from service.observability import logs
from service.observability.metrics import UNKNOWN_MODEL, Metrics, seq_len_bucket
from service.repository.layout import RepositoryError, parse_config
from service.serving.registry import (
    BATCHING_SHOWN,
    READY,
    UNAVAILABLE,
    Model,
    ModelRegistry,
    one_malloc_arena,
    return_freed_memory,
)

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import Tracing

__all__ = ["Server", "serve"]

log = logging.getLogger("qkv.server")

HEALTH_SERVICE = "grpc.health.v1.Health"
MAX_PARAMETERS = 64  # a request's parameters, at most (qkv reads a handful; HTTP adds a few of Triton's)
# A request with more input elements than this is decoded on a worker thread, so that the event loop
# answers others (and health checks) meanwhile; smaller ones cost less than the thread hop.
THREAD_ELEMENTS = 1 << 14
# After a large or refused request, once its message is freed, the heap's free pages go back to the
# system: a parsed message of millions of small fields leaves its memory scattered through the heap,
# which glibc would otherwise keep. At most once a TRIM_INTERVAL_S, TRIM_DELAY_S after the request.
TRIM_DELAY_S = 0.2
TRIM_INTERVAL_S = 1.0
LARGE_FIELDS = 64  # a request with more entries than this in its repeated fields is large
SWITCH_INTERVAL_S = 0.0005
STREAM_WINDOW = 256  # ModelStreamInfer: requests read from one stream and not yet answered, at most
_END_OF_STREAM = object()  # ModelStreamInfer: every request the client sent is answered
QUIET_SECONDS = 0.3  # drain: no new request for this long before the transport stops
MAX_ID_CHARS = 256  # a request id (echoed in its answer); longer ones are refused


def _loopback(host: str) -> bool:
    """Whether the server listens on loopback only."""
    if host == "localhost":
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _tracing(settings: ServerSettings) -> Tracing | None:
    """The tracer, when requests are traced; opentelemetry is imported only then."""
    if not settings.traced:
        return None
    from service.observability.tracing import Tracing

    ratio = settings.trace_sample_ratio if settings.trace_sample_ratio >= 0 else None
    return Tracing(ratio, settings.tracing_exporter, settings.tracing_file)


def _parameters(params: Any) -> dict[str, Any]:
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(p, which)
    return out


def _duration(count: int, ns: int) -> Any:
    return protocol.StatisticDuration(count=count, ns=ns)


class InferenceService:
    """inference.GRPCInferenceService over the loaded models."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.registry = server.registry

    def _model(self, name: str, version: str = "") -> Model:
        return self.registry.get(name, version)

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return protocol.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return protocol.ServerReadyResponse(ready=not self.server.draining)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._model(request.name, request.version)
        except ServingError:
            return protocol.ModelReadyResponse(ready=False)
        return protocol.ModelReadyResponse(ready=not self.server.draining)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return protocol.ServerMetadataResponse(
            name="qkv",
            version=__version__,
            extensions=["model_configuration", "statistics", "model_repository", *self.server.shared_memory.extensions],
        )

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        m = await self._call(context, self._model, request.name, request.version)
        tensor = protocol.message_class("ModelMetadataResponse.TensorMetadata")
        return protocol.ModelMetadataResponse(
            name=m.name,
            versions=[v.version for v in self.registry.versions(m.name)],
            platform=f"onnxruntime_onnx:{m.provider}" if m.kind == "tensor" else f"qkv_g2p:{m.provider}",
            inputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in m.inputs],
            outputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in m.outputs],
        )

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        m = await self._call(context, self._model, request.name, request.version)
        batched = m.max_batch_size > 0

        def dims(shape: tuple[int, ...]) -> list[int]:
            return list(shape[1:]) or [1] if batched else list(shape)

        types = {d.name.removeprefix("TYPE_"): int(d) for d in protocol.DataType}
        types["BYTES"] = int(protocol.DataType.TYPE_STRING)
        b = m.batcher.config if isinstance(m, TensorModel) else m.config.batching
        config = protocol.ModelConfig(
            name=m.name,
            platform="onnxruntime_onnx",
            backend="onnxruntime",
            max_batch_size=m.max_batch_size,
            input=[protocol.ModelInput(name=s.name, data_type=types[s.datatype], dims=dims(s.shape)) for s in m.inputs],
            output=[
                protocol.ModelOutput(name=s.name, data_type=types[s.datatype], dims=dims(s.shape)) for s in m.outputs
            ],
            instance_group=[
                protocol.ModelInstanceGroup(
                    name=m.name,
                    count=max(1, m.config.instances),
                    kind=protocol.ModelInstanceGroup.KIND_GPU
                    if "CUDA" in m.provider
                    else protocol.ModelInstanceGroup.KIND_CPU,
                )
            ],
        )
        if batched and b.enabled:
            config.dynamic_batching.max_queue_delay_microseconds = int(b.max_queue_delay_ms * 1000)
        config.parameters["provider"].string_value = m.provider
        config.parameters["kind"].string_value = m.kind
        if isinstance(m, TensorModel):  # the batching in force, and where each value came from
            reasons = m.tuning.reasons if m.tuning is not None else {}
            for key in BATCHING_SHOWN:
                config.parameters[f"batching.{key}"].string_value = f"{getattr(b, key):g}"
                if key in reasons:
                    config.parameters[f"batching.{key}.source"].string_value = reasons[key]
        return protocol.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.version:
            chosen = [await self._call(context, self._model, request.name, request.version)]
        elif request.name:
            chosen = await self._call(context, self.registry.versions, request.name)
        else:
            chosen = self.registry.served()
        response = protocol.ModelStatisticsResponse()
        for m in chosen:
            s: ModelStats = m.stats
            stats = response.model_stats.add(
                name=m.name,
                version=m.version,
                last_inference=s.last_inference_ms,
                inference_count=s.inference_count,
                execution_count=s.execution_count,
            )
            i = stats.inference_stats
            i.success.CopyFrom(_duration(s.success_count, s.success_ns))
            i.fail.CopyFrom(_duration(s.fail_count, s.fail_ns))
            i.queue.CopyFrom(_duration(s.success_count, s.queue_ns))
            # Per request, as Triton counts them (perf_analyzer needs the three compute counts equal).
            i.compute_input.CopyFrom(_duration(s.success_count, 0))
            i.compute_infer.CopyFrom(_duration(s.success_count, s.request_compute_ns))
            i.compute_output.CopyFrom(_duration(s.success_count, 0))
            for size, (count, ns) in sorted(s.batches.items()):
                stats.batch_stats.add(batch_size=size, compute_infer=_duration(count, ns))
        return response

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        response = protocol.RepositoryIndexResponse()
        for row in self.registry.index(ready_only=request.ready):
            state = UNAVAILABLE if self.server.draining and row.state == READY else row.state
            response.models.add(name=row.name, version=row.version, state=state, reason=row.reason)
        return response

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._call(context, self._load, request)
        return protocol.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._call(context, self._unload, request)
        return protocol.RepositoryModelUnloadResponse()

    async def _load(self, request: Any) -> None:
        self._may_change_repository(request.repository_name)
        raw = None
        for key, value in _parameters(request.parameters).items():
            if key != "config":
                raise InvalidArgument(
                    f"load parameter {quote(key)} is not supported: qkv loads model files from its repository; "
                    "'config' (a config.json as a string) is the one parameter"
                )
            try:
                raw = parse_config(value)  # bounded in size and depth: no RecursionError
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"load parameter 'config' is not JSON: {e}") from None
            if not isinstance(raw, dict):
                raise InvalidArgument(f"load parameter 'config' must be a JSON object, got {type(raw).__name__}")
        await self.registry.load(request.model_name, raw)

    async def _unload(self, request: Any) -> None:
        self._may_change_repository(request.repository_name)
        await self.registry.unload(request.model_name)

    def _may_change_repository(self, repository: str) -> None:
        """Load and unload: only with model control on, and, without an admin token, only from loopback
        (docs/security.md)."""
        s = self.server.settings
        if self.server.draining:
            raise Unavailable("the server is shutting down")
        if repository:
            raise InvalidArgument(f"unknown repository {quote(repository)}: qkv serves one, named ''")
        if s.model_control_mode == "none":
            raise FailedPrecondition(
                "model control is off: start the server with --model-control-mode explicit (or poll) to load and "
                "unload models"
            )
        if not s.admin_token_file and not _loopback(s.host):
            raise PermissionDenied(
                f"loading and unloading models needs --admin-token-file when the server listens on {s.host}, "
                "beyond loopback"
            )

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (awaited when it is a coroutine function), a ServingError answered as its status."""
        try:
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result
        except ServingError as e:
            await context.abort(grpc.StatusCode[e.code], e.message)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        carrier = context.invocation_metadata() if self.server.tracing is not None else None
        outcome = await self._answer(request, context.time_remaining(), carrier)
        if isinstance(outcome, ServingError):
            if outcome.retry_after_ms is not None:
                context.set_trailing_metadata((("grpc-retry-pushback-ms", str(outcome.retry_after_ms)),))
            # abort, not set_code and return: returning made grpc log a traceback (ExecuteBatchError)
            # for a call whose client had already gone (seen once in the fuzz test).
            await context.abort(grpc.StatusCode[outcome.code], outcome.message)
        return outcome

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Triton's streaming inference. Each request runs as soon as it arrives, beside the stream's others
        (so they batch together), and is answered as soon as it is done: a failure as error_message, and
        the stream goes on. The stream's deadline bounds every request on it; when the client goes, the
        requests still queued leave their queues."""
        answers: asyncio.Queue[Any] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        # Requests read but not yet answered to the client: a client that stops reading stops being read.
        window = asyncio.Semaphore(STREAM_WINDOW)
        carrier = context.invocation_metadata() if self.server.tracing is not None else None

        async def answer(request: Any) -> None:
            outcome = await self._answer(request, context.time_remaining(), carrier, "ModelStreamInfer")
            if isinstance(outcome, ServingError):
                hint = f" (retry after {outcome.retry_after_ms} ms)" if outcome.retry_after_ms is not None else ""
                # The request's id and model come back too, so a client can tell which request failed.
                named = protocol.ModelInferResponse(
                    model_name=request.model_name[:MAX_ID_CHARS], id=request.id[:MAX_ID_CHARS]
                )
                answers.put_nowait(
                    protocol.ModelStreamInferResponse(
                        error_message=f"{outcome.code}: {outcome.message}{hint}", infer_response=named
                    )
                )
            else:
                answers.put_nowait(protocol.ModelStreamInferResponse(infer_response=outcome))

        async def read() -> str | None:
            """Start each request as it arrives; when the client is done sending, finish what it sent.
            Returns why the stream broke off (a message that is not a ModelInferRequest), or None."""
            broken = None
            try:
                async for request in requests:
                    if isinstance(request, protocol.Undecodable):  # the requests read before it are still answered
                        broken = f"a message on the stream: {request.reason}"
                        break
                    await window.acquire()
                    task = asyncio.create_task(answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                await asyncio.gather(*running)
                return broken
            finally:
                answers.put_nowait(_END_OF_STREAM)

        reader = asyncio.create_task(read())
        try:
            while (reply := await answers.get()) is not _END_OF_STREAM:
                yield reply
                window.release()
            broken = await reader
            if broken:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, broken)
        finally:
            for task in [reader, *running]:
                task.cancel()

    async def _answer(
        self, request: Any, remaining: float | None, carrier: Any = None, method: str = "ModelInfer"
    ) -> Any:
        """One inference request from start to finish, counted in the metrics and statistics (and traced,
        when the server traces): its ModelInferResponse, or the ServingError to answer it with.
        `remaining`: seconds to its deadline; `carrier`: the call's metadata (or HTTP headers), read only
        for a W3C trace context; `method`: the RPC's name in the trace."""
        start = time.perf_counter()
        model_name, code, seq_len, outcome = request.model_name, "OK", 0, None
        server = self.server
        tracing = server.tracing
        trace = tracing.start(carrier, method) if tracing is not None else None
        server.last_arrival = time.monotonic()
        metrics = server.metrics
        model: Model | None = None
        memory: shared_memory.RequestMemory | None = None  # the regions its tensors name, leased until the end
        try:
            if len(request.id) > MAX_ID_CHARS:  # an id comes back in the answer: bound it, as every string
                raise InvalidArgument(f"request id {quote(request.id)} is too long: the limit is {MAX_ID_CHARS}")
            model = self._model(request.model_name, request.model_version)
            model.answering += 1  # an unloaded version's series go once this is back to 0
            metrics.inflight.labels(model.name, model.version).inc()
            if server.draining:
                raise Unavailable("the server is shutting down")
            server.active += 1
            try:
                deadline = time.monotonic() + remaining if remaining is not None else None
                # What any request would be refused now is refused before its tensors are decoded:
                # under overload, refusing is most of the work and must stay cheap.
                model.admission.check(0, deadline)
                _check_counts(request, model)
                memory = server.shared_memory.attach(request)
                inputs = await self._decode(request, model, memory)
                outputs = [o.name for o in request.outputs]
                result = await model.infer(inputs, outputs, _parameters(request.parameters), deadline, trace)
            finally:
                server.active -= 1
            seq_len = result.seq_len
            metrics.tokens.labels(model.name, model.version, "input").inc(result.tokens_in)
            metrics.tokens.labels(model.name, model.version, "output").inc(result.tokens_out)
            response = protocol.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
            for name, array in result.outputs.items():
                response.raw_output_contents.append(
                    shared_memory.place_output(memory, response.outputs.add(name=name), array)
                )
            outcome = response
        except ServingError as e:
            code = e.code
            # Without its traceback (and the exception it replaced): the traceback's frames hold this one,
            # whose `outcome` holds the error, a cycle that kept the request's message (up to
            # --max-message-bytes) alive until a full garbage collection.
            e.__context__ = e.__cause__ = None
            outcome = e.with_traceback(None)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            seconds = time.perf_counter() - start
            label, version = UNKNOWN_MODEL, ""
            if model is not None:
                label, version = model.name, model.version
                metrics.inflight.labels(model.name, model.version).dec()
                model_name = model.name
                stats = model.stats
                if code == "OK":
                    stats.success_count += 1
                    stats.success_ns += int(seconds * 1e9)
                else:
                    stats.fail_count += 1
                    stats.fail_ns += int(seconds * 1e9)
            elif request.model_name in self.registry.models:  # a model of the repository: its version unknown
                label = request.model_name
            metrics.requests.labels(label, version, code).inc()
            if code == "OK":  # a sampled request's trace id is its exemplar (shown in the OpenMetrics format)
                exemplar = trace.exemplar if trace is not None else None
                metrics.request_duration.labels(label, version, seq_len_bucket(seq_len)).observe(seconds, exemplar)
            if tracing is not None and trace is not None:
                tracing.finish(trace, code, outcome, model, seq_len)
            if server.settings.access_log:  # one JSON line, whatever the client's strings hold
                line = {"model": clip(model_name), "seq_len": seq_len, "code": code, "ms": round(seconds * 1e3, 3)}
                logs.access.info(json.dumps(line | {"id": clip(request.id)}))
            if model is not None:
                model.answering -= 1
            if memory is not None:
                memory.close()
            if code == "INVALID_ARGUMENT" or _large(request):
                server.return_memory_later()
        return outcome

    async def _decode(
        self, request: Any, model: Model, memory: shared_memory.RequestMemory | None
    ) -> dict[str, np.ndarray]:
        """The request's input tensors as arrays (counts checked by `_check_counts`). A large request is
        decoded on a worker thread, a slice at a time, while the event loop goes on answering others."""
        if sum(element_count(t) for t in request.inputs) > THREAD_ELEMENTS:
            return await asyncio.to_thread(_decode_inputs, request, model, memory)
        return _decode_inputs(request, model, memory)


def _misnamed(names: Any, known: list[str], what: str, model: Model) -> str:
    """Why a repeated field of `names` longer than `known` is refused: among its first len(known) + 1
    entries, one is unknown or named twice (only those are read, however many the request holds)."""
    seen: set[str] = set()
    for k in range(len(known) + 1):
        name = names[k].name
        if name not in known:
            return f"model '{model.name}' has no {what} {quote(name)} ({what}s: {', '.join(sorted(known))})"
        if name in seen:
            return f"{what} {quote(name)} given twice"
        seen.add(name)
    return ""  # unreachable: len(known) + 1 names among len(known)


def _large(request: Any) -> bool:
    """Whether a request's message held many fields or elements (len() alone, for the fields)."""
    fields = len(request.inputs) + len(request.outputs) + len(request.raw_input_contents) + len(request.parameters)
    return fields > LARGE_FIELDS or sum(element_count(t) for t in request.inputs) > THREAD_ELEMENTS


def _check_counts(request: Any, model: Model) -> None:
    """Every repeated field of the request checked against its limit on the message as received (its
    length, which builds nothing), before any of it becomes Python objects."""
    inputs = [s.name for s in model.inputs]
    if len(request.inputs) > len(inputs):
        raise InvalidArgument(
            f"{len(request.inputs)} inputs, model '{model.name}' takes {len(inputs)}: "
            f"{_misnamed(request.inputs, inputs, 'input', model)}"
        )
    raw = len(request.raw_input_contents)
    carried = len(request.inputs) - shared_memory.shared_inputs(request)  # those in shared memory have none
    if raw and raw != carried:
        raise InvalidArgument(f"{raw} raw_input_contents for {carried} inputs not in shared memory: give one per input")
    outputs = [s.name for s in model.outputs]
    if len(request.outputs) > len(outputs):
        raise InvalidArgument(
            f"{len(request.outputs)} outputs requested, model '{model.name}' has {len(outputs)}: "
            f"{_misnamed(request.outputs, outputs, 'output', model)}"
        )
    if len(request.parameters) > MAX_PARAMETERS:
        raise InvalidArgument(f"{len(request.parameters)} parameters, the limit is {MAX_PARAMETERS}")


def _decode_inputs(request: Any, model: Model, memory: shared_memory.RequestMemory | None) -> dict[str, np.ndarray]:
    raw = request.raw_input_contents
    known = {s.name for s in model.inputs}
    inputs: dict[str, np.ndarray] = {}
    k = 0  # the next raw_input_contents entry: inputs in shared memory have none
    for tensor in request.inputs:
        name = tensor.name
        if name in inputs:
            raise InvalidArgument(f"input {quote(name)} given twice")
        if name not in known:  # refused before its contents are decoded
            raise InvalidArgument(
                f"model '{model.name}' has no input {quote(name)} (inputs: {', '.join(sorted(known))})"
            )
        # Read once the shape passed its limits: from its shared memory region, or its raw contents.
        contents = memory.contents(tensor) if memory is not None else None
        if contents is None and len(raw):
            contents, k = partial(raw.__getitem__, k), k + 1
        inputs[name] = decode_tensor(tensor, contents, model.input_limits(name))
    return inputs


class SharedMemoryService:
    """Triton's shared memory RPCs (service/frontends/shared_memory.py): system shared memory, and CUDA shared
    memory answered UNIMPLEMENTED. Served beside InferenceService, on the same service name."""

    def __init__(self, server: Server) -> None:
        self.regions, self.tokens = server.shared_memory, server._tokens

    def _may_change(self, context: grpc.aio.ServicerContext, what: str) -> None:
        authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        host = shared_memory.peer_host(context.peer())
        shared_memory.check_may_change(
            host, authorization if isinstance(authorization, str) else None, self.tokens, what
        )

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except ServingError as e:
            await context.abort(grpc.StatusCode[e.code], e.message)

    async def SystemSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        response = protocol.SystemSharedMemoryStatusResponse()
        for s in await self._call(context, self.regions.status, request.name):
            response.regions[s.name].CopyFrom(response.RegionStatus(**vars(s)))
        return response

    async def SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._call(context, self._may_change, context, "registering shared memory")
        await self._call(context, self.regions.register, request.name, request.key, request.offset, request.byte_size)
        return protocol.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._call(context, self._may_change, context, "unregistering shared memory")
        await self._call(context, self.regions.unregister, request.name)
        return protocol.SystemSharedMemoryUnregisterResponse()

    async def _no_cuda(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, shared_memory.CUDA_UNIMPLEMENTED)

    CudaSharedMemoryStatus = CudaSharedMemoryRegister = _no_cuda

    async def CudaSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Every region (no name): there is none, so done; Triton's examples begin so.
        if request.name:
            await self._no_cuda(request, context)
        return protocol.message_class("CudaSharedMemoryUnregisterResponse")()


class Server:
    """Models + gRPC server + metrics endpoint, started and drained as one."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        # TLS files and tokens first: a bad one stops the start before any model loads.
        self._credentials = server_credentials(settings)
        self._tokens = BearerTokens(bearer_tokens(settings.auth_token_file), bearer_tokens(settings.admin_token_file))
        self.metrics = Metrics(enabled=settings.metrics)
        priority.configure(settings.compute_nice)
        self.tracing = _tracing(settings)
        self.registry = ModelRegistry(settings, self.metrics, self._model_changed, self.tracing)
        self.shared_memory = shared_memory.SharedMemoryRegistry(
            settings.shared_memory_max_regions, settings.shared_memory_max_bytes, settings.max_message_bytes
        )
        self.draining = False
        self.active = 0  # requests inside a model right now
        self.last_arrival = 0.0  # monotonic time of the latest inference request
        self.health = health.aio.HealthServicer()
        self.grpc_port = 0
        self.metrics_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._trim: asyncio.Task[None] | None = None  # memory handed back soon, after a large request
        self._trimmed = 0.0  # monotonic time of the last hand-back
        self._http: Any = None  # service.frontends.rest_api.RestServer, when --http-port is not -1

    def _options(self) -> list[tuple[str, Any]]:
        s = self.settings
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.max_concurrent_streams", s.max_concurrent_streams),
            ("grpc.keepalive_time_ms", 60_000),  # find dead peers
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.max_connection_idle_ms", 600_000),
            ("grpc.so_reuseport", 0),
        ]
        if s.max_connection_age > 0:
            options += [
                ("grpc.max_connection_age_ms", int(s.max_connection_age * 1000)),
                ("grpc.max_connection_age_grace_ms", int(s.grace_period * 1000)),
            ]
        return options

    async def _model_changed(self, name: str, ready: bool) -> None:
        if not self.draining:
            status = health_pb2.HealthCheckResponse
            await self.health.set(name, status.SERVING if ready else status.NOT_SERVING)

    async def start(self) -> None:
        """Ports bound, models loaded (a model that fails to load stops the start), then serving."""
        s = self.settings
        credentials = self._credentials
        interceptors = [TokenAuth(self._tokens)] if self._tokens else []
        server = self._grpc = grpc.aio.server(options=self._options(), interceptors=interceptors)
        service = InferenceService(self)  # one data plane: the HTTP/REST front end calls the same service
        server.add_generic_rpc_handlers((protocol.generic_handler(service),))
        server.add_generic_rpc_handlers((protocol.generic_handler(SharedMemoryService(self)),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [protocol.SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME], server, pool=protocol.POOL
        )
        address = f"{s.host}:{s.grpc_port}" if ":" not in s.host else f"[{s.host}]:{s.grpc_port}"
        try:
            self.grpc_port = (
                server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
            )
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise SystemExit(f"qkv: cannot bind the gRPC port {address}: {e}") from None
        if s.metrics_port >= 0:
            metrics_host = s.metrics_host or s.host
            try:
                self.metrics_port = self.metrics.serve(metrics_host, s.metrics_port, s.http_timeout)
            except OSError as e:
                raise SystemExit(f"qkv: cannot bind the metrics port {metrics_host}:{s.metrics_port}: {e}") from None
        if s.http_port >= 0:
            from service.frontends.rest_api import RestServer  # aiohttp, only when HTTP is on

            self._http = RestServer(service, self.metrics, s, self._tokens, ssl_context(s))
            self.http_port = self._http.bind(s.host, s.http_port)
        await self.registry.start()  # the ports are bound (one in use stops the start), not yet serving
        await server.start()
        if self._http is not None:
            await self._http.start()
        for name in ["", *self.registry.ready_names()]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def return_memory_later(self) -> None:
        """The heap's free pages handed back to the system shortly (once the request's message is gone)."""
        if self._trim is None:
            delay = max(TRIM_DELAY_S, self._trimmed + TRIM_INTERVAL_S - time.monotonic())
            self._trim = asyncio.create_task(self._return_memory(delay))

    async def _return_memory(self, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            # A refused call's message can sit in a reference cycle (its frames, via the abort's
            # traceback) that only a collection frees; after gc.freeze a collection takes some 2 ms.
            gc.collect()
            await asyncio.to_thread(return_freed_memory)  # malloc_trim: ctypes lets go of the GIL
        finally:
            self._trimmed, self._trim = time.monotonic(), None

    async def drain(self) -> None:
        """Stop taking work, let admitted requests finish (up to the grace period), stop."""
        if self.draining:
            return
        self.draining = True
        await self.health.enter_graceful_shutdown()  # every service reports NOT_SERVING at once
        deadline = time.monotonic() + self.settings.grace_period
        # Wait for admitted work, and for clients to stop sending: a call that arrives while the
        # transport shuts down would be cancelled instead of answered UNAVAILABLE.
        while time.monotonic() < deadline and (self.active or time.monotonic() - self.last_arrival < QUIET_SECONDS):
            await asyncio.sleep(0.02)
        if self.active:
            log.warning("grace period over with %d requests still running", self.active)
        if self._grpc is not None:
            await self._grpc.stop(max(0.0, deadline - time.monotonic()))
        if self._http is not None:
            await self._http.stop()
        await self.registry.close()
        self.shared_memory.close()
        if self._trim is not None:
            self._trim.cancel()
        if self.tracing is not None:  # export what is buffered, for tracing.SHUTDOWN_S at most
            await asyncio.to_thread(self.tracing.shutdown)

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


async def _serve(settings: ServerSettings) -> int:
    # Hand the GIL over sooner (default 5 ms): the event loop answers RPCs while decoding threads
    # run the Python parts of their steps.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = Server(settings)
    await server.start()
    # What start-up made (modules, descriptors, graphs' metadata) lives as long as the server. Frozen,
    # a full collection under load no longer walks it: 19-33 ms with every thread stopped, 2 ms after.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    models = ", ".join(f"{m.name} v{m.version} ({m.kind}, {m.provider})" for m in server.registry.served())
    log.info("settings: %s", settings.summary())
    http = f"{settings.host}:{server.http_port}" if settings.http_port >= 0 else "off"
    print(
        f"qkv {__version__} serving {models or 'no models'} on grpc {settings.host}:{server.grpc_port} metrics "
        f"{settings.metrics_host or settings.host}:{server.metrics_port} http {http}",
        flush=True,
    )
    await stop.wait()
    log.info("signal received: draining (grace %.1f s)", settings.grace_period)
    await server.drain()
    log.info("stopped")
    return 0


def serve(settings: ServerSettings) -> int:
    one_malloc_arena()  # before any thread: memory an unloaded model frees goes back to the system
    logs.configure(settings.log_level, settings.access_log)
    try:
        return asyncio.run(_serve(settings))
    except RepositoryError as e:
        print(f"qkv: {e}", file=sys.stderr)
        return 2
