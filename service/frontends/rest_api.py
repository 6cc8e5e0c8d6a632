# Over 500 lines: every v2 REST route and its errors, as grpc_api.py holds gRPC's.
"""The v2 REST protocol on --http-port, beside gRPC on the same event loop (docs/design.md, "HTTP/REST").

One data plane: each handler decodes its request (rest_codec.py) and awaits the `DataPlane` the gRPC
front end awaits (service/serving/dataplane.py), so HTTP and gRPC requests batch together and share
admission, limits, metrics and statistics; then it writes the answer as JSON (or JSON and Triton's
binary tensor data). Bearer tokens and TLS as on gRPC; the health and readiness endpoints stay open.
Triton's generate extension makes `curl` a complete client of g2p. aiohttp is imported here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import ERROR, RequestPayloadError

from service.callers import Caller
from service.config import ServerSettings
from service.errors import ConfigError, InvalidArgument, ServingError, clip, quote
from service.frontends import shared_memory
from service.frontends.codec import FlatSource
from service.frontends.completions_api import CompletionsApi
from service.frontends.messages import (
    config_message,
    index_message,
    message_json,
    metadata_message,
    server_metadata_message,
    statistics_message,
)
from service.frontends.peers import peer_uid
from service.frontends.rest_codec import (
    InferBody,
    encode_infer,
    parameters,
    parse_infer,
    parse_json,
)
from service.frontends.security import BearerTokens
from service.frontends.statuses import HTTP_STATUS, http_status
from service.frontends.text_api import TextApi
from service.frontends.triton_generate import TritonGenerate
from service.frontends.triton_generation import generates
from service.models.catalog import TakesText, capability
from service.observability.metrics import UNKNOWN_MODEL, Metrics
from service.serving.dataplane import DataPlane
from service.serving.dataplane_types import InferInput, InferRequest, InferResponse, Parameter, RequestedOutput

__all__ = ["RestServer"]

HEADER_LENGTH = "Inference-Header-Content-Length"
# Content types a body may claim: JSON, the binary extension, and what `curl -d` sends unasked.
CONTENT_TYPES = frozenset(
    {"application/json", "application/octet-stream", "application/x-www-form-urlencoded", "text/plain"}
)
ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})  # decompressed by aiohttp, bounded as the body is
Handler = Callable[[web.BaseRequest, str, str], Awaitable[web.StreamResponse]]


class _ClientFaults(logging.Filter):
    """aiohttp logs a request its HTTP parser refused (the client's fault, answered 400) as an error with
    a traceback that quotes the client's bytes: dropped, so that no client writes to the server's log.
    Every other error passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))


log = logging.getLogger("qkv.http")
log.addFilter(_ClientFaults())


class _Refused(Exception):
    """A request answered before it reaches a model: its HTTP status and message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.close = close  # the connection closes after the answer: what is left of the body is not read


@dataclass(frozen=True)
class _Route:
    endpoint: str  # the metric label
    method: str
    handler: Handler
    open: bool = False  # answered without a bearer token (probes)
    repository: bool = False  # the repository extension: an admin token, when the server has them


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _failed(e: ServingError) -> web.Response:
    headers = {}
    if e.retry_after_ms is not None:  # gRPC's grpc-retry-pushback-ms, in HTTP's whole seconds
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_ms / 1000)))
    return _error(http_status(e), e.message, headers)


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(doc, separators=(",", ":")).encode(), status=status, content_type="application/json"
    )


def _event(kind: str, doc: Any) -> bytes:
    """One server-sent event: `data: JSON`, after `event: KIND` when it has one."""
    head = f"event: {kind}\n" if kind else ""
    return f"{head}data: {json.dumps(doc)}\n\n".encode()


def _utf8(text: str) -> bool:
    """Whether a string can travel as UTF-8: not one that holds a lone surrogate (aiohttp decodes a header's
    bytes that are not UTF-8 into them)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class _TextInput:
    """generate's body."""

    text: str
    id: str
    parameters: dict[str, Parameter]
    caller: Caller | None = None  # whose token sent it (--isolate-tokens)

    def request(
        self, model: str, version: str, text: str, method: str, carrier: Any, io: tuple[str, tuple[str, ...]]
    ) -> InferRequest:
        """What generate sends the model: its text input [1], as a gRPC client would, and the outputs its kind
        asks for (`io`: the model's TakesText.text_io). The text's UTF-8 is the element, not encoded further."""
        name, outputs = io
        tensor = InferInput(name, "BYTES", (1,), FlatSource(np.array([text.encode()], dtype=object)))
        asked = tuple(RequestedOutput(name) for name in outputs)
        return InferRequest(
            model, version, self.id, [tensor], asked, self.parameters, None, carrier, method, caller=self.caller
        )


