"""inference.GRPCInferenceService: each RPC decodes its message, awaits the data plane
(service/serving/dataplane.py) and encodes the answer.

An inference message is handed over as views (`_Inputs`, `_Outputs`, `_Parameters`) that the data plane
counts before it reads any entry, so a message of a million inputs builds nothing before it is refused;
each tensor's contents stay in the message until the data plane reads them (`codec.MessageSource`).
A large message's repeated fields are counted on the wire before it is parsed at all (wire_limits.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from functools import cache, partial
from typing import NoReturn, TypeVar, overload

import grpc
from grpc.aio import ServicerContext as Context

from service import protocol
from service.callers import Caller
from service.errors import InvalidArgument, ResourceExhausted, ServingError, quote
from service.frontends import shared_memory
from service.frontends.grpc_codec import MessageSource, place_output
from service.frontends.grpc_generate import stream_generation
from service.frontends.messages import (
    config_message,
    index_message,
    metadata_message,
    server_metadata_message,
    statistics_message,
)
from service.frontends.peers import Address, grpc_peer_uid
from service.frontends.security import BearerTokens
from service.frontends.statuses import grpc_status
from service.frontends.triton_generation import generates
from service.frontends.wire_limits import WALKED_BYTES, Refused, infer_request_deserializer
from service.serving.dataplane import MAX_ID_CHARS, MAX_PARAMETERS, DataPlane
from service.serving.dataplane_types import InferInput, InferRequest, InferResponse, Parameter, RequestedOutput

__all__ = ["STREAM_WINDOW", "InferenceService", "generic_handler"]

STREAM_WINDOW = 256  # ModelStreamInfer: requests read from one stream and not yet answered, at most
SEND_LIMIT = (1 << 31) - 1  # the largest answer by default: Triton's (INT32_MAX, gRPC's own ceiling)
T = TypeVar("T")
# What a stream of ModelStreamInfer hands the method: a message, or why it is none (over a limit, undecodable)
_Streamed = protocol.ModelInferRequest | protocol.Undecodable
# A parameter's message: an inference request's, or a repository load's (the same oneof, parameter_choice)
_ParameterMessage = protocol.InferParameter | protocol.ModelRepositoryParameter


def _value(p: _ParameterMessage) -> Parameter | None:
    """An InferParameter's value; None when none is set."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


class _Parameters(Mapping[str, Parameter]):
    """A message's map of InferParameter as plain values. len() counts every entry on the wire; the
    entries without a value set are not iterated."""

    def __init__(self, params: Mapping[str, _ParameterMessage]) -> None:
        self._params = params

    def __len__(self) -> int:
        return len(self._params)

    def __iter__(self) -> Iterator[str]:
        return (k for k, p in self._params.items() if p.WhichOneof("parameter_choice") is not None)

    def __contains__(self, key: object) -> bool:  # Mapping's would raise and catch a KeyError
        return (
            isinstance(key, str)
            and key in self._params
            and self._params[key].WhichOneof("parameter_choice") is not None
        )

    def __getitem__(self, key: str) -> Parameter:
        if key not in self._params:  # indexing a protobuf map would add the key
            raise KeyError(key)
        value = _value(self._params[key])
        if value is None:
            raise KeyError(key)
        return value


def _parameters(params: Mapping[str, protocol.InferParameter]) -> Mapping[str, Parameter]:
    """A message's map of InferParameter: as a dict, read in one pass, when it holds at most MAX_PARAMETERS
    entries; else as the view, whose length the data plane refuses before it reads any entry."""
    if len(params) > MAX_PARAMETERS:
        return _Parameters(params)
    out: dict[str, Parameter] = {}
    for key, p in params.items():
        value = _value(p)
        if value is not None:
            out[key] = value
    return out


