"""Model versions, load, unload and reload while the server answers: real servers, tritonclient, real files."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as g
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from service.repository.layout import RepositoryError, VersionPolicy
from tests.conftest import MODELS, RunningServer, start_server
from tests.figures import FIGURES

ADMIN, USER = "admin-s3cret", "user-token"
Explicit = tuple[RunningServer, g.InferenceServerClient, Path]  # a server, its client, its repository


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def scale_version(model_dir: Path, version: int, factor: float) -> None:
    """Version `version` of a model that answers y = x * factor (x, y FP32 [batch, 3])."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [3], [factor] * 3)
    _save(helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "scale", [x], [y], [w]),
          model_dir / str(version) / "model.onnx")  # fmt: skip


def failing_version(model_dir: Path, version: int) -> None:
    """A graph that loads but cannot run: it reshapes [batch, 3] to 5 elements."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [5])
    _save(helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "bad", [x], [y], [shape]),
          model_dir / str(version) / "model.onnx")  # fmt: skip


def wide_version(model_dir: Path, version: int, width: int = 2048) -> None:
    """A model with width x width FP32 weights (16 MiB at 2048), for memory to be seen."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    w = numpy_helper.from_array(np.random.default_rng(version).standard_normal((width, width), np.float32), "w")
    _save(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "wide", [x], [y], [w]),
          model_dir / str(version) / "model.onnx")  # fmt: skip


def encoder_version(model_dir: Path, version: int) -> None:
    """The shipped g2p_encoder's graph as `version` of `model_dir` (with its config.json)."""
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS / "g2p_encoder" / "config.json", model_dir / "config.json")
    shutil.copy(MODELS / "g2p_encoder" / "1" / "model.onnx", model_dir / str(version) / "model.onnx")


def infer_scale(client: g.InferenceServerClient, model: str = "scale", version: str = "") -> tuple[float, str]:
    """The factor the answering version multiplies by, and that version."""
    x = g.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), np.float32))
    result = client.infer(model, [x], model_version=version)
    response = result.get_response()
    return float(result.as_numpy("y")[0, 0]), response.model_version


def rss_mib(server: RunningServer) -> float:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def index(client: g.InferenceServerClient) -> dict[tuple[str, str], tuple[str, str]]:
    rows = client.get_model_repository_index(as_json=True).get("models", [])
    return {(r["name"], r.get("version", "")): (r.get("state", ""), r.get("reason", "")) for r in rows}


