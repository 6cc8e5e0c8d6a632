"""An OTLP/gRPC trace receiver on loopback (port 0): what an OpenTelemetry Collector would be sent.

`qkv bench` points a tracing server at one (so exporting costs what it costs against a real
collector), and the tests read the spans it received. Needs the trace extra (opentelemetry-proto).
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

__all__ = ["Collector"]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Receives ExportTraceServiceRequests; keeps their spans (`keep`) or only counts them."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.spans: list[Any] = []  # opentelemetry.proto.trace.v1.Span, in the order received
        self.resources: list[Any] = []  # the Resource each exported batch came with
        self.count = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        """For OTEL_EXPORTER_OTLP_ENDPOINT."""
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.count += len(ss.spans)
                    if self.keep:
                        self.resources.append(rs.resource)
                        self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def __enter__(self) -> Collector:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)