class _Inputs(Sequence[InferInput]):
    """A ModelInferRequest's input tensors, each built when it is read."""

    def __init__(self, message: protocol.ModelInferRequest, memory: shared_memory.RequestMemory | None = None) -> None:
        self._tensors, self._raw, self._memory = message.inputs, message.raw_input_contents, memory
        raw, n = len(self._raw), len(self._tensors)
        # inputs in shared memory have no raw_input_contents entry: the others' entries, in order
        self._raw_index: dict[int, int] | None = None
        if memory is not None and memory.inputs:
            others = [i for i, t in enumerate(self._tensors) if t.name not in memory.inputs]
            self._raw_index, n = {i: j for j, i in enumerate(others)}, len(others)
        where = " not in shared memory" if self._raw_index is not None else ""
        self._refused = (
            f"{raw} raw_input_contents for {n} inputs{where}: give one per input" if raw and raw != n else ""
        )
        typed = next((t.name for t in self._tensors if t.HasField("contents")), None) if raw else None
        if typed is not None:  # Triton's words, which its clients match, before the counts
            self._refused = (
                f"contents field must not be specified when using raw_input_contents for {quote(typed)} for model "
                f"{quote(message.model_name)}"
            )
        self._built: dict[int, InferInput] = {}  # the data plane reads a tensor more than once
        self._all: list[InferInput] | None = None

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[InferInput]:
        if self._all is None:  # iterated after the data plane counted them: every one is read
            self._all = [self[i] for i in range(len(self._tensors))]
        return iter(self._all)

    @overload
    def __getitem__(self, k: int) -> InferInput: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[InferInput]: ...
    def __getitem__(self, k: int | slice) -> InferInput | Sequence[InferInput]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        built = self._built.get(k)
        if built is not None:
            return built
        t = self._tensors[k]
        region = self._memory.source(t.name) if self._memory is not None and not self._refused else None
        if region is not None:  # read from its region
            built = self._built[k] = InferInput(t.name, t.datatype, t.shape, region)
            return built
        raw = None
        if len(self._raw) and not self._refused:
            j = k if self._raw_index is None else self._raw_index[k]
            raw = partial(self._raw.__getitem__, j)
        built = self._built[k] = InferInput(t.name, t.datatype, t.shape, MessageSource(t, raw, self._refused))
        return built


class _Outputs(Sequence[RequestedOutput]):
    """A ModelInferRequest's requested outputs, each built when it is read."""

    def __init__(self, outputs: Sequence[protocol.ModelInferRequest.InferRequestedOutputTensor]) -> None:
        self._outputs = outputs
        self._built: dict[int, RequestedOutput] = {}  # the data plane reads an output more than once

    def __len__(self) -> int:
        return len(self._outputs)

    def __iter__(self) -> Iterator[RequestedOutput]:  # Sequence's would end on a raised IndexError
        return (self[i] for i in range(len(self._outputs)))

    @overload
    def __getitem__(self, k: int) -> RequestedOutput: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[RequestedOutput]: ...
    def __getitem__(self, k: int | slice) -> RequestedOutput | Sequence[RequestedOutput]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        built = self._built.get(k)
        if built is None:
            o = self._outputs[k]
            built = self._built[k] = RequestedOutput(o.name, _parameters(o.parameters))
        return built


def decode_request(
    message: protocol.ModelInferRequest,
    context: Context,
    plane: DataPlane,
    method: str,
    memory: shared_memory.RequestMemory | None = None,
    caller: Caller | None = None,
) -> InferRequest:
    """A ModelInferRequest -> the data plane's request; the call's deadline is the request's. `memory`: the
    shared memory regions its tensors name, leased; `caller`: whose token sent it (--isolate-tokens)."""
    remaining = context.time_remaining()
    return InferRequest(
        model_name=message.model_name,
        model_version=message.model_version,
        id=message.id,
        inputs=_Inputs(message, memory),
        outputs=_Outputs(message.outputs),
        parameters=_parameters(message.parameters),
        deadline=time.monotonic() + remaining if remaining is not None else None,
        trace_context=context.invocation_metadata() if plane.traced else None,
        method=method,
        caller=caller,
    )


