"""OpenTelemetry traces of inference requests: where each request's time went, across services.

Imported only when tracing is on (`--tracing`, or `--trace-sample-ratio`): a server without it never
imports opentelemetry, and its request path pays one `is None` check. The rest of the server sees
this module through three hooks (service/admission.py): a sampled request's `RequestTrace` rides on
its WorkItem, and the schedulers open a `BatchSpan` per batch. Exported with the SDK's batch span
processor over OTLP, configured by the standard variables (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_PROTOCOL grpc or http/protobuf, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, OTEL_BSP_*).

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

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
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

if TYPE_CHECKING:
    from service.admission import Admission, WorkItem
    from service.generation import Hypothesis
    from service.scheduler import WordsRequest

__all__ = ["BATCH", "BatchSpan", "JoinCounter", "RequestTrace", "Tracing"]

SERVICE = "inference.GRPCInferenceService"
BATCH = "qkv.batch"
# The gRPC codes a server span marks as an error (OpenTelemetry's RPC conventions): the server's
# fault, not the caller's (a refused or invalid request is the caller's to handle).
SERVER_ERRORS = {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
PROTOCOLS = ("grpc", "http/protobuf")


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


def _exporter() -> SpanExporter:
    """OTLP over gRPC or HTTP, as OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL says; the exporter reads the rest."""
    env = os.environ
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise SystemExit(f"qkv: OTLP protocol {protocol!r}: qkv exports traces over {' or '.join(PROTOCOLS)}")


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

    def admitted(self, admission: Admission) -> None:
        """Admitted into a queue: the wait the queue predicts (unknown until throughput is measured)."""
        self.admitted_at = time.monotonic()
        rate = admission.tokens_per_second
        self.predicted_wait_ms = admission.queued_tokens / rate * 1e3 if rate else None

    def finished(self, req: WordsRequest) -> None:
        """All of a g2p request's words are decoded (on the decoding thread, before it is answered)."""
        self.done = time.monotonic()
        self.words, self.beam = len(req.sources), req.beam_size
        # A word's tokens are <s>, its output and </s>: one step produced each after <s>.
        self.steps = max(len(h.tokens) - 1 for h in req.results if h is not None)


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

    def stepped(self, joining: BatchSpan | None, new: Sequence[Hypothesis], finished: Sequence[Hypothesis]) -> None:
        """After a step, before its finished requests are answered."""
        self.joined += len(new)
        if joining is not None:
            for t in joining.traces:
                t.marks = (self.joined, self.left)
        self.left += len(finished)
        for h in finished:
            t = h.tag[0].trace
            if t is not None:  # the request's last word to finish writes last
                t.joins, t.leaves = self.joined - t.marks[0], self.left - t.marks[1]


class Tracing:
    """The server's tracer: request spans in, OTLP out. `ratio`: the share of requests without a sampled
    caller that are traced (parent-based); None leaves the choice to OTEL_TRACES_SAMPLER."""

    def __init__(self, ratio: float | None = None, exporter: SpanExporter | None = None) -> None:
        sampler = ParentBasedTraceIdRatio(ratio) if ratio is not None else _get_from_env_or_default()
        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "qkv"}))
        self.provider = TracerProvider(sampler=_Sampler(sampler), resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or _exporter()))
        self.tracer = self.provider.get_tracer("qkv", __version__)
        self.propagator = TraceContextTextMapPropagator()

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

    def join_counter(self) -> JoinCounter:
        """For a decoding thread: the words that joined and left its batch."""
        return JoinCounter()

    def open_batch(self, model: str, items: Iterable[WorkItem], instance: int, kind: str) -> BatchSpan | None:
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

    def finish(self, t: RequestTrace, code: str, error: Any, model: Any, seq_len: int) -> None:
        """The request is answered (`code`, and the ServingError when not OK): its child spans, from what
        was recorded on the way, then its own end."""
        span, end = t.span, time.monotonic()
        parent = trace.set_span_in_context(span)
        start = self._admission(t, parent, code, error, end)
        if t.admitted_at is not None:
            began = t.started if t.started is not None else end
            self.tracer.start_span("qkv.queue", parent, start_time=t.ns(start)).end(t.ns(began))
        if t.started is not None:
            self._compute(t, parent, end, model is not None and model.kind == "g2p")
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

    def _compute(self, t: RequestTrace, parent: Context, end: float, g2p: bool) -> None:
        assert t.started is not None
        links = [Link(t.batch)] if t.batch is not None else []
        span = self.tracer.start_span("qkv.decode" if g2p else "qkv.compute", parent, links=links,
                                      start_time=t.ns(t.started))  # fmt: skip
        if g2p:
            counts = {"steps": t.steps, "joins": t.joins, "leaves": t.leaves, "beam_width": t.beam}
            span.set_attributes({f"qkv.decode.{k}": v for k, v in counts.items() if v is not None})
        span.end(t.ns(t.done if t.done is not None else end))

    def shutdown(self) -> None:
        """Export what is still buffered, then stop."""
        self.provider.shutdown()
