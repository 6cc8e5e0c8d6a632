"""Attacks on a running server, each legal in size (under --max-message-bytes), each under a probe.

A probe thread sends a one-word g2p request and a gRPC health Check every 50 ms while the attack runs.
Each test decides on what the server answered, never on speed: the attack's status and the limit its
message names, no probe or health check failed (each may take up to PROBE_TIMEOUT, far beyond any
machine's slowness, far below a stalled server's), the server's RSS after the attack back
within 10 % of before (RSS_RETURNED; waited for while the server hands its heap back), and the server
still serving. The measured figures (probe p50/p99, refusal time, RSS before and after) go to the run's
summary, section "attacks".
"""

from __future__ import annotations

import http.client
import json
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service import protocol
from service.datatypes import encode_bytes
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.figures import FIGURES

MAX_BYTES = (64 << 20) + (1 << 20)  # the server's --max-message-bytes: room for a 64 MiB attack
PROBE_TIMEOUT = 10.0  # a probe slower than this failed: a stalled server (20 s), not a slow machine
PROBE_EVERY = 0.05
RSS_RETURNED = 1.10  # RSS after an attack, at most this share of before: what it held went back (was +2.4 GiB)
RSS_WAIT_S = 30.0  # ... once the server has handed back what the request held
ATTACK_TIMEOUT = 120.0
INFER = "/inference.GRPCInferenceService/ModelInfer"
LOAD = "/inference.GRPCInferenceService/RepositoryModelLoad"
OPTIONS = [("grpc.max_send_message_length", MAX_BYTES), ("grpc.max_receive_message_length", MAX_BYTES)]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (tag, varint length, payload)."""
    n, length = len(payload), bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    return bytes([number << 3 | 2]) + bytes(length) + payload


def _one_word() -> bytes:
    request = protocol.ModelInferRequest(model_name="g2p")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(encode_bytes(np.array([b"cat"], dtype=object)))
    return request.SerializeToString()


@dataclass
class Probe:
    """One-word g2p requests and health checks every PROBE_EVERY seconds, on their own channel."""

    url: str
    metadata: tuple[tuple[str, str], ...] = ()  # a bearer token, where the server wants one
    latencies: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    health_checks: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Probe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(2 * PROBE_TIMEOUT + 5)

    def _run(self) -> None:
        body = _one_word()
        with grpc.insecure_channel(self.url) as channel:
            infer = channel.unary_unary(INFER)
            health = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    infer(body, timeout=PROBE_TIMEOUT, metadata=self.metadata)
                    self.latencies.append(time.perf_counter() - started)
                except grpc.RpcError as e:
                    self.failed.append(f"infer {e.code().name}: {e.details()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT).status
                    self.health_checks += 1
                    if status != health_pb2.HealthCheckResponse.SERVING:
                        self.failed.append(f"health {status}")
                except grpc.RpcError as e:
                    self.failed.append(f"health {e.code().name}")
                self._stop.wait(PROBE_EVERY)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1e3 if self.latencies else float("nan")


@dataclass
class Outcome:
    code: str
    details: str
    seconds: float  # from sending the attack to its answer
    probe: Probe
    rss_before: float
    rss_after: float


def _attack(
    server: RunningServer, name: str, send: Callable[[], tuple[str, str]], metadata: tuple[tuple[str, str], ...] = ()
) -> Outcome:
    """`send` under the probe (its requests with `metadata`); the figures recorded under `name`; the common
    decisions asserted."""
    pid = server.process.pid
    rss_before = _rss_mib(pid)
    bound = rss_before * RSS_RETURNED
    with Probe(server.url, metadata) as probe:
        time.sleep(0.3)  # the probe's baseline
        started = time.perf_counter()
        code, details = send()
        seconds = time.perf_counter() - started
        time.sleep(0.5)  # and the probe after it
    # Memory the request held is handed back soon after (the server trims at most once a second, on a thread):
    # waited for, within a generous deadline that a loaded machine's slowness does not reach and a leak does.
    deadline = time.monotonic() + RSS_WAIT_S
    while (rss_after := _rss_mib(pid)) > bound and time.monotonic() < deadline:
        time.sleep(0.25)
    outcome = Outcome(code, details, seconds, probe, rss_before, rss_after)
    FIGURES.setdefault("attacks", {})[name] = (
        f"{code} in {seconds:.2f} s; probe p50 {probe.percentile(50):.0f} ms p99 {probe.percentile(99):.0f} ms "
        f"max {probe.percentile(100):.0f} ms ({len(probe.latencies)} answered, {probe.health_checks} health checks, "
        f"{len(probe.failed)} failed); RSS {rss_before:.0f} -> {rss_after:.0f} MiB"
    )
    assert not probe.failed, (name, probe.failed[:5])
    assert probe.latencies, name
    assert rss_after <= bound, (name, rss_before, rss_after, f"waited {RSS_WAIT_S:g} s")
    return outcome


def _grpc_send(server: RunningServer, body: bytes, method: str = INFER) -> Callable[[], tuple[str, str]]:
    def send() -> tuple[str, str]:
        with grpc.insecure_channel(server.url, options=OPTIONS) as channel:
            try:
                channel.unary_unary(method)(body, timeout=ATTACK_TIMEOUT)
                return "OK", ""
            except grpc.RpcError as e:
                return e.code().name, e.details() or ""

    return send


def _still_serves(server: RunningServer, metadata: tuple[tuple[str, str], ...] = ()) -> None:
    with grpc.insecure_channel(server.url) as channel:
        channel.unary_unary(INFER)(_one_word(), timeout=PROBE_TIMEOUT, metadata=metadata)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped g2p, and a model whose graph is not ONNX (its load fails)."""
    root = tmp_path_factory.mktemp("attacks") / "repo"
    root.mkdir()
    (root / "g2p").symlink_to(MODELS / "g2p", target_is_directory=True)
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx graph")
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    args = ["--model-repository", str(repo), "--max-message-bytes", str(MAX_BYTES)]
    args += ["--model-control-mode", "explicit", "--load-model", "g2p"]
    s = start_server(args, tmp_path_factory.mktemp("attacks-log") / "server.log")
    yield s
    stop_server(s)


