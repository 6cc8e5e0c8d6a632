"""A small Python client for qkv (any v2-protocol server), sync and asyncio, with deadlines.

    from service.tools.client import Client
    with Client("127.0.0.1:8001") as c:
        print(c.g2p(["attention", "transformer"]))      # ['AH0 T EH1 N SH AH0 N', ...]

Calls retry on UNAVAILABLE (a restarting or draining server) with exponential backoff, and on
RESOURCE_EXHAUSTED after the server's retry-pushback hint, within the call's deadline. A client made with
`wait_for_server=False` (the command-line tools) fails at once where nothing listens at the address, or
its name does not resolve: `unreachable` says so, naming the address. An inference
call carries a W3C trace context: the `traceparent` given, or the caller's current OpenTelemetry
span when the caller traces; a server that traces continues that trace.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from service import protocol
from service.datatypes import decode_bytes, encode_bytes

__all__ = [
    "AsyncClient",
    "Client",
    "g2p_outputs",
    "g2p_request",
    "health_check",
    "new_traceparent",
    "rpc_problem",
    "trace_id",
    "trace_metadata",
    "unreachable",
]

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
PUSHBACK = "grpc-retry-pushback-ms"


# What gRPC's details say when no server could be reached at all: nothing listens there, or no such host.
UNREACHABLE = ("connection refused", "dns resolution failed", "name or service not known")


def unreachable(error: grpc.RpcError, target: str) -> str | None:
    """`error` as one line naming `target` when the call reached no server at all (a refused connection,
    a name that does not resolve), else None."""
    details = (error.details() or "").lower()
    if error.code() != grpc.StatusCode.UNAVAILABLE or not any(why in details for why in UNREACHABLE):
        return None
    why = next(w for w in UNREACHABLE if w in details)
    return f"cannot reach a server at {target}: {why}"


def _pause(error: grpc.RpcError, attempt: int, wait_for_server: bool = True) -> float | None:
    """Seconds to wait before retrying `error`, or None when it is not retryable.

    UNAVAILABLE (restarting, draining) backs off exponentially, but a refused connection only when
    `wait_for_server`; RESOURCE_EXHAUSTED is retried only when the server said how long to wait
    (grpc-retry-pushback-ms).
    """
    if not wait_for_server and unreachable(error, "") is not None:
        return None
    if error.code() in RETRYABLE:
        return _backoff(attempt)
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        for key, value in error.trailing_metadata() or ():
            if key == PUSHBACK:
                return int(value) / 1e3 * (1 + random.random() / 4)
    return None


def g2p_request(
    texts: Sequence[str],
    model: str = "g2p",
    attention: bool = False,
    beam_size: int = 1,
    version: str = "",
    lexicon: bool = True,
) -> Any:
    """A ModelInferRequest for the g2p model, TEXT as raw BYTES; `version` "" is the newest served;
    `lexicon` False: every word answered by the model, none from the version's pronouncing lexicon."""
    req = protocol.ModelInferRequest(model_name=model, model_version=version)
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    req.raw_input_contents.append(encode_bytes(np.array([t.encode() for t in texts], dtype=object)))
    req.outputs.add(name="PHONEMES")
    if attention:
        req.outputs.add(name="ATTENTION")
    if beam_size != 1:
        req.parameters["beam_size"].int64_param = beam_size
    if not lexicon:
        req.parameters["lexicon"].bool_param = False
    return req


def g2p_outputs(response: Any) -> dict[str, Any]:
    """PHONEMES as a list of str, ATTENTION (if present) as a float32 array."""
    out: dict[str, Any] = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        count = int(np.prod(tensor.shape)) if tensor.shape else 1
        if tensor.datatype == "BYTES":
            out[tensor.name] = [b.decode() for b in decode_bytes(raw, count, tensor.name)]
        else:
            out[tensor.name] = np.frombuffer(raw, dtype=np.float32).reshape(tuple(tensor.shape))
    return out