class RestServer:
    """The HTTP/REST front end of one `Server`: bind at start (a port in use stops it), serve, stop."""

    def __init__(
        self,
        plane: DataPlane,
        metrics: Metrics,
        settings: ServerSettings,
        tokens: BearerTokens,
        tls: ssl.SSLContext | None,
        regions: shared_memory.SharedMemoryRegistry,
    ) -> None:
        self.plane, self.settings, self.tls = plane, settings, tls
        self.regions = regions  # Triton's system shared memory: the registered regions
        self.tokens = tokens
        self.counter = metrics.http_requests
        self._socket: socket.socket | None = None
        self._runner: web.ServerRunner | None = None
        model = {
            "": _Route("model_metadata", "GET", self._metadata),
            "ready": _Route("model_ready", "GET", self._model_ready, open=True),
            "infer": _Route("infer", "POST", self._infer),
            "config": _Route("model_config", "GET", self._config),
            "stats": _Route("model_stats", "GET", self._stats),
            "generate": _Route("generate", "POST", self._generate),
            "generate_stream": _Route("generate_stream", "POST", self._generate_stream),
        }
        self._model_routes = model
        self._server_routes = {
            (): _Route("server_metadata", "GET", self._server_metadata),
            ("health", "live"): _Route("live", "GET", self._live, open=True),
            ("health", "ready"): _Route("ready", "GET", self._ready, open=True),
            ("models", "stats"): _Route("model_stats", "GET", self._stats),
            ("repository", "index"): _Route("repository_index", "POST", self._index, repository=True),
        }
        self._repository_routes = {
            "load": _Route("repository_load", "POST", self._load, repository=True),
            "unload": _Route("repository_unload", "POST", self._unload, repository=True),
        }
        self._shared_memory_routes: dict[str, tuple[str, Callable[..., Awaitable[web.Response]]]] = {
            "status": ("GET", self._shm_status),  # each takes the region's name first ("": every region)
            "register": ("POST", self._shm_register),
            "unregister": ("POST", self._shm_unregister),
        }
        self._text = TextApi(plane, self._body)  # OpenAI- and TEI-shaped endpoints of text models
        # Generating models: OpenAI's completions and chat, Triton's generate (docs/generation.md).
        self._completions = CompletionsApi(plane, self._body)
        self._triton_generate = TritonGenerate(plane)

    # --- lifecycle ------------------------------------------------------------------------------------

    def bind(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Bind the port now, so that a port in use stops the start before the models warm up; `reuse_port`:
        shared with the other processes that bind it so (SO_REUSEPORT: workers behind one port)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, port), family=family, backlog=1024, reuse_port=reuse_port)
        except OSError as e:
            raise ConfigError("--http-port", f"cannot bind the HTTP port {host}:{port}: {e.strerror}") from None
        return int(self._socket.getsockname()[1])

    async def start(self) -> None:
        assert self._socket is not None, "bind first"
        loop = asyncio.get_running_loop()
        limit = self.settings.max_message_bytes

        def request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            if message is ERROR:  # aiohttp's parser refused the request (always 400): _handle never sees it
                self.counter.labels("", "unknown", "400").inc()
            return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=limit)

        server = web.Server(
            self._handle,
            request_factory=request,
            handler_cancellation=True,  # a client that leaves cancels its request, as on gRPC
            keepalive_timeout=self.settings.http_timeout,  # also bounds a request's headers: a slow client
            logger=log,
            access_log=None,  # --access-log writes one line per inference request, whatever the protocol
            lingering_time=self.settings.http_timeout,  # the unread rest of a refused body, read and dropped
        )
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=self.settings.grace_period)
        await self._runner.setup()
        await web.SockSite(self._runner, self._socket, ssl_context=self.tls, backlog=1024).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # --- every request --------------------------------------------------------------------------------

    def _route(self, request: web.BaseRequest) -> tuple[_Route, str, str]:
        """The route of a path, with the model and version it names; 404 or 405 when there is none."""
        raw = request.rel_url.raw_path
        parts = [urllib.parse.unquote(p) for p in raw.strip("/").split("/")]
        route, model, version = None, "", ""
        if parts[:1] == ["v2"]:
            rest = tuple(parts[1:])
            route = self._server_routes.get(rest)
            if route is None and len(rest) == 4 and rest[:2] == ("repository", "models"):
                model, route = rest[2], self._repository_routes.get(rest[3])
            if route is None and len(rest) >= 2 and rest[0] == "models":
                model, tail = rest[1], list(rest[2:])
                if tail[:1] == ["versions"] and len(tail) >= 2:
                    version, tail = tail[1], tail[2:]
                if len(tail) <= 1:
                    route = self._model_routes.get(tail[0] if tail else "")
            if route is None and rest[:1] in (("systemsharedmemory",), ("cudasharedmemory",)):
                route = self._shared_memory_route(rest)
        if route is None and (text := self._text.route(tuple(parts))) is not None:
            route = _Route(*text)
        if route is None and (completions := self._completions.route(tuple(parts))) is not None:
            route = _Route(*completions)
        if route is None:
            raise _Refused(404, f"no endpoint {quote(raw)}: the v2 protocol's paths start /v2 (docs/design.md)")
        if request.method != route.method and not (route.method == "GET" and request.method == "HEAD"):
            raise _Refused(405, f"{route.method} is the method of {quote(raw)}", {"Allow": route.method})
        return route, model, version

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        endpoint, model = "unknown", ""
        try:
            route, model, version = self._route(request)
            endpoint = route.endpoint
            authorization = request.headers.get("Authorization")
            if authorization is not None and not _utf8(authorization):  # bytes no token has: no token
                authorization = None
            if not route.open and not self.tokens.allows(authorization, route.repository):
                which = "admin " if self.tokens.wants_admin(route.repository) else ""
                raise _Refused(
                    401,
                    f"missing or invalid {which}bearer token (send header 'Authorization: Bearer TOKEN')",
                    {"WWW-Authenticate": "Bearer"},
                )
            response = await route.handler(request, model, version)
        except _Refused as e:
            response = _error(e.status, e.message, e.headers)
            if e.close:
                response.force_close()
        except ServingError as e:
            response = _failed(e)
        except web.HTTPException as e:  # aiohttp's own refusal, answered as ours are
            response = _error(e.status, e.reason)
        except (ConnectionError, asyncio.CancelledError):  # the client left: nobody reads an answer
            self.counter.labels(self._label(model), endpoint, "499").inc()
            raise
        except Exception:  # a fault of the server's, never the client's: its traceback logged, once
            log.exception("%s %s failed inside the server", request.method, clip(request.rel_url.raw_path))
            response = _error(500, "the server failed on this request: its log has the details")
        self.counter.labels(self._label(model), endpoint, str(response.status)).inc()
        return response

    def _label(self, model: str) -> str:
        return model if self.plane.in_repository(model) else UNKNOWN_MODEL if model else ""

    async def _body(self, request: web.BaseRequest) -> bytes:
        """The request's body, within --max-message-bytes and --http-timeout, of a type JSON can be in."""
        media = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media and media not in CONTENT_TYPES:
            raise _Refused(
                415, f"Content-Type {quote(media)}: send application/json, or the binary extension's octet-stream"
            )
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ENCODINGS:
            raise _Refused(415, f"Content-Encoding {quote(encoding)}: gzip, deflate or none")
        limit = self.settings.max_message_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _Refused(
                413,
                f"the body is {request.content_length:,} bytes, the limit is {limit:,} (--max-message-bytes)",
                close=True,
            )
        try:
            async with asyncio.timeout(self.settings.http_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _Refused(
                413, f"the body is over the limit of {limit:,} bytes (--max-message-bytes)", close=True
            ) from None
        except TimeoutError:
            request.content.feed_eof()  # nothing more is waited for: answer, then close
            timeout = self.settings.http_timeout
            message = f"the body did not arrive within {timeout:g} s (more Content-Length than body?)"
            raise _Refused(408, message, close=True) from None
        except (HttpProcessingError, RequestPayloadError) as e:  # a broken chunked or compressed body
            request.content.feed_eof()  # what follows is not read: aiohttp would raise the error again
            raise _Refused(
                400, f"the body cannot be read: {quote(' '.join(str(e).split()), 200)}", close=True
            ) from None

    # --- health and metadata --------------------------------------------------------------------------

    async def _live(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        return web.Response(status=200 if self.plane.live() else 503)

    async def _ready(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        return web.Response(status=200 if self.plane.ready() else 503)

    async def _model_ready(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        if self.plane.model_ready(model, version):
            return web.Response(status=200)
        # Not ready: a model it does not serve is 404 with gRPC's message, a served one (draining) 503.
        self.plane.model(model, version)
        return _error(503, f"model {quote(model)} is not ready: the server is shutting down")

    async def _server_metadata(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        return _json(message_json(server_metadata_message(self.plane.server_info(), self.regions.extensions)))

    async def _metadata(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        m = self.plane.model(model, version)
        return _json(message_json(metadata_message(m, self.plane.versions(m.name))))

    async def _config(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        answer = config_message(self.plane.model(model, version))
        return _json(message_json(answer.config))  # Triton answers the config itself, unwrapped

    async def _stats(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        chosen = await self.plane.summed_statistics(model, version)
        answer = statistics_message(chosen, self.plane.cache, self._caller(request))
        return _json(message_json(answer))

    async def _load(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        """Triton's load: {"parameters": {"config": "<config.json as a string>"}} (the body is optional)."""
        body = await self._body(request)
        doc = parse_json(body) if body.strip() else {}
        params = doc.get("parameters", {})
        if not isinstance(params, dict):
            raise InvalidArgument('"parameters" must be an object')
        for key, value in params.items():
            if not isinstance(value, str):
                raise InvalidArgument(f"load parameter {quote(str(key))} must be a string")
        await self.plane.load(model, params)
        return web.Response(status=200)

    async def _unload(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        await self._body(request)  # Triton's unload_dependents parameter: nothing depends on a qkv model
        await self.plane.unload(model)
        return web.Response(status=200)

    def _carrier(self, request: web.BaseRequest) -> Any:
        """The request's headers, for a traceparent, when the server traces."""
        return request.headers if self.plane.traced else None

    async def _index(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        body = await self._body(request)
        only_ready = bool(parse_json(body).get("ready", False)) if body.strip() else False
        models = message_json(index_message(self.plane.index()))["models"]
        return _json([m for m in models if not only_ready or m["state"] == "READY"])

    # --- Triton's shared memory extensions (service/frontends/shared_memory.py) -------------------------

    def _shared_memory_route(self, rest: tuple[str, ...]) -> _Route | None:
        """KIND[/region/NAME]/status, KIND/region/NAME/register, KIND[/region/NAME]/unregister, KIND being
        systemsharedmemory or cudasharedmemory (answered 501: qkv has none)."""
        tail, name = list(rest[1:]), ""
        if len(tail) == 3 and tail[0] == "region":
            name, tail = tail[1], tail[2:]
        if len(tail) != 1 or tail[0] not in self._shared_memory_routes or (tail[0] == "register" and not name):
            return None
        method, handler = self._shared_memory_routes[tail[0]]
        if rest[0] == "cudasharedmemory":  # every region unregistered: there is none, so done
            done = tail[0] == "unregister" and not name
            return _Route("cuda_shared_memory", method, self._no_cuda_left if done else self._no_cuda)
        return _Route(f"shared_memory_{tail[0]}", method, partial(handler, name))

    async def _no_cuda(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        return _error(HTTP_STATUS["UNIMPLEMENTED"], shared_memory.CUDA_UNIMPLEMENTED)

    async def _no_cuda_left(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        await self._body(request)
        return web.Response(status=200)

    def _authorization(self, request: web.BaseRequest) -> str | None:
        authorization = request.headers.get("Authorization")
        return authorization if authorization is not None and _utf8(authorization) else None

    def _caller(self, request: web.BaseRequest) -> Caller | None:
        """Whose token sent the request, with --isolate-tokens (service/callers.py)."""
        return self.tokens.caller(self._authorization(request)) if self.tokens.isolate else None

    def _may_change_shm(self, request: web.BaseRequest, what: str) -> None:
        shared_memory.check_may_change(request.remote, self._authorization(request), self.tokens, what)

    def _uid(self, request: web.BaseRequest) -> int | None:
        """The local user of the peer, when it is one of this host's (service/frontends/peers.py)."""
        transport = request.transport
        if transport is None:
            return None
        peer, server = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        if not isinstance(peer, tuple) or not isinstance(server, tuple):  # a Unix socket's are strings
            return None
        return peer_uid((str(peer[0]), int(peer[1])), (str(server[0]), int(server[1])))

    async def _shm_status(self, name: str, request: web.BaseRequest, model: str, version: str) -> web.Response:
        regions = self.regions.status(name, self._caller(request))
        return _json([vars(s) for s in regions])

    async def _shm_register(self, name: str, request: web.BaseRequest, model: str, version: str) -> web.Response:
        """Body: {"key": "/NAME", "offset": 0, "byte_size": N} (offset optional)."""
        self._may_change_shm(request, "registering shared memory")
        doc = parse_json(await self._body(request))
        key = doc.get("key")
        if not isinstance(key, str):
            raise InvalidArgument('the body must have "key": the shared memory object\'s name, a string')
        sizes = []
        for field, default in (("offset", 0), ("byte_size", None)):
            value = doc.get(field, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f'"{field}" must be a non-negative integer')
            sizes.append(value)
        offset, byte_size = sizes
        uid = await asyncio.to_thread(self._uid, request)  # a thread: without sock_diag, /proc/net/tcp (10-20 ms)
        await self.regions.change("register", name, key, offset, byte_size, uid, self._caller(request))
        return web.Response(status=200)

    async def _shm_unregister(self, name: str, request: web.BaseRequest, model: str, version: str) -> web.Response:
        self._may_change_shm(request, "unregistering shared memory")
        await self._body(request)  # empty, as Triton's
        await self.regions.change("unregister", name, self._caller(request))
        return web.Response(status=200)

    # --- inference ------------------------------------------------------------------------------------

    def _attach(
        self, parsed: InferBody, request: web.BaseRequest, caller: Caller | None
    ) -> shared_memory.RequestMemory | None:
        """The shared memory regions a request's tensors name, leased; its inputs there read from them."""
        if not parsed.shared_inputs and not parsed.shared_outputs:
            return None
        memory = self.regions.attach(parsed.shared_inputs, parsed.shared_outputs, partial(self._uid, request), caller)
        if memory is None:
            return None
        parsed.request.inputs = [
            InferInput(i.name, i.datatype, i.shape, source) if (source := memory.source(i.name)) is not None else i
            for i in parsed.request.inputs
        ]
        return memory

    async def _infer(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        body = await self._body(request)
        parsed: InferBody = parse_infer(body, request.headers.get(HEADER_LENGTH), model, version)
        parsed.request.trace_context = self._carrier(request)
        parsed.request.caller = self._caller(request)
        memory = self._attach(parsed, request, parsed.request.caller)
        try:
            outcome = await self.plane.infer(parsed.request)
            if isinstance(outcome, ServingError):
                return _failed(outcome)
            data, header_length = encode_infer(outcome, parsed, memory)
        finally:
            if memory is not None:
                memory.close()
        if header_length is None:
            return web.Response(body=data, content_type="application/json")
        return web.Response(
            body=data, content_type="application/octet-stream", headers={HEADER_LENGTH: str(header_length)}
        )

    async def _text_input(self, request: web.BaseRequest) -> _TextInput:
        """generate's body: {"text_input": "...", "id": "...", "parameters": {...}}."""
        doc = parse_json(await self._body(request))
        text = doc.get("text_input")
        if not isinstance(text, str):
            raise InvalidArgument('the body must have "text_input": a string of words')
        request_id = doc.get("id", "")
        if not isinstance(request_id, str):
            raise InvalidArgument("id must be a string")
        return _TextInput(text, request_id, parameters(doc.get("parameters", {})), self._caller(request))

    async def _generate(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        """Triton's generate extension: text in, text out, and each word's phonemes beside it; a generating
        model's continuation of the text (service/frontends/triton_generate.py)."""
        if generates(self.plane, model, version):
            return await self._triton_generate.generate(parse_json(await self._body(request)), model, version)
        body = await self._text_input(request)
        method = "POST /v2/models/{model}/generate"
        text = self._text_model(model, version)
        outcome = await self.plane.infer(
            body.request(model, version, body.text, method, self._carrier(request), text.text_io(True))
        )
        if isinstance(outcome, ServingError):
            return _failed(outcome)
        said, words = text.text_answer(outcome.outputs)
        doc = self._generated(outcome, said)
        if words is not None:  # each word as the model read it ("$5": five, dollars), its answer, where it came
            doc["words"] = words  # from, and why it has none
        return _json(doc)

    def _text_model(self, model: str, version: str) -> TakesText:
        """The model generate reads text with; NotFound (or Unavailable) when it is not served, InvalidArgument
        when its kind takes no text."""
        served = self.plane.model(model, version)
        text = capability(served, TakesText)
        if text is None:
            raise InvalidArgument(
                f"model {quote(model)} takes no text (its kind: {served.metadata.kind}): generate is for a model "
                "that reads or generates text"
            )
        return text

    @staticmethod
    def _generated(outcome: InferResponse, text_output: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"model_name": outcome.model_name, "model_version": outcome.model_version}
        if outcome.id:
            doc["id"] = outcome.id
        doc["text_output"] = text_output
        return doc

    def _stream_words(self, text: TakesText, said: str) -> list[tuple[str, str]]:
        """generate_stream's requests: each token of `said` that holds a word (and the word); the whole text
        as one when there is none: its answer says why."""
        words = text.text_words(said) or [(said, said)]
        if len(words) > 1 and len(words) > (limit := text.max_text_words()):
            raise InvalidArgument(f"text_input has {len(words)} words, the limit is {limit} (the model's max_words)")
        return words

    async def _generate_stream(self, request: web.BaseRequest, model: str, version: str) -> web.StreamResponse:
        """generate as server-sent events: each word is its own request, all sent at once (they batch
        together), and each word's event goes out, in the text's order, as soon as it and those before it
        are done; a last event carries the whole text_output. Until the first word is done the answer can
        still be an error status; a later failure is an `error` event, and the stream ends. A generating
        model's answer is one event a chunk (service/frontends/triton_generate.py)."""
        if generates(self.plane, model, version):
            doc = parse_json(await self._body(request))
            return await self._triton_generate.generate_stream(request, doc, model, version)
        body = await self._text_input(request)
        text = self._text_model(model, version)
        words = self._stream_words(text, body.text)
        method = "POST /v2/models/{model}/generate_stream"
        io = text.text_io(False)
        tasks = [
            asyncio.create_task(self.plane.infer(body.request(model, version, token, method, None, io)))
            for token, _ in words
        ]
        try:
            first = await tasks[0]
            if isinstance(first, ServingError):
                return _failed(first)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                await self._events(response, text, tasks, first, [w for _, w in words])
            except ConnectionError:  # the client left mid-stream: its 200 is answered, the rest unread
                return response
            except Exception:  # the status is sent: the fault ends the stream, logged, as an error event
                log.exception("generate_stream failed inside the server")
                with contextlib.suppress(ConnectionError):
                    await response.write(_event("error", {"error": "the server failed: its log has the details"}))
            await response.write_eof()
            return response
        finally:
            for task in tasks:
                task.cancel()

    async def _events(
        self,
        response: web.StreamResponse,
        text: TakesText,
        tasks: list[asyncio.Task[InferResponse | ServingError]],
        first: InferResponse,
        words: list[str],
    ) -> None:
        """generate_stream's events: each word's in order, then the whole text, or an error event and the end."""
        said = []
        for index, task in enumerate(tasks):
            outcome = first if index == 0 else await task
            if isinstance(outcome, ServingError):
                await response.write(_event("error", {"error": outcome.message}))
                return
            answer, _ = text.text_answer(outcome.outputs)
            said.append(answer)
            event = self._generated(outcome, answer) | {"index": index, "word": words[index]}
            await response.write(_event("", event))
        final = self._generated(first, " | ".join(said)) | {"final": True}
        await response.write(_event("", final))