WORDS_RAW = (struct.pack("<I", 1020) + b"a " * 510) * 65_535  # 64 MiB, some 33 million words


def _word_flood() -> bytes:
    request = protocol.ModelInferRequest(model_name="g2p")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[65_535])
    request.raw_input_contents.append(WORDS_RAW)
    return request.SerializeToString()


def test_a_64_mib_word_flood_is_refused_at_once(server: RunningServer) -> None:
    outcome = _attack(server, "g2p word flood, 65,535 x 1,020 bytes (gRPC)", _grpc_send(server, _word_flood()))
    assert outcome.code == "INVALID_ARGUMENT"
    assert "exceeds the limit of 64 BYTES elements" in outcome.details and "max_words 64" in outcome.details
    _still_serves(server)


def test_one_64_mib_element_is_refused_before_it_is_copied(server: RunningServer) -> None:
    request = protocol.ModelInferRequest(model_name="g2p")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 64 << 20) + b"a " * (32 << 20))
    send = _grpc_send(server, request.SerializeToString())
    outcome = _attack(server, "g2p one element of 64 MiB (gRPC)", send)
    assert outcome.code == "INVALID_ARGUMENT"
    assert f"element 0: {64 << 20} bytes, the limit is 1024" in outcome.details
    _still_serves(server)


def test_a_word_flood_over_http_binary_is_refused_at_once(server: RunningServer) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "TEXT",
                    "datatype": "BYTES",
                    "shape": [65_535],
                    "parameters": {"binary_data_size": len(WORDS_RAW)},
                }
            ]
        }
    ).encode()
    host, port = server.http_url.split(":")

    def send() -> tuple[str, str]:
        connection = http.client.HTTPConnection(host, int(port), timeout=ATTACK_TIMEOUT)
        try:
            connection.request(
                "POST",
                "/v2/models/g2p/infer",
                body=header + WORDS_RAW,
                headers={
                    "Inference-Header-Content-Length": str(len(header)),
                    "Content-Type": "application/octet-stream",
                },
            )
            response = connection.getresponse()
            body = response.read()
            return str(response.status), json.loads(body).get("error", "") if body else ""
        finally:
            connection.close()

    outcome = _attack(server, "g2p word flood, 65,535 x 1,020 bytes (HTTP binary)", send)
    assert outcome.code == "400"
    assert "exceeds the limit of 64 BYTES elements" in outcome.details and "max_words 64" in outcome.details
    _still_serves(server)


TEXT_TENSOR = _field(1, b"TEXT") + _field(2, b"BYTES") + _field(3, b"\x01")  # an input's name, datatype, shape [1]


def test_many_inputs_are_counted_before_they_are_read(server: RunningServer) -> None:
    body = _field(1, b"g2p") + _field(5, TEXT_TENSOR) * 1_500_000
    outcome = _attack(server, "1.5 M inputs", _grpc_send(server, body))
    assert outcome.code == "INVALID_ARGUMENT"
    assert f"inputs: more than 1024 in a {len(body)}-byte request, the limit is 1024 (MAX_TENSORS)" in outcome.details
    _still_serves(server)


def test_many_outputs_are_counted_before_they_are_read(server: RunningServer) -> None:
    body = _field(1, b"g2p") + _field(6, b"") * 20_000_000
    outcome = _attack(server, "20 M empty outputs", _grpc_send(server, body))
    assert outcome.code == "INVALID_ARGUMENT"
    assert f"outputs: more than 1024 in a {len(body)}-byte request, the limit is 1024 (MAX_TENSORS)" in outcome.details
    _still_serves(server)