def status_of(call: Callable[[], object]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as e:
        call()
    return str(e.value.status()), e.value.message()


def _explicit(tmp_path: Path, workers: str) -> Iterator[Explicit]:
    repo = tmp_path / "repo"
    scale_version(repo / "scale", 1, 1.0)
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit", "--workers", workers]
    with start_server(args, tmp_path / "log") as server, g.InferenceServerClient(server.url) as client:
        yield server, client, repo


@pytest.fixture(params=["1", "2"], ids=["one-process", "workers-2"])
def explicit(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Explicit]:
    """An explicit-mode server on a repository of its own, no model loaded; one process, or two workers (a load
    or unload on one applies on both before it is answered)."""
    yield from _explicit(tmp_path, request.param)


@pytest.fixture
def explicit_one(tmp_path: Path) -> Iterator[Explicit]:
    """The same, one process (whose memory a test reads)."""
    yield from _explicit(tmp_path, "1")


def test_version_policy_chooses_versions() -> None:
    where = "model 'm'"
    assert VersionPolicy.parse({"latest": {"num_versions": 2}}, where).choose([1, 3, 2], where) == [2, 3]
    assert VersionPolicy().choose([1, 3, 2], where) == [3]
    assert VersionPolicy.parse({"all": {}}, where).choose([3, 1], where) == [1, 3]
    assert VersionPolicy.parse({"specific": {"versions": [3, 1]}}, where).choose([1, 2, 3], where) == [1, 3]
    with pytest.raises(RepositoryError, match=r"version\(s\) \[4\]"):
        VersionPolicy.parse({"specific": {"versions": [4]}}, where).choose([1], where)
    for bad in ({"latest": {"num_versions": 0}}, {"newest": {}}, {"all": {}, "latest": {}}, [], {"specific": {}}):
        with pytest.raises(RepositoryError, match="version_policy"):
            VersionPolicy.parse(bad, where)


def test_explicit_load_and_unload_through_tritonclient(
    explicit: Explicit,
) -> None:
    server, client, _ = explicit
    assert index(client) == {("scale", ""): ("UNAVAILABLE", "not loaded")}
    assert status_of(lambda: infer_scale(client))[0] == "StatusCode.NOT_FOUND"
    assert not client.is_model_ready("scale")

    client.load_model("scale")
    assert client.is_model_ready("scale") and client.is_model_ready("scale", "1")
    assert infer_scale(client) == (1.0, "1")
    assert index(client) == {("scale", "1"): ("READY", "")}
    with grpc.insecure_channel(server.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (
            health.Check(health_pb2.HealthCheckRequest(service="scale")).status
            == health_pb2.HealthCheckResponse.SERVING
        )

        client.unload_model("scale")
        assert health.Check(health_pb2.HealthCheckRequest(service="scale")).status == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
    assert not client.is_model_ready("scale")
    code, message = status_of(lambda: infer_scale(client))
    assert code == "StatusCode.UNAVAILABLE" and "unloaded" in message
    assert index(client) == {("scale", ""): ("UNAVAILABLE", "unloaded")}
    text = _metrics(server)
    assert 'version="1"' not in text  # the unloaded version's series went with it
    assert 'qkv_requests_total{code="UNAVAILABLE",model="scale",version=""} 1.0' in text

    client.load_model("scale")  # and back
    assert infer_scale(client) == (1.0, "1")


def _metrics(server: RunningServer) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()


def test_version_policy_through_load_and_versions_told_apart(
    explicit: Explicit,
) -> None:
    server, client, repo = explicit
    for v, factor in ((2, 2.0), (3, 3.0)):
        scale_version(repo / "scale", v, factor)
    client.load_model("scale", config=json.dumps({"version_policy": {"all": {}}}))
    assert client.get_model_metadata("scale").versions == ["1", "2", "3"]
    assert [infer_scale(client, version=v) for v in ("1", "2", "3")] == [(1.0, "1"), (2.0, "2"), (3.0, "3")]
    assert infer_scale(client) == (3.0, "3")  # no version: the newest
    stats = client.get_inference_statistics("scale").model_stats
    assert sorted((s.version, s.inference_count) for s in stats) == [("1", 1), ("2", 1), ("3", 2)]
    assert [s.version for s in client.get_inference_statistics("scale", "2").model_stats] == ["2"]
    text = _metrics(server)
    for v in ("1", "2", "3"):
        assert f'qkv_model_info{{model="scale",provider="CPUExecutionProvider",version="{v}"}} 1.0' in text
    assert 'qkv_requests_total{code="OK",model="scale",version="3"} 2.0' in text

    client.load_model("scale", config=json.dumps({"version_policy": {"latest": {"num_versions": 2}}}))
    assert client.get_model_metadata("scale").versions == ["2", "3"]
    code, message = status_of(lambda: infer_scale(client, version="1"))
    assert code == "StatusCode.NOT_FOUND" and "version '1'" in message
    assert not client.is_model_ready("scale", "1")
    text = _metrics(server)
    assert 'version="1"' not in text and 'qkv_requests_total{code="OK",model="scale",version="3"} 2.0' in text

    client.load_model("scale", config=json.dumps({"version_policy": {"specific": {"versions": [1]}}}))
    assert client.get_model_metadata("scale").versions == ["1"]
    assert infer_scale(client) == (1.0, "1")
    client.load_model("scale")  # the file's policy again: the newest
    assert client.get_model_metadata("scale").versions == ["3"]


def test_a_bad_version_never_takes_over(explicit: Explicit) -> None:
    _, client, repo = explicit
    client.load_model("scale")
    model = repo / "scale"

    def refused(expect: str, config: str | None = None) -> str:
        code, message = status_of(lambda: client.load_model("scale", config=config))
        assert code == "StatusCode.INVALID_ARGUMENT" and expect in message, message
        assert infer_scale(client) == (1.0, "1"), "the serving version stopped serving"
        return message

    (model / "2").mkdir()
    (model / "2" / "model.onnx").write_bytes(b"\x08\x07 not a graph")
    message = refused("scale/2/model.onnx")  # named within the repository: the server's own path stays private
    assert str(repo) not in message, message
    assert index(client)[("scale", "2")] == ("UNAVAILABLE", message.removeprefix("failed to load 'scale': "))
    assert index(client)[("scale", "1")] == ("READY", "")

    (model / "2" / "model.onnx").unlink()
    assert str(repo) not in refused("missing scale/2/model.onnx")

    failing_version(model, 2)
    refused("warm-up failed")

    scale_version(model, 2, 2.0)
    declared = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}]}
    refused("has inputs x FP32 [-1, 3]; config.json declares input_ids INT64 [-1, -1]", json.dumps(declared))

    (model / "config.json").write_text('{"kind": "tensor", ')
    assert str(repo) not in refused("scale/config.json is not valid JSON")
    (model / "config.json").write_text('{"batching": {"max_batch_size": 8, "typo": 1}}')
    refused("unknown setting(s) ['typo']")
    (model / "config.json").unlink()

    client.load_model("scale")  # the good version 2 now takes over
    assert infer_scale(client) == (2.0, "2")
    assert index(client) == {("scale", "2"): ("READY", "")}


