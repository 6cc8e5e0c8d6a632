"""Tracing end to end: a real qkv exporting through the real OTLP exporter to a real OTLP receiver.

The receiver (service/tools/bench/collector.py) implements the collector's TraceService from
opentelemetry-proto; the spans checked are those of requests sent to the server over gRPC. Then
without a collector: an endpoint where nothing listens, and the spans printed to stdout or a file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from service import protocol
from service.config import ServerSettings, check
from service.errors import ConfigError
from service.tools.bench.collector import Collector
from service.tools.bench.servers import variant
from service.tools.client import Client, g2p_request, new_traceparent
from service.tools.loadgen import encoder_request
from tests.conftest import MODELS, ROOT, RunningServer, start_server, stop_server

SERVER_SPAN = "inference.GRPCInferenceService/ModelInfer"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between exports: the spans arrive while the test waits


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


def wait_for(predicate: Callable[[], Any], seconds: float = 15.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("the spans did not arrive")


def of_trace(collector: Collector, trace_id: str) -> list[Any]:
    return [s for s in list(collector.spans) if s.trace_id.hex() == trace_id]


def trace_parts(collector: Collector, traceparent: str, children: int) -> tuple[Any, dict[str, Any]]:
    """The server span of the request sent with `traceparent`, and its children by name."""
    _, trace_id, _, _ = traceparent.split("-")
    spans = wait_for(lambda: (found := of_trace(collector, trace_id)) and len(found) == children + 1 and found)
    [server] = [s for s in spans if s.name == SERVER_SPAN]
    kids = {s.name: s for s in spans if s is not server}
    assert all(s.parent_span_id == server.span_id for s in kids.values())
    return server, kids


def batch_of(collector: Collector, span: Any) -> Any:
    [link] = span.links
    return wait_for(lambda: [s for s in list(collector.spans) if s.span_id == link.span_id])[0]


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with Collector() as c:
        yield c


@pytest.fixture(scope="module")
def traced(collector: Collector, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_SERVICE_NAME": "qkv-test", **FAST_EXPORT}
    # The shipped models, the encoder with batching given rather than tuned: requests sent together
    # share batches however noisy the machine's measurements at start.
    here = tmp_path_factory.mktemp("traced")
    # No queueing-time objective: on a loaded machine the measured rate predicts long waits, and a burst
    # refused by that prediction would not be the batch this file traces.
    batching = {"token_budget": 16384, "inline_max_tokens": 0, "max_queue_delay_ms": 5, "max_queue_wait_ms": 600000}
    variant(MODELS, here / "models", {"g2p_encoder": {"batching": batching}})
    args = ["--trace-sample-ratio", "1", "--model-repository", str(here / "models")]
    s = start_server(args, here / "server.log", env)
    yield s
    stop_server(s)


def test_a_g2p_request_continues_the_callers_trace_with_its_time_split_into_spans(
    traced: RunningServer, collector: Collector
) -> None:
    traceparent = new_traceparent()
    _, trace_id, caller, _ = traceparent.split("-")
    with Client(traced.url) as c:
        assert c.g2p(["attention", "transformer"], traceparent=traceparent, lexicon=False) == [  # decoded
            "AH0 T EH1 N SH AH0 N",
            "T R AE0 N S F AO1 R M ER0",
        ]
    server, kids = trace_parts(collector, traceparent, 3)
    assert server.parent_span_id.hex() == caller and server.kind == server.SPAN_KIND_SERVER
    a = attrs(server)
    assert a["rpc.system"] == "grpc" and a["rpc.service"] == "inference.GRPCInferenceService"
    assert a["rpc.method"] == "ModelInfer" and a["rpc.grpc.status_code"] == 0 and a["qkv.status"] == "OK"
    assert a["qkv.model"] == "g2p" and a["qkv.model.version"] == "2" and a["qkv.words"] == 2
    assert a["qkv.seq_len"] == len("transformer")
    assert set(kids) == {"qkv.admission", "qkv.queue", "qkv.decode"}
    assert attrs(kids["qkv.admission"])["qkv.admission.decision"] == "admitted"
    # The children follow each other inside the request: admission, then queue, then decoding.
    order = [kids[n] for n in ("qkv.admission", "qkv.queue", "qkv.decode")]
    assert server.start_time_unix_nano <= order[0].start_time_unix_nano
    for first, then in itertools.pairwise(order):
        assert first.end_time_unix_nano <= then.start_time_unix_nano + 1000
    assert order[-1].end_time_unix_nano <= server.end_time_unix_nano
    d = attrs(kids["qkv.decode"])
    assert d["qkv.decode.beam_width"] == 1 and d["qkv.decode.steps"] >= 11  # 10 phonemes, then </s>
    assert d["qkv.decode.leaves"] >= 2 and d["qkv.decode.joins"] >= 0
    # The batch the words joined: a span of its own trace, linked both ways.
    batch = batch_of(collector, kids["qkv.decode"])
    b = attrs(batch)
    assert batch.name == "qkv.batch" and batch.trace_id.hex() != trace_id and not batch.parent_span_id
    assert b["qkv.model"] == "g2p" and b["qkv.batch.kind"] == "continuous" and b["qkv.instance"] >= 0
    assert b["qkv.batch.size"] >= 2 and b["qkv.batch.padded_tokens"] >= b["qkv.batch.real_tokens"] > 0
    assert server.span_id in {link.span_id for link in batch.links}
    names = {a["service.name"] for a in map(attrs, collector.resources)}
    assert names == {"qkv-test"}  # OTEL_SERVICE_NAME


def test_a_beam_request_rides_in_a_beam_search_batch(traced: RunningServer, collector: Collector) -> None:
    traceparent = new_traceparent()
    with grpc.insecure_channel(traced.url) as ch:
        request = g2p_request(["attention"], beam_size=4, lexicon=False)  # decoded, not looked up
        protocol.Stub(ch).ModelInfer(request, metadata=[("traceparent", traceparent)])
    _, kids = trace_parts(collector, traceparent, 3)
    assert attrs(kids["qkv.decode"])["qkv.decode.beam_width"] == 4
    batch = attrs(batch_of(collector, kids["qkv.decode"]))
    assert batch["qkv.batch.kind"] == "beam" and batch["qkv.batch.size"] == 4


def test_a_batch_of_n_requests_is_one_batch_span_linked_from_each_of_the_n(
    traced: RunningServer, collector: Collector
) -> None:
    n = 32
    parents = [new_traceparent() for _ in range(n)]
    rng = np.random.default_rng(0)
    # 256 tokens: far more compute than a hand-off, so never computed inline, alone, on the event loop
    requests = [encoder_request(256, 33, rng) for _ in parents]

    async def burst() -> None:  # all n at once from one event loop, so that they queue together
        async with grpc.aio.insecure_channel(traced.url) as ch:
            stub = protocol.Stub(ch)
            await asyncio.gather(
                *(stub.ModelInfer(r, metadata=[("traceparent", tp)]) for r, tp in zip(requests, parents, strict=True))
            )

    asyncio.run(burst())
    computes = {}
    for tp in parents:
        _, kids = trace_parts(collector, tp, 3)
        computes[tp] = kids["qkv.compute"]
    batches: dict[bytes, list[Any]] = {}
    for span in computes.values():
        [link] = span.links
        batches.setdefault(link.span_id, []).append(span)
    for members in batches.values():
        batch = batch_of(collector, members[0])
        a = attrs(batch)
        assert a["qkv.model"] == "g2p_encoder" and a["qkv.batch.kind"] == "dynamic"
        # Every request in the batch links to it, and it to each of them: N and N.
        assert a["qkv.batch.requests"] == len(members) == len(batch.links)
        assert a["qkv.batch.size"] == len(members) and a["qkv.batch.padded_tokens"] == 256 * len(members)
        assert {link.trace_id for link in batch.links} == {m.trace_id for m in members}
    assert sum(len(m) for m in batches.values()) == n
    assert max(len(m) for m in batches.values()) > 1, "no two requests shared a batch"


def test_a_refused_request_is_traced_with_its_status(traced: RunningServer, collector: Collector) -> None:
    traceparent = new_traceparent()
    with grpc.insecure_channel(traced.url) as ch, pytest.raises(grpc.RpcError) as e:
        protocol.Stub(ch).ModelInfer(g2p_request(["\x07tt"]), metadata=[("traceparent", traceparent)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server, kids = trace_parts(collector, traceparent, 0)
    a = attrs(server)
    assert a["qkv.status"] == "INVALID_ARGUMENT" and a["rpc.grpc.status_code"] == 3 and not kids
    assert server.status.code == server.status.STATUS_CODE_UNSET  # the caller's fault, not the server's


def test_latency_histogram_carries_trace_ids_as_exemplars(traced: RunningServer, collector: Collector) -> None:
    traceparent = new_traceparent()
    with Client(traced.url) as c:
        c.g2p(["exemplar"], traceparent=traceparent)
    request = urllib.request.Request(traced.metrics_url, headers={"Accept": "application/openmetrics-text"})
    text = urllib.request.urlopen(request, timeout=5).read().decode()
    assert f'# {{trace_id="{traceparent.split("-")[1]}"}}' in text


def test_qkv_infer_sends_a_new_trace_and_prints_its_id(traced: RunningServer, collector: Collector) -> None:
    decoded = ["--no-lexicon", "attention"]  # the model decodes it: its spans
    out = subprocess.run([sys.executable, "-m", "service.cli", "infer", "--url", traced.url, *decoded],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout == "attention\tAH0 T EH1 N SH AH0 N\n", out.stderr
    trace_id = out.stderr.strip().removeprefix("trace ")
    assert len(trace_id) == 32
    trace_parts(collector, f"00-{trace_id}-0000000000000001-01", 3)


class _HttpReceiver(BaseHTTPRequestHandler):
    got: ClassVar[list[Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.got.append((self.path, trace_service_pb2.ExportTraceServiceRequest.FromString(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args: Any) -> None: ...


def test_otlp_over_http_and_sampling_ratio_zero_sends_nothing(tmp_path: Path, collector: Collector) -> None:
    http = ThreadingHTTPServer(("127.0.0.1", 0), _HttpReceiver)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http.server_port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", **FAST_EXPORT}  # fmt: skip
    try:
        s = start_server(["--tracing"], tmp_path / "http.log", env)  # the SDK's default sampler: every request
        with Client(s.url) as c:
            c.g2p(["attention"], lexicon=False)  # decoded: a qkv.batch span
        stop_server(s)  # the drain exports what is buffered
        paths = {path for path, _ in _HttpReceiver.got}
        names = {sp.name for _, r in _HttpReceiver.got for rs in r.resource_spans for ss in rs.scope_spans
                 for sp in ss.spans}  # fmt: skip
        assert paths == {"/v1/traces"} and SERVER_SPAN in names and "qkv.batch" in names
        # Ratio 0: neither a request without a trace context nor one whose caller did not sample is traced.
        _HttpReceiver.got.clear()
        s = start_server(["--trace-sample-ratio", "0"], tmp_path / "zero.log", env)
        with Client(s.url) as c:
            c.g2p(["attention"])
            c.g2p(["attention"], traceparent=new_traceparent(sampled=False))
            c.infer(encoder_request(16, 33, np.random.default_rng(0)))
        stop_server(s)
        assert _HttpReceiver.got == []
    finally:
        http.shutdown()
        http.server_close()


def test_a_server_without_tracing_never_imports_opentelemetry(tmp_path: Path) -> None:
    code = """
