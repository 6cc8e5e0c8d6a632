"""Client input never gets a 5xx, and the metrics port holds under idle and slow connections, on a real server.

A lone surrogate in any JSON string, a config whose versions are booleans or that is nested thousands
deep: each answered 400 / INVALID_ARGUMENT naming the field, counted in qkv_http_requests_total, with no
traceback in the server's log, and the repository index still answering. Every gRPC status has its HTTP
status, as docs/design.md's table says. 500 idle and 100 slowloris connections on the metrics port hold
no thread each, are each closed within the timeout, and scrapes are still answered meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import re
import selectors
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as g
from tritonclient.utils import InferenceServerException

from service.observability.metrics_http import BACKLOG, MAX_HEAD_BYTES
from service.tools.bench.servers import scrape
from tests.conftest import MODELS, RunningServer, scale_model, start_server, stop_server
from tests.figures import FIGURES

TIMEOUT = 2.0  # the fixture's --http-timeout: the metrics port's header and idle timeout too
GRACE = 60.0  # a generous wait for what must happen (a decision, not a speed)
SURROGATE = "\ud800"
FIGS = FIGURES.setdefault("attacks", {})


@pytest.fixture(scope="module")
def hard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """g2p and a small tensor model, model control explicit (loads allowed on loopback)."""
    d = tmp_path_factory.mktemp("hard")
    repo = d / "models"
    repo.mkdir()
    (repo / "g2p").symlink_to(MODELS / "g2p")
    scale_model(repo / "scale")
    args = ["--model-repository", str(repo), "--http-timeout", str(TIMEOUT), "--model-control-mode", "explicit",
            "--load-model", "g2p", "--load-model", "scale"]  # fmt: skip
    s = start_server(args, d / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in Path(s.log).read_text()  # nothing a client sent failed inside


def post(address: str, path: str, body: bytes | str) -> tuple[int, str]:
    host, port = address.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=GRACE)
    try:
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def http_counts(server: RunningServer) -> dict[str, float]:
    """qkv_http_requests_total by code, summed over models and endpoints."""
    out: dict[str, float] = {}
    for series, value in scrape(server.metrics_url).items():
        if series.startswith("qkv_http_requests_total{"):
            code = re.search(r'code="(\d+)"', series)
            assert code is not None
            out[code.group(1)] = out.get(code.group(1), 0) + value
    return out


def _infer(**change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": "a",
        "parameters": {"k": "v"},
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["hello"]}],
        "outputs": [{"name": "PHONEMES"}],
    }
    return doc | change


S = SURROGATE
INPUT = {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["hello"]}
# (case, path, JSON body, what the message names): a lone surrogate in each place a client's string goes.
CASES = [
    ("infer id", "/v2/models/g2p/infer", _infer(id=S), "id"),
    ("infer parameter key", "/v2/models/g2p/infer", _infer(parameters={S: 1}), "a key of parameters"),
    ("infer parameter value", "/v2/models/g2p/infer", _infer(parameters={"k": S}), "parameters.k"),
    ("input name", "/v2/models/g2p/infer", _infer(inputs=[INPUT | {"name": S}]), "inputs[0].name"),
    ("input datatype", "/v2/models/g2p/infer", _infer(inputs=[INPUT | {"datatype": S}]), "inputs[0].datatype"),
    (
        "input parameter key",
        "/v2/models/g2p/infer",
        _infer(inputs=[INPUT | {"parameters": {S: 1}}]),
        "a key of inputs[0].parameters",
    ),
    ("output name", "/v2/models/g2p/infer", _infer(outputs=[{"name": S}]), "outputs[0].name"),
    ("BYTES data", "/v2/models/g2p/infer", _infer(inputs=[INPUT | {"data": ["ok", "a" + S]}]), "inputs[0].data[1]"),
    ("generate text", "/v2/models/g2p/generate", {"text_input": "hi " + S}, "text_input"),
    ("generate id", "/v2/models/g2p/generate", {"text_input": "hi", "id": S}, "id"),
    (
        "generate parameter",
        "/v2/models/g2p/generate",
        {"text_input": "hi", "parameters": {"beam": S}},
        "parameters.beam",
    ),
    ("generate_stream text", "/v2/models/g2p/generate_stream", {"text_input": S + " hi"}, "text_input"),
    ("load parameter key", "/v2/repository/models/scale/load", {"parameters": {S: "{}"}}, "a key of parameters"),
    (
        "load parameter value",
        "/v2/repository/models/scale/load",
        {"parameters": {"config": '{"a": "' + S + '"}'}},
        "parameters.config",
    ),
    ("repository index", "/v2/repository/index", {"ready": S}, "ready"),
]


def test_a_lone_surrogate_anywhere_is_400_naming_the_field_and_counted(hard: RunningServer) -> None:
    before = http_counts(hard)
    for case, path, doc, field in CASES:
        # json.dumps escapes the surrogate (\ud800), as a client's JSON library does
        status, body = post(hard.http_url, path, json.dumps(doc))
        assert status == 400, (case, status, body)
        message = json.loads(body)["error"]
        assert field in message and "lone surrogate" in message and "\\ud800" in message, (case, message)
    # The same character as raw bytes (UTF-8's form of it, which json.loads lets through), and a surrogate
    # written as its escape in a key of a nested object.
    raw = b'{"text_input": "hi \xed\xa0\x80"}'
    status, body = post(hard.http_url, "/v2/models/g2p/generate", raw)
    assert status == 400 and "text_input" in json.loads(body)["error"], body
    status, body = post(hard.http_url, "/v2/models/g2p/generate", '{"text_input": "\\udfff"}')
    assert status == 400 and "text_input" in json.loads(body)["error"], body
    # A pair of surrogates is one character, and fine.
    status, body = post(hard.http_url, "/v2/models/g2p/generate", '{"text_input": "hello", "id": "\\ud83d\\ude00"}')
    assert status == 200 and json.loads(body)["id"] == "\U0001f600", body
    after = http_counts(hard)
    sent = len(CASES) + 2
    assert after.get("400", 0) - before.get("400", 0) == sent  # every answer counted
    assert after.get("200", 0) - before.get("200", 0) >= 1
    assert "500" not in after
    FIGS["lone surrogates"] = f"{sent} requests, {sent} answered 400 naming the field and counted, 0 5xx"


def test_config_values_are_checked_and_the_index_keeps_answering(hard: RunningServer) -> None:
    g2p_ready = post(hard.http_url, "/v2/repository/index", b"")
    assert g2p_ready[0] == 200
    bad = [
        ('{"version_policy": {"specific": {"versions": [true]}}}', "version_policy.specific.versions"),
        ('{"version_policy": {"latest": {"num_versions": true}}}', "version_policy.latest.num_versions"),
        ('{"batching": {"max_batch_size": true}}', "max_batch_size must be an integer"),
        ('{"batching": {"max_queue_delay_ms": "1"}}', "max_queue_delay_ms must be a number"),
        ('{"instances": false}', "instances must be an integer"),
        ('{"limits": {"max_sequence_length": "x"}}', "limits.max_sequence_length"),
        ('{"model_card": []}', "model_card"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper"),  # past json.loads's own recursion limit
        ('{"a":' * 500 + "1" + "}" * 500, "nested deeper"),  # parsed, then bounded
        ("{not json", "is not JSON"),
    ]
    for config, named in bad:
        status, body = post(
            hard.http_url, "/v2/repository/models/scale/load", json.dumps({"parameters": {"config": config}})
        )
        assert status == 400, (config[:60], status, body)
        assert named in json.loads(body)["error"], (config[:60], body)
        status, body = post(hard.http_url, "/v2/repository/index", b"")
        assert status == 200, body  # never UNKNOWN / 500 after a refused config
        assert {(m["name"], m["state"]) for m in json.loads(body)} >= {("scale", "READY"), ("g2p", "READY")}
    # The same refusal over gRPC: INVALID_ARGUMENT naming the parameter.
    client = g.InferenceServerClient(hard.url)
    with pytest.raises(InferenceServerException) as e:
        client.load_model("scale", config="[" * 100_000 + "]" * 100_000)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "'config'" in e.value.message()
    assert {m.name for m in client.get_model_repository_index().models} >= {"scale", "g2p"}
    assert "500" not in http_counts(hard)
    FIGS["bad configs"] = f"{len(bad)} refused 400 naming the key; the index answered 200 after each"


def test_failed_precondition_is_answered_400_not_500(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    scale_model(repo / "scale")
    with start_server(["--model-repository", str(repo)], tmp_path / "server.log") as s:
        status, body = post(s.http_url, "/v2/repository/models/scale/load", b"")
        assert status == 400 and "model control is off" in json.loads(body)["error"], body
        with pytest.raises(InferenceServerException) as e:
            g.InferenceServerClient(s.url).load_model("scale")
        assert e.value.status() == "StatusCode.FAILED_PRECONDITION"
        assert http_counts(s).get("400") == 1


# --- the metrics port -----------------------------------------------------------------------------------


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _scrape_time(url: str) -> float:
    start = time.perf_counter()
    text = urllib.request.urlopen(url, timeout=GRACE).read().decode()
    assert "qkv_http_requests_total" in text
    return time.perf_counter() - start


def test_metrics_port_holds_under_idle_and_slowloris_connections(hard: RunningServer) -> None:
    host, port = hard.metrics_url.removeprefix("http://").split("/")[0].split(":")
    pid = hard.process.pid
    _scrape_time(hard.metrics_url)
    before = _threads(pid)
    idle, slow = 500, 100
    conns = []
    for k in range(idle + slow):
        c = socket.create_connection((host, int(port)), timeout=GRACE)
        if k >= idle:  # slowloris: part of a request line, then nothing
            c.sendall(b"GET /metr")
        conns.append(c)
    time.sleep(0.5)  # the server has accepted them
    during = _threads(pid)
    latency = _scrape_time(hard.metrics_url)
    # No thread per connection: a few at most, whatever the event loop's executor started meanwhile.
    assert during <= before + 4, (before, during)
    # Each is closed by the server (EOF or reset) once it has idled past the timeout.
    open_ = {c.fileno(): c for c in conns}
    with selectors.DefaultSelector() as sel:
        for c in conns:
            c.setblocking(False)
            sel.register(c, selectors.EVENT_READ)
        deadline = time.monotonic() + TIMEOUT + GRACE
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=1):
                c = open_.pop(key.fd)
                try:
                    data = c.recv(65536)
                except ConnectionError:
                    data = b""
                assert data == b"" or data.startswith(b"HTTP/1.1 "), data[:80]  # closed (or a 4xx, then closed)
                if data:
                    open_[key.fd] = c
                else:
                    sel.unregister(c)
    closed = idle + slow - len(open_)
    for c in conns:
        c.close()
    assert not open_, f"{len(open_)} of {idle + slow} connections still open {TIMEOUT + GRACE:.0f} s on"
    after = _scrape_time(hard.metrics_url)
    FIGS["metrics port, 500 idle + 100 slowloris"] = (
        f"server threads {before} before, {during} during; all {closed} closed by the server "
        f"(timeout {TIMEOUT:g} s); scrape during {latency * 1e3:.0f} ms, after {after * 1e3:.0f} ms"
    )


def test_metrics_port_answers_as_prometheus_client_does(hard: RunningServer) -> None:
    import gzip

    r = urllib.request.urlopen(hard.metrics_url, timeout=GRACE)
    assert r.headers["Content-Type"].startswith("text/plain; version=")
    assert "# TYPE qkv_http_requests_total counter" in r.read().decode()
    asked = urllib.request.Request(hard.metrics_url, headers={"Accept": "application/openmetrics-text"})
    r = urllib.request.urlopen(asked, timeout=GRACE)
    assert r.headers["Content-Type"].startswith("application/openmetrics-text") and r.read().endswith(b"# EOF\n")
    zipped = urllib.request.Request(hard.metrics_url + "?name[]=qkv_model_info", headers={"Accept-Encoding": "gzip"})
    r = urllib.request.urlopen(zipped, timeout=GRACE)
    text = gzip.decompress(r.read()).decode()
    assert r.headers["Content-Encoding"] == "gzip" and "qkv_model_info" in text and "qkv_requests" not in text
    host, port = hard.metrics_url.removeprefix("http://").split("/")[0].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=GRACE)
    c.request("POST", "/metrics", body=b"x")
    assert c.getresponse().status == 405
    c.close()
    assert BACKLOG >= 128 and MAX_HEAD_BYTES <= 64 << 10


def test_a_fault_of_the_server_is_a_counted_500_with_its_traceback_logged(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from aiohttp.test_utils import make_mocked_request

    from service.frontends.rest_api import RestServer
    from service.frontends.security import BearerTokens
    from service.observability.metrics import Metrics

    metrics = Metrics()
    plane = SimpleNamespace(in_repository=lambda name: False)
    from service.frontends.shared_memory import SharedMemoryRegistry

    settings = SimpleNamespace(max_message_bytes=1 << 20)
    rest = RestServer(plane, metrics, settings, BearerTokens([]), None, SharedMemoryRegistry(0, 0, 0))  # type: ignore[arg-type]

    async def broken(*_: Any) -> Any:
        raise RuntimeError("a bug")

    rest._server_routes[("health", "live")] = dataclasses.replace(
        rest._server_routes[("health", "live")], handler=broken
    )
    response = asyncio.run(rest._handle(make_mocked_request("GET", "/v2/health/live")))
    assert response.status == 500
    assert metrics.http_requests.labels("", "live", "500")._value.get() == 1
    assert "a bug" in caplog.text and "its log has the details" in response.text  # type: ignore[attr-defined]