def encode_response(
    answer: InferResponse, memory: shared_memory.RequestMemory | None = None, limit: int = SEND_LIMIT
) -> protocol.ModelInferResponse:
    """The data plane's answer -> a ModelInferResponse, every output in raw_output_contents (empty for one
    written into its shared memory region); RESOURCE_EXHAUSTED naming --max-send-message-bytes when it is
    larger than `limit` (gRPC's own refusal names nothing)."""
    response = protocol.ModelInferResponse(
        model_name=answer.model_name, model_version=answer.model_version, id=answer.id
    )
    for name, array in answer.outputs.items():
        response.raw_output_contents.append(place_output(memory, response.outputs.add(name=name), array))
    # The contents are most of a large answer: only one near the limit is measured whole.
    if sum(map(len, response.raw_output_contents)) + WALKED_BYTES > limit and (size := response.ByteSize()) > limit:
        raise ResourceExhausted(
            f"the response is {size:,} bytes, over the server's --max-send-message-bytes {limit:,}: raise it, ask for "
            "fewer outputs, or have them written to shared memory"
        )
    return response


# A message naming more tensors than this is not searched for shared memory regions: no model has as many,
# and the data plane refuses it by its counts before reading any.
MAX_SHARED_TENSORS = 1024


def _attached(
    regions: shared_memory.SharedMemoryRegistry,
    message: protocol.ModelInferRequest,
    uid: Callable[[], int | None],
    caller: Caller | None,
) -> shared_memory.RequestMemory | None:
    """The regions a request's tensors name, leased (None: it names none); an error is the request's answer.
    `uid`: the requesting user (service/frontends/peers.py), found only for a request that names a region."""
    if len(message.inputs) + len(message.outputs) > MAX_SHARED_TENSORS:
        return None
    if not any(len(t.parameters) for t in message.inputs) and not any(len(t.parameters) for t in message.outputs):
        return None  # most requests: no tensor has a parameter, so none names a region
    inputs = [
        shared_memory.TensorRegion(t.name, _parameters(t.parameters), t.HasField("contents"))
        for t in message.inputs
        if len(t.parameters)
    ]
    outputs = [
        shared_memory.TensorRegion(t.name, _parameters(t.parameters)) for t in message.outputs if len(t.parameters)
    ]
    return regions.attach(inputs, outputs, uid, caller)


async def _abort(context: Context, e: ServingError) -> NoReturn:
    if e.retry_after_ms is not None:
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(e.retry_after_ms)),))
    # abort, not set_code and return: returning made grpc log a traceback (ExecuteBatchError)
    # for a call whose client had already gone (seen once in the fuzz test).
    await context.abort(grpc_status(e), e.message)
    raise AssertionError("abort raises")  # grpc's abort raises, untyped


async def _answered(context: Context, work: Callable[[], T]) -> T:
    """`work()`, a ServingError answered as its status."""
    try:
        return work()
    except ServingError as e:
        await _abort(context, e)


async def _awaited(context: Context, work: Awaitable[T]) -> T:
    try:
        return await work
    except ServingError as e:
        await _abort(context, e)


