"""The data plane: what every front end asks of the served models, free of any transport.

gRPC (service/frontends/grpc_api.py) and REST (service/frontends/rest_api.py) decode their wire format
into an `InferRequest` (service/serving/dataplane_types.py), await `DataPlane.infer`, and encode the
`InferResponse`; so requests of both batch together and share admission, limits, metrics, statistics,
traces, the access log and every error message. `infer` is a line of small steps around the model's own
`infer`: look the version up, refuse early, decode, infer, then count the answer everywhere it is counted.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from ipaddress import ip_address
from typing import TYPE_CHECKING, Any

import numpy as np

from service import __version__
from service.callers import CALLER
from service.config import ServerSettings
from service.datatypes import encode_bytes
from service.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ServingError,
    Unavailable,
    clip,
    quote,
)
from service.models.catalog import AdmitsEarly, CachesParts, ServedVersion, capability, input_limits
from service.models.classification import classify
from service.models.common import Result
from service.models.response_cache import ResponseCache, deep_size
from service.models.response_cache import key as cache_key
from service.observability import logs
from service.observability.metrics import UNKNOWN_MODEL, Metrics, VersionSeries, seq_len_bucket
from service.priority import ComputeThreads
from service.repository.ensemble_config import EnsembleStep
from service.repository.layout import parse_config
from service.serving.dataplane_types import InferInput, InferRequest, InferResponse, Parameter, RequestedOutput
from service.serving.registry import READY, UNAVAILABLE, ModelRegistry, VersionState

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["EXTENSIONS", "MAX_ID_CHARS", "MAX_PARAMETERS", "SERVER_NAME", "DataPlane", "ServerInfo"]

SERVER_NAME = "qkv"
EXTENSIONS = ("classification", "model_configuration", "statistics", "model_repository")
MAX_PARAMETERS = 64  # a request's parameters, at most (qkv reads a handful; HTTP adds a few of Triton's)
MAX_ID_CHARS = 256  # a request id (echoed in its answer); longer ones are refused
# A request with more input elements than this is decoded on a worker thread, so that the event loop
# answers others (and health checks) meanwhile; smaller ones cost less than the thread hop.
THREAD_ELEMENTS = 1 << 14
LARGE_FIELDS = 64  # a request with more entries than this in its inputs, outputs and parameters is large


@dataclass(frozen=True)
class ServerInfo:
    """ServerMetadata's answer."""

    name: str
    version: str
    extensions: tuple[str, ...]


