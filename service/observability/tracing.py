# Over 500 lines: all of the OpenTelemetry binding, the one module importing opentelemetry.
"""OpenTelemetry traces of inference requests: where each request's time went, across services.

Imported only when tracing is on (`--tracing`, `--trace-sample-ratio`, `--tracing-exporter console`
or `--tracing-file`): a server without it never imports opentelemetry, and its request path pays one
`is None` check. The rest of the server sees this module through three hooks (service/scheduling/admission.py):
a sampled request's `RequestTrace` rides on its WorkItem, and the schedulers open a `BatchSpan` per
batch. Exported with the SDK's batch span processor over OTLP, configured by the standard variables
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL grpc or http/protobuf, OTEL_SERVICE_NAME,
OTEL_TRACES_SAMPLER, OTEL_BSP_*), or written one JSON object a span a line, to stdout
(`--tracing-exporter console`) or a file (`--tracing-file`), to be read without a collector.

An OTLP endpoint that does not answer is said once, in one warning that names it (a connection tried
at start, or the first export that fails), and not again until an export succeeds: the exporter's own
lines, one per retry and batch, stay out of the log. Stopping, buffered spans get SHUTDOWN_S to be
exported, none when the endpoint was not answering; then the exporter is stopped where it stands.

One request's spans (the first continues the caller's W3C `traceparent`):

    inference.GRPCInferenceService/ModelInfer   SERVER: rpc.*, qkv.model, qkv.seq_len, qkv.status ...
      qkv.admission   decision, predicted wait
      qkv.queue       admitted -> its batch started
      qkv.compute     (tensor) or qkv.decode (g2p: steps, joins, leaves, beam width); linked to:
    qkv.batch         one per batch run (tensor), or per decoding step that words joined (g2p), or per
                      beam search: batch size, padded tokens, instance; linked to every request in it

A batch serves many traces, so it is a trace of its own, made only when a request in it was sampled,
and then always kept (so no request links to a span that was dropped).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlparse

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    _get_from_env_or_default,
)
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from service import __version__
from service.errors import ConfigError

__all__ = ["BATCH", "BatchSpan", "JoinCounter", "RequestTrace", "Traced", "Tracing"]

SERVICE = "inference.GRPCInferenceService"
BATCH = "qkv.batch"
# The gRPC codes a server span marks as an error (OpenTelemetry's RPC conventions): the server's
# fault, not the caller's (a refused or invalid request is the caller's to handle).
SERVER_ERRORS = {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
PROTOCOLS = ("grpc", "http/protobuf")
SHUTDOWN_S = 0.5  # stopping: the most time buffered spans get to be exported
ABORT_S = 0.1  # of which the last part is for an export cut short (a gRPC call cancelled, a retry's wait woken)
PROBE_S = 1.0  # the connection tried at start to an OTLP endpoint
LOCAL_DELAY_MS = 200  # console and file: spans show promptly (the SDK's default is 5 s, to spare a collector)
# Where the OTLP exporters log a failed export, every retry and batch.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
PROCESSOR_LOGGER = "opentelemetry.sdk._shared_internal"  # the batch processor's "Queue full, dropping span."

log = logging.getLogger("qkv.tracing")


class _Sampler(Sampler):
    """The configured sampler for requests; a batch span always (it is made only for sampled requests)."""

    def __init__(self, requests: Sampler) -> None:
        self.requests = requests

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        if name == BATCH:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self.requests.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"qkv({self.requests.get_description()})"


def _otlp() -> tuple[SpanExporter, str, str]:
    """OTLP over gRPC or HTTP, as OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL says; the exporter reads the rest.
    Returns it, its protocol and the endpoint it sends to."""
    env = os.environ
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter()
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    else:
        why = f"OTLP protocol {protocol!r}: qkv exports traces over {' or '.join(PROTOCOLS)}"
        raise ConfigError("OTEL_EXPORTER_OTLP_PROTOCOL", why)
    # The endpoint as the exporter resolved it (host:port for gRPC, the URL for HTTP).
    return exporter, protocol, str(getattr(exporter, "_endpoint", "") or "")


def _address(endpoint: str) -> tuple[str, int] | None:
    """host and port of an OTLP endpoint (`host:port` or a URL); None when it names no port."""
    url = urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
    try:
        port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    except ValueError:
        return None
    return (url.hostname, port) if url.hostname and port else None


def _ids(context: SpanContext) -> dict[str, str]:
    return {"traceId": format(context.trace_id, "032x"), "spanId": format(context.span_id, "016x")}


def span_json(span: ReadableSpan) -> dict[str, Any]:
    """A span as one JSON object: OTLP's field names, ids in hex, attributes as a plain object."""
    context = span.get_span_context()
    out: dict[str, Any] = {"name": span.name, **(_ids(context) if context is not None else {})}
    if span.parent is not None:
        out["parentSpanId"] = format(span.parent.span_id, "016x")
    start, end = span.start_time or 0, span.end_time or 0
    out |= {"kind": span.kind.name, "startTimeUnixNano": start, "endTimeUnixNano": end,
            "durationMs": round((end - start) / 1e6, 3), "status": span.status.status_code.name}  # fmt: skip
    if span.status.description:
        out["statusMessage"] = span.status.description
    out["attributes"] = {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()}
    if span.links:
        out["links"] = [_ids(link.context) for link in span.links]
    out["service"] = span.resource.attributes.get("service.name", "")
    return out