class InferenceService:
    """inference.GRPCInferenceService over the data plane."""

    def __init__(
        self,
        plane: DataPlane,
        regions: shared_memory.SharedMemoryRegistry,
        tokens: BearerTokens | None = None,
        address: Callable[[], Address] = lambda: ("", 0),
        send_limit: int = SEND_LIMIT,
    ) -> None:
        self.plane, self.regions, self.send_limit = plane, regions, send_limit
        self.tokens = tokens if tokens is not None else BearerTokens([])  # who a call is, with --isolate-tokens
        self.address = address  # the server's (host, port): a peer's user is found by it

    def _peer_uid(self, context: Context) -> int | None:
        """The peer's local user (service/frontends/peers.py), asked for only by a request that names a region."""
        return grpc_peer_uid(context.peer(), self.address())

    async def ServerLive(self, request: protocol.ServerLiveRequest, context: Context) -> protocol.ServerLiveResponse:
        return protocol.ServerLiveResponse(live=self.plane.live())

    async def ServerReady(self, request: protocol.ServerReadyRequest, context: Context) -> protocol.ServerReadyResponse:
        return protocol.ServerReadyResponse(ready=self.plane.ready())

    async def ModelReady(self, request: protocol.ModelReadyRequest, context: Context) -> protocol.ModelReadyResponse:
        return protocol.ModelReadyResponse(ready=self.plane.model_ready(request.name, request.version))

    async def ServerMetadata(
        self, request: protocol.ServerMetadataRequest, context: Context
    ) -> protocol.ServerMetadataResponse:
        return server_metadata_message(self.plane.server_info(), self.regions.extensions)

    async def ModelMetadata(
        self, request: protocol.ModelMetadataRequest, context: Context
    ) -> protocol.ModelMetadataResponse:
        m = await _answered(context, partial(self.plane.model, request.name, request.version))
        return metadata_message(m, self.plane.versions(m.name))

    async def ModelConfig(self, request: protocol.ModelConfigRequest, context: Context) -> protocol.ModelConfigResponse:
        return config_message(await _answered(context, partial(self.plane.model, request.name, request.version)))

    async def ModelStatistics(
        self, request: protocol.ModelStatisticsRequest, context: Context
    ) -> protocol.ModelStatisticsResponse:
        chosen = await _awaited(context, self.plane.summed_statistics(request.name, request.version))
        caller = self.tokens.caller_of(context.invocation_metadata()) if self.tokens.isolate else None
        return statistics_message(chosen, self.plane.cache, caller)

    async def RepositoryIndex(
        self, request: protocol.RepositoryIndexRequest, context: Context
    ) -> protocol.RepositoryIndexResponse:
        return index_message(self.plane.index(ready_only=request.ready))

    async def RepositoryModelLoad(
        self, request: protocol.RepositoryModelLoadRequest, context: Context
    ) -> protocol.RepositoryModelLoadResponse:
        params = _Parameters(request.parameters)
        await _awaited(context, self.plane.load(request.model_name, params, request.repository_name))
        return protocol.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: protocol.RepositoryModelUnloadRequest, context: Context
    ) -> protocol.RepositoryModelUnloadResponse:
        await _awaited(context, self.plane.unload(request.model_name, request.repository_name))
        return protocol.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request: protocol.ModelInferRequest, context: Context) -> protocol.ModelInferResponse:
        caller = self.tokens.caller_of(context.invocation_metadata())
        try:
            memory = _attached(self.regions, request, partial(self._peer_uid, context), caller)
        except ServingError as e:
            await _abort(context, e)
        try:
            outcome = await self.plane.infer(decode_request(request, context, self.plane, "ModelInfer", memory, caller))
            if isinstance(outcome, ServingError):
                await _abort(context, outcome)
            try:
                return encode_response(outcome, memory, self.send_limit)
            except ServingError as e:  # an output that does not fit its region, or the answer over the send limit
                await _abort(context, e)
        finally:
            if memory is not None:
                memory.close()

    async def ModelStreamInfer(
        self, requests: AsyncIterator[_Streamed], context: Context
    ) -> AsyncIterator[protocol.ModelStreamInferResponse]:
        """Triton's streaming inference. Each request runs as soon as it arrives, beside the stream's others
        (so they batch together), and is answered as soon as it is done: a failure as error_message, and
        the stream goes on. The stream's deadline bounds every request on it; when the client goes, the
        requests still queued leave their queues. A generating model's request is decoupled: a response
        a chunk (grpc_generate.py); a client that goes away closes its sequences."""
        # (a response, the window it gives back once sent: a request's last response gives back `window`)
        # None: every request the client sent is answered
        answers: asyncio.Queue[tuple[protocol.ModelStreamInferResponse, asyncio.Semaphore] | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        # Requests read but not yet answered to the client: a client that stops reading stops being read.
        window = asyncio.Semaphore(STREAM_WINDOW)
        # A generating model's responses before its request's last, queued and not yet sent, at most.
        chunk_window = asyncio.Semaphore(STREAM_WINDOW)
        caller = self.tokens.caller_of(context.invocation_metadata())
        uid = cache(partial(self._peer_uid, context))  # found once: a stream's requests share its connection

        async def chunk(reply: protocol.ModelStreamInferResponse, last: bool) -> None:
            if not last:
                await chunk_window.acquire()
            answers.put_nowait((reply, window if last else chunk_window))

        async def answer(request: protocol.ModelInferRequest) -> None:
            memory = None
            try:
                if generates(self.plane, request.model_name, request.model_version):
                    decoded = decode_request(request, context, self.plane, "ModelStreamInfer", None, caller)
                    await stream_generation(self.plane, decoded, chunk)
                    return
                memory = _attached(self.regions, request, uid, caller)
                outcome = await self.plane.infer(
                    decode_request(request, context, self.plane, "ModelStreamInfer", memory, caller)
                )
                answers.put_nowait((_stream_answer(request, outcome, memory, self.send_limit), window))
            except ServingError as e:
                answers.put_nowait((_stream_answer(request, e), window))
            finally:
                if memory is not None:
                    memory.close()

        async def read() -> str | None:
            """Start each request as it arrives; when the client is done sending, finish what it sent.
            Returns why the stream broke off (a message that is not a ModelInferRequest), or None."""
            broken = None
            try:
                async for request in requests:
                    if isinstance(request, Refused):  # over a limit on the wire: answered, and the stream goes on
                        await window.acquire()
                        answers.put_nowait((_stream_answer(request, InvalidArgument(request.reason)), window))
                        continue
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
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await answers.get()) is not None:
                reply, given_back = item
                yield reply
                given_back.release()
            broken = await reader
            if broken:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, broken)
        finally:
            for task in [reader, *running]:
                task.cancel()