def _loopback(host: str) -> bool:
    """Whether the server listens on loopback only."""
    if host == "localhost":
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class DataPlane:
    """The served models as both front ends see them: health, metadata, statistics, the repository, and
    inference. It also holds the server's serving state: draining, and the requests inside a model."""

    def __init__(
        self,
        settings: ServerSettings,
        metrics: Metrics,
        tracing: Tracing | None = None,
        after_large: Callable[[], None] | None = None,
        cache: ResponseCache[Result] | None = None,
        changed: Callable[[str, bool], Awaitable[None]] | None = None,
        compute: ComputeThreads | None = None,
    ) -> None:
        self.metrics, self.settings, self.tracing = metrics, settings, tracing
        # The served models, loaded on `compute`'s threads; the ensembles among them run their steps here.
        # `changed(name, ready)`: the server's health follows the models.
        self.registry = ModelRegistry(settings, metrics, changed, tracing, cache, steps=self, compute=compute)
        self.cache = cache  # --cache-size: answers of the models whose config.json enables response_cache
        # Called after a large or refused request: the server hands the freed heap back to the system.
        self._after_large = after_large
        self.draining = False
        # each version's series, labelled once (they go with the version: its series are removed at unload)
        self._series: weakref.WeakKeyDictionary[ServedVersion, VersionSeries] = weakref.WeakKeyDictionary()
        self.active = 0  # requests inside a model right now
        self.last_arrival = 0.0  # monotonic time of the latest inference request

    def large_request_done(self) -> None:
        """A large or refused request is done (answered here, or refused on the wire by a front end): the heap
        it held goes back to the system."""
        if self._after_large is not None:
            self._after_large()

    @property
    def traced(self) -> bool:
        """Whether requests are traced: a front end hands over its call's metadata or headers only then."""
        return self.tracing is not None

    # --- health and metadata ------------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Not draining; and, with --strict-readiness (the default), every model loaded or tried is ready."""
        return not self.draining and (not self.settings.strict_readiness or not self.registry.unavailable())

    def server_info(self) -> ServerInfo:
        return ServerInfo(self.settings.server_name, __version__, EXTENSIONS)

    def model(self, name: str, version: str = "") -> ServedVersion:
        """The version asked for, or the newest ready one; NotFound or Unavailable saying why not."""
        return self.registry.get(name, version)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.model(name, version)
        except ServingError:
            return False
        return not self.draining

    def versions(self, name: str) -> list[ServedVersion]:
        """Every served version of `name`, oldest first."""
        return self.registry.versions(name)

    def statistics(self, name: str = "", version: str = "") -> list[ServedVersion]:
        """The versions ModelStatistics reports: the one named, each of a model's, or every served one."""
        if version:
            return [self.model(name, version)]
        return self.versions(name) if name else self.registry.served()

    async def summed_statistics(self, name: str = "", version: str = "") -> list[ServedVersion]:
        """The statistics extension's answer: this process's (a worker's sums its peers', workers/routing.py)."""
        return self.statistics(name, version)

    def in_repository(self, name: str) -> bool:
        """Whether `name` is a model of the repository (a metric may carry it as a label)."""
        return name in self.registry.models

    def index(self, ready_only: bool = False) -> list[VersionState]:
        """The repository index; while draining, no version is READY."""
        rows = self.registry.index(ready_only=ready_only)
        if not self.draining:
            return rows
        return [VersionState(r.name, r.version, UNAVAILABLE, r.reason) if r.state == READY else r for r in rows]

    # --- model control ------------------------------------------------------------------------------

    async def load(self, name: str, parameters: Mapping[str, Parameter], repository: str = "") -> None:
        """Load or reload `name`; parameter `config` (a config.json as a string) overrides its file."""
        self._may_change_repository(repository)
        raw = None
        for key, value in parameters.items():
            if key != "config":
                raise InvalidArgument(  # Triton's words first, as it answers a `file:` override it cannot use
                    f"failed to load {quote(name)}, failed to poll from model repository: load parameter "
                    f"{quote(key)} is not supported: qkv loads model files from its repository; 'config' "
                    "(a config.json as a string) is the one parameter"
                )
            try:
                raw = parse_config(value)  # type: ignore[arg-type]  # bounded in size and depth: no RecursionError
            except (TypeError, ValueError) as e:
                raise InvalidArgument(
                    f"failed to load {quote(name)}: load parameter 'config' is not JSON: {e}"
                ) from None
            if not isinstance(raw, dict):
                raise InvalidArgument(
                    f"failed to load {quote(name)}: load parameter 'config' must be a JSON object, "
                    f"got {type(raw).__name__}"
                )
        await self.registry.load(name, raw)

    async def unload(self, name: str, repository: str = "") -> None:
        self._may_change_repository(repository)
        await self.registry.unload(name)

    def _may_change_repository(self, repository: str) -> None:
        """Load and unload: only with model control on, and, without an admin token, only from loopback
        (docs/security.md)."""
        s = self.settings
        if self.draining:
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

    # --- inference ----------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse | ServingError:
        """One inference request from start to finish, counted in the metrics and statistics (and traced,
        when the server traces): its answer, or the ServingError to answer it with. The error is returned,
        not raised, without its traceback: the frames would hold the request (up to --max-message-bytes)
        in a cycle until a full garbage collection."""
        start = time.perf_counter()
        self.last_arrival = time.monotonic()
        trace = self._trace(request)
        model: ServedVersion | None = None
        series: VersionSeries | None = None
        code, seq_len = "OK", 0
        outcome: InferResponse | ServingError | None = None
        try:
            model = self._lookup(request)
            series = self.series(model)
            series.inflight.inc()
            result = await self._admitted(model, request, trace)
            seq_len = result.seq_len
            series.tokens_in.inc(result.tokens_in)
            series.tokens_out.inc(result.tokens_out)
            outcome = InferResponse(model.name, model.version, request.id, result.outputs, seq_len)
        except ServingError as e:
            code = e.code
            e.__context__ = e.__cause__ = None
            outcome = e.with_traceback(None)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            seconds = time.perf_counter() - start
            if model is not None:
                model.stats.answered(code == "OK", int(seconds * 1e9))
            self._count_request(request, series, code, seconds, seq_len, trace)
            if self.tracing is not None and trace is not None:
                self.tracing.finish(trace, code, outcome, model, seq_len)
            self._log_access(request, code, seconds, seq_len)
            if model is not None:
                model.in_flight.leave()
            # (an ensemble's step with a large answer: an intermediate, which a small request can make)
            if code == "INVALID_ARGUMENT" or _large(request) or (request.step_of and _large_answer(outcome)):
                self.large_request_done()
        assert outcome is not None  # answered, or refused with a ServingError
        return outcome

    def _trace(self, request: InferRequest) -> RequestTrace | None:
        """The request's trace, when sampled: an ensemble's step is traced when its ensemble's request is."""
        if self.tracing is None:
            return None
        if request.step_of:
            return self.tracing.start_step(request.parent_trace, request.method)
        return self.tracing.start(request.trace_context, request.method)

    # --- ensembles' steps (service/models/ensemble/model.py `Steps`) --------------------------------------

    def step_model(self, name: str, version: str) -> ServedVersion:
        return self.registry.get(name, version)

    async def run_step(
        self,
        ensemble: str,
        step: EnsembleStep,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> tuple[dict[str, np.ndarray], int]:
        """One step of an ensemble's request, as a request to the step's model: arrays handed over as they are,
        counted, traced and logged as any request."""
        request = InferRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            inputs=[InferInput.of(name, array) for name, array in inputs.items()],
            outputs=[RequestedOutput(name) for name in outputs],
            parameters=params,
            deadline=deadline,
            method=f"qkv.ensemble.step.{step.position}",
            step_of=ensemble,
            parent_trace=trace,
            caller=CALLER.get(),
        )
        outcome = await self.infer(request)
        if isinstance(outcome, ServingError):
            raise outcome
        return outcome.outputs, outcome.seq_len

    def _lookup(self, request: InferRequest) -> ServedVersion:
        """The version the request names, counted in flight from here to its answer."""
        if len(request.id) > MAX_ID_CHARS:  # an id comes back in the answer: bound it, as every string
            raise InvalidArgument(f"request id {quote(request.id)} is too long: the limit is {MAX_ID_CHARS}")
        model = self.model(request.model_name, request.model_version)
        model.in_flight.enter()  # a leaving version is freed, and its series go, once none is held
        return model

    def series(self, model: ServedVersion) -> VersionSeries:
        found = self._series.get(model)
        if found is None:
            found = self._series[model] = VersionSeries(self.metrics, model.name, model.version)
        return found

    async def _admitted(self, model: ServedVersion, request: InferRequest, trace: RequestTrace | None) -> Result:
        """The model's result, for a request that passes the drain, admission and the model's checks."""
        if self.draining and not request.step_of:  # a step's ensemble request was admitted before the drain
            raise Unavailable("the server is shutting down")
        self.active += 1
        caller = CALLER.set(request.caller)  # whose state a stateful model keeps (a step's: its ensemble's caller)
        try:
            # What any request would be refused now is refused before its tensors are decoded:
            # under overload, refusing is most of the work and must stay cheap.
            if (early := capability(model, AdmitsEarly)) is not None:
                early.admit_early(request.deadline)
            _check_counts(request, model)
            inputs = await _decode(request, model)
            outputs = [o.name for o in request.outputs]
            params = dict(request.parameters.items()) if len(request.parameters) else {}
            infer = partial(model.infer, inputs, outputs, params, request.deadline, trace)
            cache = self.cache
            if cache is not None and model.config.response_cache and capability(model, CachesParts) is None:
                k = _cache_key(model, inputs, outputs, params)

                async def kept() -> Result:
                    return _owned(await infer())

                result, _ = await cache.get_or_compute(k, model.name, model.version, kept, deep_size, request.deadline)
            else:
                result = await infer()
            classified = await _classified(request, model, result.outputs)
            return result if classified is result.outputs else replace(result, outputs=classified)
        finally:
            CALLER.reset(caller)
            self.active -= 1

    def _count_request(
        self,
        request: InferRequest,
        series: VersionSeries | None,
        code: str,
        seconds: float,
        seq_len: int,
        trace: RequestTrace | None,
    ) -> None:
        """qkv_requests_total, and the latency of a request answered OK; the in-flight gauge let go of."""
        if series is None:  # no version took it
            label = request.model_name if self.in_repository(request.model_name) else UNKNOWN_MODEL
            self.metrics.requests.labels(label, "", code).inc()
            return
        series.inflight.dec()
        series.requests(code).inc()
        if code == "OK":  # a sampled request's trace id is its exemplar (shown in the OpenMetrics format)
            exemplar = trace.exemplar if trace is not None else None
            series.duration(seq_len_bucket(seq_len)).observe(seconds, exemplar)

    def _log_access(self, request: InferRequest, code: str, seconds: float, seq_len: int) -> None:
        """--access-log: one JSON line, whatever the client's strings hold."""
        if self.settings.access_log:
            line = {"model": clip(request.model_name), "seq_len": seq_len, "code": code, "ms": round(seconds * 1e3, 3)}
            logs.access.info(json.dumps(line | {"id": clip(request.id)}))