def _metadata(token: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {token}")] if token else None


def new_traceparent(sampled: bool = True) -> str:
    """A W3C traceparent that starts a new trace: version 00, random trace and parent ids."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"


def trace_id(traceparent: str) -> str:
    """The trace id in a traceparent: what to search a tracing backend for."""
    return traceparent.split("-")[1]


def trace_metadata(traceparent: str | None = None) -> list[tuple[str, str]]:
    """A call's W3C trace context: `traceparent` as given, else the caller's current OpenTelemetry span
    when the caller uses OpenTelemetry (nothing is imported for a caller that does not), else none."""
    if traceparent:
        return [("traceparent", traceparent)]
    if "opentelemetry.propagate" in sys.modules:
        from opentelemetry import propagate

        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return list(carrier.items())
    return []


def _with(metadata: list[tuple[str, str]] | None, extra: list[tuple[str, str]]) -> list[tuple[str, str]] | None:
    return [*(metadata or ()), *extra] if extra else metadata


def _channel_args(
    target: str, ssl: grpc.ChannelCredentials | None, load_balancing: str | None = None
) -> dict[str, Any]:
    options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 << 20)]
    if load_balancing:  # e.g. round_robin over every address of dns:///qkv-headless:8001
        options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{load_balancing: {}}]})))
    return {"target": target, "options": options} | ({"credentials": ssl} if ssl is not None else {})


def _backoff(attempt: int) -> float:
    return min(1.0, 0.05 * 2.0**attempt) * (0.5 + random.random() / 2)


class Client:
    """Blocking client. `timeout` is each call's deadline in seconds, retries included.
    `load_balancing="round_robin"` spreads calls over every address the target resolves to
    (gRPC's default, pick_first, sends them all to one). `wait_for_server=False`: a refused connection
    fails the call at once instead of being retried until the deadline (a server not started yet)."""

    def __init__(
        self,
        target: str,
        timeout: float = 10.0,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        load_balancing: str | None = None,
        wait_for_server: bool = True,
    ) -> None:
        args = _channel_args(target, credentials, load_balancing)
        self.target, self.wait_for_server = target, wait_for_server
        self.channel = grpc.secure_channel(**args) if credentials else grpc.insecure_channel(**args)
        self.stub = protocol.Stub(self.channel)
        self.timeout, self.metadata = timeout, _metadata(token)

    def call(
        self, method: str, request: Any, timeout: float | None = None, metadata: list[tuple[str, str]] | None = None
    ) -> Any:
        """`metadata`: sent besides the client's own (its bearer token)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        sent = _with(self.metadata, metadata or [])
        attempt = 0
        while True:
            try:
                return getattr(self.stub, method)(
                    request, timeout=max(0.001, deadline - time.monotonic()), metadata=sent
                )
            except grpc.RpcError as e:
                pause = _pause(e, attempt, self.wait_for_server)
                if pause is None or time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
                attempt += 1

    def infer(self, request: Any, timeout: float | None = None, traceparent: str | None = None) -> Any:
        return self.call("ModelInfer", request, timeout, trace_metadata(traceparent))

    def g2p(
        self,
        texts: Sequence[str],
        model: str = "g2p",
        timeout: float | None = None,
        traceparent: str | None = None,
        version: str = "",
        lexicon: bool = True,
    ) -> list[str]:
        request = g2p_request(texts, model, version=version, lexicon=lexicon)
        return g2p_outputs(self.infer(request, timeout, traceparent))["PHONEMES"]  # type: ignore[no-any-return]

    def ready(self) -> bool:
        return bool(self.call("ServerReady", protocol.ServerReadyRequest()).ready)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client over grpc.aio, same interface as `Client` with `await`."""

    def __init__(
        self,
        target: str,
        timeout: float = 10.0,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        load_balancing: str | None = None,
        wait_for_server: bool = True,
    ) -> None:
        args = _channel_args(target, credentials, load_balancing)
        self.target, self.wait_for_server = target, wait_for_server
        self.channel = grpc.aio.secure_channel(**args) if credentials else grpc.aio.insecure_channel(**args)
        self.stub = protocol.Stub(self.channel)
        self.timeout, self.metadata = timeout, _metadata(token)

    async def call(
        self, method: str, request: Any, timeout: float | None = None, metadata: list[tuple[str, str]] | None = None
    ) -> Any:
        """`metadata`: sent besides the client's own (its bearer token)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        sent = _with(self.metadata, metadata or [])
        attempt = 0
        while True:
            try:
                return await getattr(self.stub, method)(
                    request, timeout=max(0.001, deadline - time.monotonic()), metadata=sent
                )
            except grpc.aio.AioRpcError as e:
                pause = _pause(e, attempt, self.wait_for_server)
                if pause is None or time.monotonic() + pause >= deadline:
                    raise
                await asyncio.sleep(pause)
                attempt += 1

    async def infer(self, request: Any, timeout: float | None = None, traceparent: str | None = None) -> Any:
        return await self.call("ModelInfer", request, timeout, trace_metadata(traceparent))

    async def g2p(
        self,
        texts: Sequence[str],
        model: str = "g2p",
        timeout: float | None = None,
        traceparent: str | None = None,
        version: str = "",
        lexicon: bool = True,
    ) -> list[str]:
        response = await self.infer(g2p_request(texts, model, version=version, lexicon=lexicon), timeout, traceparent)
        return g2p_outputs(response)["PHONEMES"]  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def health_check(
    target: str, service: str = "", timeout: float = 3.0, credentials: grpc.ChannelCredentials | None = None
) -> str:
    """grpc.health.v1 status name of `service` ('' = the whole server)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    args = _channel_args(target, credentials)
    make: Callable[..., grpc.Channel] = grpc.secure_channel if credentials else grpc.insecure_channel
    with make(**args) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def rpc_problem(error: Any, url: str) -> str:
    """A failed call as the tools say it: the status and why, the address named where none was reached."""
    return f"{error.code().name}: {unreachable(error, url) or error.details()}"