def test_load_and_unload_requests_are_checked(explicit: Explicit) -> None:
    _, client, _ = explicit
    assert status_of(lambda: client.load_model("nope"))[0] == "StatusCode.NOT_FOUND"
    assert status_of(lambda: client.unload_model("nope"))[0] == "StatusCode.NOT_FOUND"
    code, message = status_of(lambda: client.load_model("scale", config="{not json"))
    assert code == "StatusCode.INVALID_ARGUMENT" and "'config' is not JSON" in message
    code, message = status_of(lambda: client.load_model("scale", config="[1]"))
    assert code == "StatusCode.INVALID_ARGUMENT" and "JSON object" in message
    code, message = status_of(lambda: client.load_model("scale", files={"file:1/model.onnx": b"x"}))
    assert code == "StatusCode.INVALID_ARGUMENT" and "'file:1/model.onnx' is not supported" in message
    assert message.startswith("failed to load 'scale', failed to poll from model repository: load parameter")
    code, message = status_of(lambda: client.load_model("scale", config="{}", files={"file:" + "A" * 256: b"a"}))
    assert code == "StatusCode.INVALID_ARGUMENT" and "failed to poll from model repository" in message  # Triton's
    assert not client.is_model_ready("scale")


def test_model_control_is_guarded(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    scale_version(repo / "scale", 1, 1.0)
    explicit = ["--model-repository", str(repo), "--model-control-mode", "explicit"]
    for args, status, says in (
        (["--model-repository", str(repo)], "FAILED_PRECONDITION", "--model-control-mode explicit"),
        ([*explicit, "--load-model", "scale", "--host", "0.0.0.0"], "PERMISSION_DENIED", "--admin-token-file"),
    ):
        with start_server(args, tmp_path / f"{status}.log") as server, g.InferenceServerClient(server.url) as client:
            code, message = status_of(lambda c=client: c.unload_model("scale"))
            assert code == f"StatusCode.{status}" and says in message
            assert infer_scale(client) == (1.0, "1")

    (tmp_path / "admin").write_text(ADMIN + "\n")
    (tmp_path / "users").write_text(USER + "\n")
    tokens = ["--admin-token-file", str(tmp_path / "admin"), "--auth-token-file", str(tmp_path / "users")]
    args = [*explicit, "--load-model", "*", "--host", "0.0.0.0", *tokens]
    with start_server(args, tmp_path / "guarded.log") as guarded, g.InferenceServerClient(guarded.url) as client:
        user, admin = {"authorization": f"Bearer {USER}"}, {"authorization": f"Bearer {ADMIN}"}
        for headers in (None, user):
            code, message = status_of(lambda h=headers: client.unload_model("scale", headers=h))
            assert code == "StatusCode.UNAUTHENTICATED" and "admin bearer token" in message
            assert status_of(lambda h=headers: client.get_model_repository_index(headers=h))[0] == (
                "StatusCode.UNAUTHENTICATED"
            )
        x = g.InferInput("x", [1, 3], "FP32")
        x.set_data_from_numpy(np.ones((1, 3), np.float32))
        assert status_of(lambda: client.infer("scale", [x], headers=admin))[0] == "StatusCode.UNAUTHENTICATED"
        client.unload_model("scale", headers=admin)
        assert not client.is_model_ready("scale")
        client.load_model("scale", headers=admin)
        assert client.infer("scale", [x], headers=user).as_numpy("y").tolist() == [[1.0, 1.0, 1.0]]


class SteadyLoad:
    """`clients` threads sending g2p_encoder-shaped requests back to back; every outcome counted."""

    def __init__(self, url: str, model: str, clients: int = 6) -> None:
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.codes: Counter[str] = Counter()
        self.versions: Counter[str] = Counter()
        self.samples: list[tuple[float, float, str]] = []  # (sent at, seconds, version that answered)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with g.InferenceServerClient(self.url) as client:
            while not self.stop.is_set():
                length = int(rng.integers(4, 24))
                ids = g.InferInput("input_ids", [1, length], "INT64")
                ids.set_data_from_numpy(rng.integers(4, 33, (1, length)).astype(np.int64))
                mask = g.InferInput("attention_mask", [1, length], "INT64")
                mask.set_data_from_numpy(np.ones((1, length), np.int64))
                t0 = time.perf_counter()
                try:
                    version = client.infer(self.model, [ids, mask]).get_response().model_version
                    code = "OK"
                except InferenceServerException as e:
                    code, version = str(e.status()), ""
                with self.lock:
                    self.codes[code] += 1
                    self.versions[version] += 1
                    self.samples.append((t0, time.perf_counter() - t0, version))

    def __enter__(self) -> SteadyLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def p99_ms(self, start: float, end: float) -> float:
        """A figure: the p99 latency of the requests sent in [start, end) (NaN when none were)."""
        with self.lock:
            window = sorted(s for t, s, _ in self.samples if start <= t < end)
        return window[int(0.99 * (len(window) - 1))] * 1e3 if window else float("nan")

    def answered_by(self, version: str) -> int:
        with self.lock:
            return self.versions[version]


def test_reload_under_load_loses_no_request(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    encoder_version(repo / "enc", 1)
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "enc"]
    with start_server(args, tmp_path / "log") as server:
        with g.InferenceServerClient(server.url) as client, SteadyLoad(server.url, "enc") as load:
            wait_for(lambda: load.answered_by("1") >= 50, "50 requests answered by version 1", timeout=120)
            encoder_version(repo / "enc", 2)
            reload_start = time.perf_counter()
            client.load_model("enc")  # version 2 builds and warms up beside version 1, then version 1 drains
            reload_end = time.perf_counter()
            assert client.get_model_metadata("enc").versions == ["2"]
            wait_for(lambda: load.answered_by("2") >= 50, "50 requests answered by version 2", timeout=120)
        before = load.p99_ms(0, reload_start)
        during = load.p99_ms(reload_start, reload_end)
        sent = sum(load.codes.values())
        assert load.codes == Counter({"OK": sent}), load.codes  # not one request failed
        # Version 1 served on while version 2 was built and warmed up: requests sent after the reload began were
        # answered, by version 1, before it ended. (How fast is a figure, below.)
        served_meanwhile = [s for s in load.samples if reload_start <= s[0] and s[0] + s[1] <= reload_end]
        assert any(v == "1" for _, _, v in served_meanwhile), "no request was answered while the reload ran"
        FIGURES["reload under load"] = {
            "requests sent / answered OK / failed": f"{sent} / {load.codes['OK']} / {sent - load.codes['OK']}",
            "answered by version 1 / version 2": f"{load.versions['1']} / {load.versions['2']}",
            "reload took": f"{reload_end - reload_start:.2f} s",
            "p99 before / during the reload": f"{before:.1f} ms / {during:.1f} ms",
        }


def test_memory_returns_after_unload(explicit_one: Explicit) -> None:
    server, client, repo = explicit_one
    wide_version(repo / "wide", 1)
    client.load_model("scale")
    time.sleep(0.5)
    rss = [rss_mib(server)]
    for _ in range(3):
        client.load_model("wide")
        rss.append(rss_mib(server))
        client.unload_model("wide")
        rss.append(rss_mib(server))
    FIGURES["memory over load and unload (16 MiB of weights, 2 instances)"] = {
        "RSS before, then after each of 3 loads and unloads": " / ".join(f"{r:.0f}" for r in rss) + " MiB",
    }
    # Each unload gives back what its load took (the server allocates from one glibc heap, which
    # malloc_trim can hand back anywhere), and nothing accumulates over cycles.
    for loaded, unloaded in zip(rss[1::2], rss[2::2], strict=True):
        grew = loaded - rss[0]
        assert grew > 16, f"loading 16 MiB of weights grew RSS by {grew:.1f} MiB: {rss}"
        assert unloaded - rss[0] < 0.25 * grew + 8, rss


def test_poll_mode_follows_the_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    scale_version(repo / "scale", 1, 1.0)
    args = ["--model-repository", str(repo), "--model-control-mode", "poll", "--repository-poll-secs", "0.2"]
    with start_server(args, tmp_path / "log") as server, g.InferenceServerClient(server.url) as client:
        assert infer_scale(client) == (1.0, "1")
        staged = tmp_path / "staged"
        scale_version(staged, 2, 2.0)
        (staged / "2").rename(repo / "scale" / "2")  # a version appears on disk whole
        wait_for(lambda: client.get_model_metadata("scale").versions == ["2"], "version 2 to replace 1")
        assert infer_scale(client) == (2.0, "2")

        shutil.rmtree(repo / "scale" / "2")
        wait_for(lambda: client.get_model_metadata("scale").versions == ["1"], "version 1 back")

        failing_version(staged, 3)
        (staged / "3").rename(repo / "scale" / "3")  # a bad version: refused, version 1 serves on

        def state_of_3() -> str:
            return index(client).get(("scale", "3"), ("", ""))[0]

        # Listed as LOADING first, for as long as this machine takes to try it: wait for where it ends.
        wait_for(lambda: state_of_3() not in ("", "LOADING"), "version 3 loaded or refused, in the index")
        assert state_of_3() == "UNAVAILABLE" and infer_scale(client) == (1.0, "1")
        shutil.rmtree(repo / "scale" / "3")

        scale_version(staged / "more", 1, 5.0)
        (staged / "more").rename(repo / "more")  # a model appears
        wait_for(lambda: client.is_model_ready("more"), "model 'more' to load")
        assert infer_scale(client, "more") == (5.0, "1")
        shutil.rmtree(repo / "more")  # and goes
        wait_for(lambda: ("more", "") not in index(client) and not client.is_model_ready("more"), "'more' gone")
        assert status_of(lambda: infer_scale(client, "more"))[0] == "StatusCode.NOT_FOUND"


def test_load_and_unload_over_http(explicit: Explicit) -> None:
    server, client, _ = explicit

    def post(path: str, body: dict[str, object] | None = None) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert post("/v2/repository/models/scale/load") == (200, "")
    assert infer_scale(client) == (1.0, "1")
    config = json.dumps({"batching": {"bogus": 1}})
    status, body = post("/v2/repository/models/scale/load", {"parameters": {"config": config}})
    assert status == 400 and "unknown setting(s) ['bogus']" in json.loads(body)["error"]
    assert infer_scale(client) == (1.0, "1")
    status, body = post("/v2/repository/index")
    assert status == 200 and {"name": "scale", "version": "1", "state": "READY", "reason": ""} in json.loads(body)
    assert post("/v2/repository/models/scale/unload") == (200, "")
    assert not client.is_model_ready("scale")
    status, body = post("/v2/repository/models/nope/load")
    assert status == 404 and "failed to load 'nope', failed to poll from model repository" in json.loads(body)["error"]