# Request parameters that change how an answer travels or when, never what it is: left out of cache keys.
TRANSPORT_PARAMETERS = frozenset({"timeout", "priority", "binary_data_output", "triton_enable_empty_final_response"})


def _cache_key(
    model: ServedVersion, inputs: dict[str, np.ndarray], outputs: list[str], params: dict[str, Any]
) -> bytes:
    """All that determines an answer: the model version, each input's name, datatype, shape and bytes, the
    outputs asked for, and the parameters that matter."""
    # id(model): a version reloaded in place is another object, and never answers from its predecessor's entries
    # (which go when the predecessor is freed, after its last request)
    parts: list[bytes | str | int] = [model.name, model.version, id(model), len(inputs)]
    for name in sorted(inputs):
        a = inputs[name]
        data = encode_bytes(a) if a.dtype == np.object_ else np.ascontiguousarray(a).tobytes()
        parts += [name, a.dtype.str, repr(a.shape), data]
    parts += [len(outputs), *sorted(outputs)]
    kept = sorted((k, repr(v)) for k, v in params.items() if k not in TRANSPORT_PARAMETERS)
    parts += [len(kept), *(x for kv in kept for x in kv)]
    return cache_key(parts)


def _owned(result: Result) -> Result:
    """`result` with each output an array of its own: a kept answer holds its rows, not its batch's."""
    outputs = {n: a.copy() if a.base is not None else a for n, a in result.outputs.items()}
    return replace(result, outputs=outputs)