def generic_handler(service: InferenceService) -> grpc.GenericRpcHandler:
    """inference.GRPCInferenceService served by `service`, ModelInfer's and ModelStreamInfer's messages
    counted on the wire before they are parsed (a refusal reaches the method in the message's place)."""
    handlers = protocol.method_handlers(service)

    def deserialize(data: bytes) -> _Streamed:
        request = infer_request_deserializer(data)
        if isinstance(request, protocol.Undecodable) and len(data) > WALKED_BYTES:
            service.plane.large_request_done()
        return request

    for name in ("ModelInfer", "ModelStreamInfer"):
        handlers[name] = handlers[name]._replace(request_deserializer=deserialize)
    return grpc.method_handlers_generic_handler(protocol.SERVICE_NAME, handlers)


def _stream_answer(
    request: protocol.ModelInferRequest | Refused,
    outcome: InferResponse | ServingError,
    memory: shared_memory.RequestMemory | None = None,
    limit: int = SEND_LIMIT,
) -> protocol.ModelStreamInferResponse:
    """A ModelStreamInferResponse: the answer, or the error as `STATUS: message` with the request's id and
    model, so that a client can tell which request failed."""
    if not isinstance(outcome, ServingError):
        try:
            return protocol.ModelStreamInferResponse(infer_response=encode_response(outcome, memory, limit))
        except ServingError as e:  # an output that does not fit its region, or the answer over the send limit
            outcome = e
    hint = f" (retry after {outcome.retry_after_ms} ms)" if outcome.retry_after_ms is not None else ""
    named = protocol.ModelInferResponse(model_name=request.model_name[:MAX_ID_CHARS], id=request.id[:MAX_ID_CHARS])
    return protocol.ModelStreamInferResponse(
        error_message=f"{outcome.code}: {outcome.message}{hint}", infer_response=named
    )