class JsonLines(SpanExporter):
    """Spans written one JSON object a line (span_json), each batch flushed as it is written."""

    def __init__(self, out: IO[str], close: bool = False) -> None:
        self.out, self.close = out, close

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.out.write("".join(json.dumps(span_json(s)) + "\n" for s in spans))
        self.out.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self.close:
            self.out.close()


class _Reported(SpanExporter):
    """An exporter whose failing is said once: the first failure (or the connection tried at start) logs
    one warning naming where spans go and how to change it, the exporter's own lines are kept out of the
    log, and nothing more is said until an export succeeds again."""

    def __init__(self, inner: SpanExporter, where: str, advice: str) -> None:
        self.inner, self.where, self.advice = inner, where, advice
        self.lock = threading.Lock()
        self.failing = False
        self.stopped = False  # the inner exporter is shut down: what comes is dropped
        self.last_error = ""  # the exporter's latest own line, said in the warning
        self.exported = self.dropped = 0
        self.probe: threading.Thread | None = None  # the connection tried at start, when one is

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.stopped:
            self.dropped += len(spans)
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as e:  # the processor would log a traceback for each batch
            self.last_error, result = f"{type(e).__name__}: {e}", SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.exported += len(spans)
            self.answered()
        else:
            self.dropped += len(spans)
            log.debug("%d spans not exported to %s", len(spans), self.where)
            if self.probe is not None:  # its word first: "nothing answers there" says more than a retry's error
                self.probe.join()
            self.failed(self.last_error or "the export failed")
        return result

    def failed(self, why: str) -> None:
        with self.lock:
            if self.failing or self.stopped:
                return
            self.failing = True
        log.warning("spans cannot go to %s: %s. They are dropped until an export succeeds, and the "
                    "exporter's errors are not logged meanwhile.%s", self.where, why[:300],
                    f" {self.advice}" if self.advice else "")  # fmt: skip

    def answered(self) -> None:
        with self.lock:
            if not self.failing:
                return
            self.failing = False
        log.info("spans go to %s again", self.where)

    def stop(self) -> None:
        """Stop the inner exporter where it stands: a retry's wait ends, a gRPC call is cancelled."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
        self.inner.shutdown()

    def shutdown(self) -> None:
        self.stop()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Quiet(logging.Filter):
    """The OTLP exporter's own failure lines (one per retry and batch) -> what the warning quotes; and,
    while the endpoint is failing, the batch processor's dropped spans (the warning said so)."""

    def __init__(self, reported: _Reported) -> None:
        super().__init__()
        self.reported = reported

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == PROCESSOR_LOGGER:
            return not (self.reported.failing and str(record.msg).startswith("Queue full"))
        if record.levelno >= logging.WARNING:
            self.reported.last_error = record.getMessage()
            return False
        return True