def test_many_raw_contents_are_counted_before_they_are_read(server: RunningServer) -> None:
    body = _field(1, b"g2p") + _field(5, TEXT_TENSOR) + _field(7, b"") * 30_000_000
    outcome = _attack(server, "30 M raw_input_contents", _grpc_send(server, body))
    assert outcome.code == "INVALID_ARGUMENT"
    assert f"raw_input_contents: more than 1024 in a {len(body)}-byte request, the limit is 1024 (MAX_TENSORS)" in (
        outcome.details
    )
    _still_serves(server)


def test_many_parameters_are_counted_before_they_are_read(server: RunningServer) -> None:
    value = _field(2, b"\x08\x01")  # InferParameter(bool_param=True)
    entries = b"".join(_field(4, _field(1, b"k%07d" % i) + value) for i in range(2_000_000))
    body = _field(1, b"g2p") + entries
    outcome = _attack(server, "2 M parameters", _grpc_send(server, body))
    assert outcome.code == "INVALID_ARGUMENT"
    assert (
        f"parameters: more than 64 in a {len(body)}-byte request, the limit is 64 (MAX_PARAMETERS)" in outcome.details
    )
    _still_serves(server)


def test_many_parameters_of_one_input_are_counted_before_they_are_read(server: RunningServer) -> None:
    entries = b"".join(_field(4, _field(1, b"k%07d" % i) + _field(2, b"\x08\x01")) for i in range(2_000_000))
    body = _field(1, b"g2p") + _field(5, TEXT_TENSOR + entries)
    outcome = _attack(server, "2 M parameters of one input", _grpc_send(server, body))
    assert outcome.code == "INVALID_ARGUMENT"
    assert f"inputs[0].parameters: more than 64 in a {len(body)}-byte request, the limit is 64 (MAX_PARAMETERS)" in (
        outcome.details
    )
    _still_serves(server)


def test_many_bytes_contents_are_counted_before_they_are_read(server: RunningServer) -> None:
    contents = _field(5, _field(8, b"") * 30_000_000)  # InferTensorContents.bytes_contents, all empty
    body = _field(1, b"g2p") + _field(5, TEXT_TENSOR + contents)
    outcome = _attack(server, "30 M empty bytes_contents", _grpc_send(server, body))
    assert outcome.code == "INVALID_ARGUMENT"
    assert f"inputs[0].contents.bytes_contents: more than 65536 in a {len(body)}-byte request" in outcome.details
    assert "the limit is 65536 (MAX_BYTES_ELEMENTS)" in outcome.details
    _still_serves(server)


def test_many_outputs_on_a_stream_are_that_requests_answer(server: RunningServer) -> None:
    body = _field(1, b"g2p") + _field(3, b"flood") + _field(6, b"") * 20_000_000

    def send() -> tuple[str, str]:
        with grpc.insecure_channel(server.url, options=OPTIONS) as channel:
            stream = channel.stream_stream(f"/{protocol.SERVICE_NAME}/ModelStreamInfer")
            replies = [protocol.ModelStreamInferResponse.FromString(r) for r in stream(iter([body, _one_word()]))]
        assert [r.infer_response.id for r in replies] == ["flood", ""], replies  # the stream went on
        assert replies[0].infer_response.model_name == "g2p" and not replies[1].error_message, replies
        error = replies[0].error_message
        return error.split(":", 1)[0], error

    outcome = _attack(server, "20 M empty outputs on a stream", send)
    assert outcome.code == "INVALID_ARGUMENT"
    assert f"outputs: more than 1024 in a {len(body)}-byte request, the limit is 1024 (MAX_TENSORS)" in outcome.details
    _still_serves(server)


def test_control_characters_come_back_escaped(server: RunningServer) -> None:
    request = protocol.ModelInferRequest(model_name="g2p")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(encode_bytes(np.array([b"ab\x1b[31mc\x07d\x7f"], dtype=object)))
    outcome = _attack(server, "g2p control characters", _grpc_send(server, request.SerializeToString()))
    assert outcome.code == "INVALID_ARGUMENT"
    assert not any(c in outcome.details for c in "\x1b\x07\x7f"), outcome.details
    assert "cannot spell character '\\x1b' (U+001B) in 'ab\\x1b[31mc\\x07d\\x7f'" in outcome.details


def test_a_failing_load_names_no_server_path(server: RunningServer, repo: Path) -> None:
    request = protocol.RepositoryModelLoadRequest(model_name="broken")
    outcome = _attack(server, "a failing load", _grpc_send(server, request.SerializeToString(), LOAD))
    assert outcome.code == "INVALID_ARGUMENT"
    assert "failed to load 'broken'" in outcome.details and "broken/1/model.onnx" in outcome.details
    for path in {str(repo), str(repo.resolve()), str(MODELS)}:
        assert path not in outcome.details
    with grpc.insecure_channel(server.url) as channel:
        index = protocol.Stub(channel).RepositoryIndex(protocol.RepositoryIndexRequest(), timeout=PROBE_TIMEOUT)
    reasons = [m.reason for m in index.models if m.name == "broken"]
    assert reasons and all("broken/1/model.onnx" in r and str(repo.resolve()) not in r for r in reasons), reasons
    assert str(repo.resolve() / "broken") in server.output()  # the server's log keeps the whole path