import asyncio, sys
from service.tools.client import AsyncClient
from service.config import ServerSettings
from service.tools.loadgen import encoder_request
from service.server import Server
import numpy as np

async def main():
    server = Server(ServerSettings(model_repository=sys.argv[1], host="127.0.0.1", grpc_port=0, metrics_port=-1))
    await server.start()
    async with AsyncClient(f"127.0.0.1:{server.grpc_port}") as c:
        await c.g2p(["attention"])
        await c.infer(encoder_request(16, 33, np.random.default_rng(0)))
    await server.drain()

asyncio.run(main())
print(sorted({m.split(".")[0] for m in sys.modules if m.startswith("opentelemetry")}))
"""
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "models")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_an_http_request_continues_the_callers_trace_as_an_http_server_span(
    traced: RunningServer, collector: Collector
) -> None:
    traceparent = new_traceparent()
    _, trace_id, caller, _ = traceparent.split("-")
    request = urllib.request.Request(
        f"http://{traced.http_url}/v2/models/g2p/generate",
        data=json.dumps({"text_input": "attention"}).encode(),
        headers={"Content-Type": "application/json", "traceparent": traceparent},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert json.loads(answer.read())["text_output"] == "AH0 T EH1 N SH AH0 N"
    route = "POST /v2/models/{model}/generate"
    spans = wait_for(lambda: [s for s in of_trace(collector, trace_id) if s.name == route])
    [server] = spans
    a = attrs(server)
    assert server.parent_span_id.hex() == caller and server.kind == server.SPAN_KIND_SERVER
    assert a["http.request.method"] == "POST" and a["http.route"] == "/v2/models/{model}/generate"
    assert "rpc.system" not in a and a["qkv.status"] == "OK" and a["qkv.model"] == "g2p"


# --- without a collector --------------------------------------------------------------------------------


def dead_endpoint() -> str:
    """An OTLP endpoint where nothing listens: a port bound, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_an_endpoint_where_nothing_listens_is_one_warning_and_shutdown_does_not_wait_on_it(tmp_path: Path) -> None:
    endpoint = dead_endpoint()
    address = endpoint.removeprefix("http://")
    # Debug: a line for each batch that was not exported shows the exporter tried, and failed.
    s = start_server(["--tracing", "--log-level", "debug"], tmp_path / "server.log",
                     {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT})  # fmt: skip
    try:
        with Client(s.url) as c:
            for word in ("attention", "transformer", "tracing"):
                c.g2p([word])
        wait_for(lambda: "spans not exported to the OTLP endpoint" in s.output())
    finally:
        code = stop_server(s, timeout=30)  # a safety net: the decision is asserted from the log below
    assert code == 0
    log = s.output()
    problems = [line for line in log.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", line)]
    assert len(problems) == 1, problems
    [warning] = problems
    assert f"the OTLP endpoint {address} (grpc)" in warning and "nothing answers there" in warning
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in warning and "--tracing-exporter console" in warning
    assert "Failed to export" not in log and "Transient error" not in log
    # Stopping: the flush is bounded, and an endpoint that is not answering is not waited for at all.
    bound = re.search(r"tracing: .*buffered spans get at most ([\d.]+) s to be exported", log)
    assert bound is not None and float(bound.group(1)) <= 0.5
    stopped = re.search(r"tracing: stopped: 0 spans exported, (\d+) dropped; the last export (.*)", log)
    assert stopped is not None and int(stopped.group(1)) >= 1  # the batch seen not exported above, at least
    assert stopped.group(2) == f"was not waited for: the OTLP endpoint {address} (grpc) was not answering"


def spans_in(text: str) -> list[dict[str, Any]]:
    """The JSON span lines among `text`'s lines."""
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"name": ')]


@pytest.mark.parametrize("where", ["console", "file"])
def test_the_spans_of_one_qkv_infer_request_are_printed_without_a_collector(where: str, tmp_path: Path) -> None:
    file = tmp_path / "spans.jsonl"
    args = ["--tracing-exporter", "console"] if where == "console" else ["--tracing-file", str(file)]
    s = start_server(args, tmp_path / "server.log")  # no OTEL_* variable: the export is local
    read = s.output if where == "console" else lambda: file.read_text() if file.exists() else ""
    try:
        decoded = ["--no-lexicon", "attention"]  # the model decodes it: its spans
        out = subprocess.run([sys.executable, "-m", "service.cli", "infer", "--url", s.url, *decoded],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
        assert out.returncode == 0 and out.stdout == "attention\tAH0 T EH1 N SH AH0 N\n", out.stderr
        trace_id = out.stderr.strip().removeprefix("trace ")
        spans = wait_for(lambda: len(found := [x for x in spans_in(read()) if x["traceId"] == trace_id]) == 4 and found)
        [server] = [x for x in spans if x["name"] == SERVER_SPAN]
        kids = {x["name"]: x for x in spans if x is not server}
        assert set(kids) == {"qkv.admission", "qkv.queue", "qkv.decode"}
        assert all(x["parentSpanId"] == server["spanId"] for x in kids.values())
        assert server["kind"] == "SERVER" and server["status"] == "UNSET" and server["service"] == "qkv"
        a = server["attributes"]
        assert a["qkv.model"] == "g2p" and a["qkv.status"] == "OK" and a["rpc.method"] == "ModelInfer"
        assert server["endTimeUnixNano"] >= server["startTimeUnixNano"] > 0
        # The batch its word joined: a trace of its own, linked to the request.
        [link] = kids["qkv.decode"]["links"]
        batch = wait_for(lambda: [x for x in spans_in(read()) if x["spanId"] == link["spanId"]])[0]
        assert batch["name"] == "qkv.batch" and batch["attributes"]["qkv.model"] == "g2p"
        assert {"traceId": trace_id, "spanId": server["spanId"]} in batch["links"]
    finally:
        assert stop_server(s) == 0
    log = s.output()
    assert f"tracing: spans go to {'stdout' if where == 'console' else file}, one JSON object a line" in log
    assert " WARNING " not in log and " ERROR " not in log
    if where == "file":  # every line one span, nothing else
        assert all(line.startswith('{"name": ') for line in file.read_text().splitlines())


def test_spans_go_to_one_place() -> None:
    with pytest.raises(ConfigError, match="give one of them") as refused:
        check(ServerSettings(tracing_exporter="console", tracing_file=Path("spans.jsonl")))
    assert refused.value.key == "--tracing-file"
    assert ServerSettings(tracing_file=Path("spans.jsonl")).traced and ServerSettings(tracing_exporter="console").traced
    assert not ServerSettings().traced