def _probe(reported: _Reported, address: tuple[str, int]) -> None:
    """One connection to the OTLP endpoint at start (on a thread of its own: start does not wait on it)."""
    try:
        socket.create_connection(address, timeout=PROBE_S).close()
    except OSError as e:
        reported.failed(f"nothing answers there ({e.strerror or type(e).__name__})")


class RequestTrace:
    """A sampled request: its server span, and what the scheduler it went through recorded for it.

    Times are monotonic seconds (as the WorkItem's), turned into wall-clock nanoseconds against the
    pair taken when the request arrived.
    """

    __slots__ = ("admitted_at", "anchor", "batch", "beam", "context", "done", "exemplar", "joins", "leaves",
                 "marks", "predicted_wait_ms", "span", "started", "steps", "words")  # fmt: skip

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.context: SpanContext = span.get_span_context()
        self.anchor = (time.time_ns(), time.monotonic())
        self.exemplar = {"trace_id": format(self.context.trace_id, "032x")}
        self.admitted_at: float | None = None
        self.predicted_wait_ms: float | None = None
        self.started: float | None = None
        self.done: float | None = None
        self.batch: SpanContext | None = None
        self.marks = (0, 0)  # the decoding thread's (joined, left) words when this request's words joined
        self.joins: int | None = None
        self.leaves: int | None = None
        self.steps: int | None = None
        self.words: int | None = None
        self.beam: int | None = None

    def ns(self, t: float) -> int:
        wall, mono = self.anchor
        return wall + int((t - mono) * 1e9)

    def admitted(self, predicted_wait_ms: float | None) -> None:
        """Admitted into a queue that predicts this wait for it (None: unknown until throughput is measured)."""
        self.admitted_at = time.monotonic()
        self.predicted_wait_ms = predicted_wait_ms

    def finished(self, words: int, beam: int, steps: int) -> None:
        """All of a g2p request's `words` are decoded, at beam width `beam`, its longest in `steps` decoding
        steps (on the decoding thread, before it is answered)."""
        self.done = time.monotonic()
        self.words, self.beam, self.steps = words, beam, steps


class Traced(Protocol):
    """What a batch's span reads of each request in it (a scheduler's queued item)."""

    @property
    def trace(self) -> RequestTrace | None: ...
    @property
    def started(self) -> float | None: ...


class SpanNamer(Protocol):
    @property
    def compute_span(self) -> str: ...  # its kind's name for the compute span: qkv.compute, qkv.decode


class TracedModel(Protocol):
    """What a request's span reads of the model version that answered it."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def metadata(self) -> SpanNamer: ...


class BatchSpan:
    """A batch's span, open while it runs, and the sampled requests in it."""

    __slots__ = ("span", "traces")

    def __init__(self, span: trace.Span, traces: list[RequestTrace]) -> None:
        self.span, self.traces = span, traces

    def close(self, rows: int, padded: int, real: int, answered: bool = False) -> None:
        """The batch is done; `answered`: its requests' results are too (a tensor batch, not a g2p join)."""
        self.span.set_attributes({"qkv.batch.size": rows, "qkv.batch.padded_tokens": padded,
                                  "qkv.batch.real_tokens": real})  # fmt: skip
        self.span.end()
        if answered:
            now = time.monotonic()
            for t in self.traces:
                t.done = now


class JoinCounter:
    """One decoding thread's words joined and left so far: the company a traced word kept."""

    __slots__ = ("joined", "left")

    def __init__(self) -> None:
        self.joined = self.left = 0

    def stepped(self, joining: BatchSpan | None, new: int, finished: Sequence[RequestTrace | None]) -> None:
        """After a step that `new` words joined and the words of `finished` (each its request's trace, if
        sampled) left, before their requests are answered."""
        self.joined += new
        if joining is not None:
            for t in joining.traces:
                t.marks = (self.joined, self.left)
        self.left += len(finished)
        for f in finished:
            if f is not None:  # the request's last word to finish writes last
                f.joins, f.leaves = self.joined - f.marks[0], self.left - f.marks[1]