async def _classified(
    request: InferRequest, model: ServedVersion, outputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Outputs asked for with Triton's `classification` parameter, as their top k classes (BYTES); on a
    worker thread when the outputs are large, so that the event loop answers others meanwhile."""
    asked = {o.name: o.parameters["classification"] for o in request.outputs if "classification" in o.parameters}
    if not asked:
        return outputs
    counts: dict[str, int] = {}
    for name, count in asked.items():
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidArgument(f"output {quote(name)}: classification must be an integer class count")
        counts[name] = count
    labels = {d["name"]: d.get("labels", ()) for d in model.config.outputs}
    batched = model.metadata.max_batch_size > 0

    def classified() -> dict[str, np.ndarray]:
        out = dict(outputs)
        for name, count in counts.items():
            out[name] = classify(outputs[name], count, labels.get(name, ()), batched, name)
        return out

    if sum(outputs[name].size for name in counts) > THREAD_ELEMENTS:
        return await asyncio.to_thread(classified)
    return classified()


def _large(request: InferRequest) -> bool:
    """Whether a request held many entries or elements (len() alone, for the entries)."""
    fields = len(request.inputs) + len(request.outputs) + len(request.parameters)
    return fields > LARGE_FIELDS or request.elements > THREAD_ELEMENTS


def _large_answer(outcome: InferResponse | ServingError | None) -> bool:
    """Whether an answer held many elements (an ensemble step's intermediate, built by a small request)."""
    return isinstance(outcome, InferResponse) and sum(a.size for a in outcome.outputs.values()) > THREAD_ELEMENTS


def _misnamed(names: Sequence[InferInput] | Sequence[RequestedOutput], known: list[str], what: str, model: str) -> str:
    """Why a sequence of `names` longer than `known` is refused: among its first len(known) + 1 entries,
    one is unknown or named twice (only those are read, however many the request holds)."""
    seen: set[str] = set()
    for k in range(len(known) + 1):
        name = names[k].name
        if name not in known:
            return f"model '{model}' has no {what} {quote(name)} ({what}s: {', '.join(sorted(known))})"
        if name in seen:
            return f"{what} {quote(name)} given twice"
        seen.add(name)
    return ""  # unreachable: len(known) + 1 names among len(known)


def _check_counts(request: InferRequest, model: ServedVersion) -> None:
    """The request's inputs, outputs and parameters counted against their limits (len(), which a front
    end's view of its message answers without building anything) before any is read."""
    inputs = [s.name for s in model.metadata.inputs]
    if len(request.inputs) > len(inputs):
        raise InvalidArgument(
            f"{len(request.inputs)} inputs, model '{model.name}' takes {len(inputs)}: "
            f"{_misnamed(request.inputs, inputs, 'input', model.name)}"
        )
    outputs = [s.name for s in model.metadata.outputs]
    if len(request.outputs) > len(outputs):
        raise InvalidArgument(
            f"{len(request.outputs)} outputs requested, model '{model.name}' has {len(outputs)}: "
            f"{_misnamed(request.outputs, outputs, 'output', model.name)}"
        )
    if len(request.parameters) > MAX_PARAMETERS:
        raise InvalidArgument(f"{len(request.parameters)} parameters, the limit is {MAX_PARAMETERS} (MAX_PARAMETERS)")


async def _decode(request: InferRequest, model: ServedVersion) -> dict[str, np.ndarray]:
    """The request's input tensors as arrays. A large request is decoded on a worker thread, a slice at a
    time, while the event loop goes on answering others."""
    if request.elements > THREAD_ELEMENTS:
        return await asyncio.to_thread(_read_inputs, request.inputs, model)
    return _read_inputs(request.inputs, model)


def _read_inputs(tensors: Sequence[InferInput], model: ServedVersion) -> dict[str, np.ndarray]:
    known = {s.name for s in model.metadata.inputs}
    inputs: dict[str, np.ndarray] = {}
    for tensor in tensors:
        name = tensor.name
        if name in inputs:
            raise InvalidArgument(f"input {quote(name)} given twice")
        if name not in known:  # refused before its contents are read
            raise InvalidArgument(
                f"model '{model.name}' has no input {quote(name)} (inputs: {', '.join(sorted(known))})"
            )
        inputs[name] = tensor.read(input_limits(model, name))
    return inputs