class Tracing:
    """The server's tracer: request spans in; out over OTLP (`exporter` "otlp"), to stdout ("console") or
    to `file`, one JSON object a span a line. `ratio`: the share of requests without a sampled caller
    that are traced (parent-based); None leaves the choice to OTEL_TRACES_SAMPLER."""

    def __init__(self, ratio: float | None = None, exporter: str = "otlp", file: Path | None = None) -> None:
        sampler = ParentBasedTraceIdRatio(ratio) if ratio is not None else _get_from_env_or_default()
        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "qkv"}))
        # Shut down by the server's drain, bounded; never by the SDK's exit hook, which waits on the exporter.
        self.provider = TracerProvider(sampler=_Sampler(sampler), resource=resource, shutdown_on_exit=False)
        address: tuple[str, int] | None = None
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else LOCAL_DELAY_MS
        if file is not None:
            try:
                out = file.open("a", encoding="utf-8")
            except OSError as e:
                raise ConfigError("--tracing-file", f"--tracing-file {file}: {e.strerror}", file) from None
            self.exporter = _Reported(JsonLines(out, close=True), str(file), "")
            said = f"spans go to {file}, one JSON object a line"
        elif exporter == "console":
            self.exporter = _Reported(JsonLines(sys.stdout), "stdout", "")
            said = "spans go to stdout, one JSON object a line"
        else:
            otlp, protocol, endpoint = _otlp()
            variable = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
                             if os.environ.get(v)), "OTEL_EXPORTER_OTLP_ENDPOINT")  # fmt: skip
            where = f"the OTLP endpoint {endpoint} ({protocol})"
            advice = f"Point {variable} at a collector, or see spans without one: --tracing-exporter console"
            self.exporter = _Reported(otlp, where, advice + " or --tracing-file PATH")
            said, address, delay = f"spans go to {where}", _address(endpoint), None
        quiet = _Quiet(self.exporter)  # kept for the process's life: an export left behind stays quiet
        for name in (*EXPORTER_LOGGERS, PROCESSOR_LOGGER):
            logging.getLogger(name).addFilter(quiet)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter, schedule_delay_millis=delay))
        self.tracer = self.provider.get_tracer("qkv", __version__)
        self.propagator = TraceContextTextMapPropagator()
        log.info("%s; stopping, buffered spans get at most %.1f s to be exported", said, SHUTDOWN_S)
        if address is not None:
            probe = threading.Thread(target=_probe, args=(self.exporter, address), name="qkv-otlp-probe", daemon=True)
            probe.start()
            self.exporter.probe = probe

    def start(self, carrier: Iterable[tuple[str, str]] | Mapping[str, str] | None, method: str) -> RequestTrace | None:
        """A request arrives: its server span, continuing the caller's trace context (gRPC metadata or
        HTTP headers); None when it is not sampled."""
        headers = carrier if isinstance(carrier, Mapping) else dict(carrier or ())
        parent = self.propagator.extract(headers)
        if " " in method:  # HTTP/REST: "POST /v2/models/{model}/infer", named as HTTP server spans are
            verb, route = method.split(" ", 1)
            attributes = {"http.request.method": verb, "http.route": route}
            name = method
        else:
            attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method}
            name = f"{SERVICE}/{method}"
        span = self.tracer.start_span(name, parent, SpanKind.SERVER, attributes)
        return RequestTrace(span) if span.is_recording() else None

    def start_step(self, parent: RequestTrace | None, name: str) -> RequestTrace | None:
        """A step of an ensemble's request (`parent`, None when it is not sampled): a span under it."""
        if parent is None:
            return None
        span = self.tracer.start_span(name, trace.set_span_in_context(parent.span), SpanKind.INTERNAL)
        return RequestTrace(span) if span.is_recording() else None

    def join_counter(self) -> JoinCounter:
        """For a decoding thread: the words that joined and left its batch."""
        return JoinCounter()

    def open_batch(self, model: str, items: Iterable[Traced], instance: int, kind: str) -> BatchSpan | None:
        """A batch starts: its span, linked to the sampled requests in it; None when none was sampled."""
        unique = {id(x): x for x in items}
        traced = [(x, t) for x in unique.values() if (t := x.trace) is not None]
        if not traced:
            return None
        attributes: dict[str, str | int] = {"qkv.model": model, "qkv.instance": instance, "qkv.batch.kind": kind,
                                            "qkv.batch.requests": len(unique)}  # fmt: skip
        span = self.tracer.start_span(BATCH, attributes=attributes, links=[Link(t.context) for _, t in traced])
        context = span.get_span_context()
        for x, t in traced:
            t.batch, t.started = context, x.started
        return BatchSpan(span, [t for _, t in traced])

    def finish(self, t: RequestTrace, code: str, error: Any, model: TracedModel | None, seq_len: int) -> None:
        """The request is answered (`code`, and the ServingError when not OK): its child spans, from what
        was recorded on the way, then its own end."""
        span, end = t.span, time.monotonic()
        parent = trace.set_span_in_context(span)
        start = self._admission(t, parent, code, error, end)
        if t.admitted_at is not None:
            began = t.started if t.started is not None else end
            self.tracer.start_span("qkv.queue", parent, start_time=t.ns(start)).end(t.ns(began))
        if t.started is not None:
            self._compute(t, parent, end, model.metadata.compute_span if model is not None else "qkv.compute")
        attributes: dict[str, Any] = {"qkv.status": code, "qkv.seq_len": seq_len}
        if "rpc.system" in (getattr(span, "attributes", None) or {}):
            attributes["rpc.grpc.status_code"] = grpc.StatusCode[code].value[0]
        if model is not None:
            attributes |= {"qkv.model": model.name, "qkv.model.version": model.version}
        if t.words is not None:
            attributes["qkv.words"] = t.words
        span.set_attributes(attributes)
        if code in SERVER_ERRORS:
            span.set_status(Status(StatusCode.ERROR, getattr(error, "message", code)))
        span.end()

    def _admission(self, t: RequestTrace, parent: Context, code: str, error: Any, end: float) -> float:
        """The admission span, from arrival (inputs decoded and checked) to the decision, when the request
        got that far; returns when it ended."""
        refused = t.admitted_at is None and getattr(error, "retry_after_ms", None) is not None
        if not refused and t.admitted_at is None:
            return end
        at = t.admitted_at if t.admitted_at is not None else end
        span = self.tracer.start_span("qkv.admission", parent, start_time=t.ns(t.anchor[1]))
        if refused:
            span.set_attributes({"qkv.admission.decision": "refused", "qkv.admission.reason": code,
                                 "qkv.admission.predicted_wait_ms": float(error.retry_after_ms)})  # fmt: skip
        else:
            span.set_attribute("qkv.admission.decision", "admitted")
            if t.predicted_wait_ms is not None:
                span.set_attribute("qkv.admission.predicted_wait_ms", t.predicted_wait_ms)
        span.end(t.ns(at))
        return at

    def _compute(self, t: RequestTrace, parent: Context, end: float, name: str) -> None:
        assert t.started is not None
        links = [Link(t.batch)] if t.batch is not None else []
        span = self.tracer.start_span(name, parent, links=links, start_time=t.ns(t.started))
        # What a decoding scheduler recorded on the way (a batcher records none of these).
        counts = {"steps": t.steps, "joins": t.joins, "leaves": t.leaves, "beam_width": t.beam}
        span.set_attributes({f"qkv.decode.{k}": v for k, v in counts.items() if v is not None})
        span.end(t.ns(t.done if t.done is not None else end))

    def shutdown(self) -> None:
        """Export what is still buffered, for SHUTDOWN_S at most (not at all to an endpoint that is not
        answering), then stop the exporter where it stands."""
        deadline, failing = time.monotonic() + SHUTDOWN_S, self.exporter.failing
        # On a thread of its own: an export the exporter cannot cut short (an HTTP request in flight)
        # is left behind, not waited for.
        closing = threading.Thread(target=self.provider.shutdown, name="qkv-tracing-shutdown", daemon=True)
        closing.start()
        if not failing:
            closing.join(SHUTDOWN_S - ABORT_S)
        if closing.is_alive():
            self.exporter.stop()
            closing.join(max(0.0, deadline - time.monotonic()))
        waited = (
            f"was not waited for: {self.exporter.where} was not answering"
            if failing
            else f"got {SHUTDOWN_S:.1f} s at most"
        )
        log.info("stopped: %d spans exported, %d dropped; the last export %s", self.exporter.exported,
                 self.exporter.dropped, waited)  # fmt: skip
