"""Ensembles (config.json's ensemble_scheduling) on a real server, through tritonclient over gRPC and HTTP.

The image pipeline is Triton's classification ensemble in plain ONNX: a model decodes an image file sent
as one BYTES element, a classifier scores it, and the ensemble's output carries class labels.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer, start_server, stop_server
from tests.service.ensemble_models import LABELS, classify_pixels, image_pipeline, ppm_bytes, scale_add

SIZE = 8  # the test images' width and height


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)


def _expected(images: list[np.ndarray]) -> np.ndarray:
    return classify_pixels(np.stack([i.transpose(2, 0, 1) / 255 for i in images]).astype(np.float32))


def _files(images: list[np.ndarray]) -> np.ndarray:
    return np.array([[ppm_bytes(i)] for i in images], dtype=np.object_)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ensembles") / "models"
    image_pipeline(root, SIZE, name="a_image_ensemble")  # listed before its steps: loaded after them
    scale_add(root)
    return root


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    s = start_server(["--model-repository", str(repo), "--http-port", "0"], repo.parent / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


def _grpc_scores(served: RunningServer, files: np.ndarray, classes: int = 0) -> np.ndarray:
    with g.InferenceServerClient(served.url) as client:
        image = g.InferInput("IMAGE", list(files.shape), "BYTES")
        image.set_data_from_numpy(files)
        result = client.infer(
            "a_image_ensemble", [image], outputs=[g.InferRequestedOutput("SCORES", class_count=classes)]
        )
        return result.as_numpy("SCORES")


def test_an_image_runs_through_both_steps_and_gets_the_composed_answer(served: RunningServer) -> None:
    images = [_image(1), _image(2), _image(3)]
    scores = _grpc_scores(served, _files(images))
    np.testing.assert_allclose(scores, _expected(images), rtol=1e-5, atol=1e-6)


def test_the_ensembles_output_is_classified_with_its_own_labels(served: RunningServer) -> None:
    images = [_image(4), _image(5)]
    top = _grpc_scores(served, _files(images), classes=3)
    expected = _expected(images)
    for row, want in zip(top, expected, strict=True):
        order = np.argsort(-want)[:3]
        got = [x.decode().split(":") for x in row]
        assert [int(c[1]) for c in got] == order.tolist()
        assert [c[2] for c in got] == [LABELS[i] for i in order]


def test_http_with_binary_data_gets_the_same_answer(served: RunningServer) -> None:
    images = [_image(6)]
    files = _files(images)
    with h.InferenceServerClient(served.http_url) as client:
        image = h.InferInput("IMAGE", list(files.shape), "BYTES")
        image.set_data_from_numpy(files, binary_data=True)
        answer = client.infer("a_image_ensemble", [image], outputs=[h.InferRequestedOutput("SCORES", binary_data=True)])
    np.testing.assert_allclose(answer.as_numpy("SCORES"), _expected(images), rtol=1e-5, atol=1e-6)


def test_independent_steps_run_and_the_diamond_joins_them(served: RunningServer) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with g.InferenceServerClient(served.url) as client:
        t = g.InferInput("X", [2, 4], "FP32")
        t.set_data_from_numpy(x)
        result = client.infer("fan", [t])
        np.testing.assert_array_equal(result.as_numpy("DOUBLE"), 2 * x)
        np.testing.assert_array_equal(result.as_numpy("NEGATED"), -x)
        np.testing.assert_array_equal(result.as_numpy("SUM"), x)
        before = _step_counts(client)
        only = client.infer("fan", [t], outputs=[g.InferRequestedOutput("NEGATED")])
        assert only.as_numpy("DOUBLE") is None
        np.testing.assert_array_equal(only.as_numpy("NEGATED"), -x)
        after = _step_counts(client)
    # Asking for NEGATED alone runs the one step that writes it.
    assert {m: after[m] - before[m] for m in after} == {"add": 0, "double": 0, "negate": 1}


def _step_counts(client: g.InferenceServerClient) -> dict[str, int]:
    stats = client.get_inference_statistics(as_json=True)["model_stats"]
    return {
        s["name"]: int(s["inference_stats"]["success"].get("count", 0))
        for s in stats
        if s["name"] in ("add", "double", "negate")
    }


def test_model_config_shows_the_platform_and_the_steps_in_their_order(served: RunningServer) -> None:
    with g.InferenceServerClient(served.url) as client:
        config = client.get_model_config("fan", as_json=True)["config"]
        metadata = client.get_model_metadata("fan", as_json=True)
    assert config["platform"] == "ensemble"
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["add", "double", "negate"]
    assert steps[0]["input_map"] == {"a": "DOUBLE", "b": "NEGATED"} and steps[0]["model_version"] == "-1"
    assert metadata["platform"].startswith("ensemble")
    assert [o["name"] for o in metadata["outputs"]] == ["SUM", "DOUBLE", "NEGATED"]


def test_a_failing_step_fails_the_request_naming_the_step_and_its_model(served: RunningServer) -> None:
    broken = np.array([[b"P3 8 8 255 " + b"x " * (3 * SIZE * SIZE)]], dtype=np.object_)
    with pytest.raises(InferenceServerException) as e:
        _grpc_scores(served, broken)
    # onnxruntime's own error, as the step model answers it: the request's inputs are at fault
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "ensemble 'a_image_ensemble' step 0 (model 'decode_ppm')" in str(e.value.message())
    # The server goes on answering.
    np.testing.assert_allclose(_grpc_scores(served, _files([_image(7)])), _expected([_image(7)]), rtol=1e-5, atol=1e-6)


def test_the_ensembles_own_checks_refuse_a_request_before_any_step(served: RunningServer) -> None:
    with g.InferenceServerClient(served.url) as client:
        t = g.InferInput("X", [2, 3], "FP32")
        t.set_data_from_numpy(np.zeros((2, 3), np.float32))
        with pytest.raises(InferenceServerException) as e:
            client.infer("fan", [t])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'X': dimension 1 is 3, model 'fan' expects 4" in str(e.value.message())


def test_each_step_is_counted_in_the_metrics(served: RunningServer) -> None:
    _grpc_scores(served, _files([_image(8)]))
    text = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
    steps = {
        (m["step"], m["step_model"], m["code"]): float(v)
        for m, v in _series(text, "qkv_ensemble_steps_total")
        if m["model"] == "a_image_ensemble"
    }
    assert steps[("0", "decode_ppm", "OK")] >= 1 and steps[("1", "classifier", "OK")] >= 1
    assert steps.get(("0", "decode_ppm", "INVALID_ARGUMENT"), 0) <= steps[("0", "decode_ppm", "OK")] + 1
    durations = [m for m, _ in _series(text, "qkv_ensemble_step_duration_seconds_count")]
    assert {(m["model"], m["step"]) for m in durations} >= {("a_image_ensemble", "0"), ("a_image_ensemble", "1")}
    # each step is a request of its own model, as any other
    requests = {(m["model"], m["code"]) for m, _ in _series(text, "qkv_requests_total")}
    assert {("decode_ppm", "OK"), ("classifier", "OK"), ("a_image_ensemble", "OK")} <= requests


def _series(text: str, name: str) -> list[tuple[dict[str, str], str]]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), value))
    return out


# --- loading ------------------------------------------------------------------------------------------


@pytest.fixture
def explicit(repo: Path, tmp_path: Path) -> Iterator[tuple[RunningServer, Path]]:
    root = tmp_path / "models"
    shutil.copytree(repo, root)
    s = start_server(
        ["--model-repository", str(root), "--model-control-mode", "explicit", "--load-model", "fan"],
        tmp_path / "server.log",
    )
    yield s, root
    stop_server(s)
    assert "Traceback" not in s.output()


def test_loading_an_ensemble_loads_its_step_models_first(explicit: tuple[RunningServer, Path]) -> None:
    served, _ = explicit
    with g.InferenceServerClient(served.url) as client:
        ready = {
            m["name"] for m in client.get_model_repository_index(as_json=True)["models"] if m.get("state") == "READY"
        }
        assert ready == {"fan", "add", "double", "negate"}
        client.load_model("a_image_ensemble")
        assert client.is_model_ready("decode_ppm") and client.is_model_ready("classifier")
    np.testing.assert_allclose(_grpc_scores(served, _files([_image(9)])), _expected([_image(9)]), rtol=1e-5, atol=1e-6)


def test_a_step_model_unloaded_fails_the_ensembles_requests_naming_it(explicit: tuple[RunningServer, Path]) -> None:
    served, _ = explicit
    x = np.ones((1, 4), np.float32)
    with g.InferenceServerClient(served.url) as client:
        client.unload_model("negate")
        t = g.InferInput("X", [1, 4], "FP32")
        t.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as e:
            client.infer("fan", [t])
        assert e.value.status() == "StatusCode.UNAVAILABLE"
        assert "ensemble 'fan' step 2 (model 'negate')" in str(e.value.message())
        client.load_model("negate")
        np.testing.assert_array_equal(client.infer("fan", [t]).as_numpy("SUM"), x)


def _fan_config(repo: Path) -> dict[str, object]:
    config: dict[str, object] = json.loads((repo / "fan" / "config.json").read_text())
    return config


def _refused(served: RunningServer, config: dict[str, object]) -> str:
    with g.InferenceServerClient(served.url) as client:
        with pytest.raises(InferenceServerException) as e:
            client.load_model("fan", config=json.dumps(config))
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        # what was serving keeps serving
        t = g.InferInput("X", [1, 4], "FP32")
        t.set_data_from_numpy(np.ones((1, 4), np.float32))
        np.testing.assert_array_equal(client.infer("fan", [t]).as_numpy("SUM"), np.ones((1, 4), np.float32))
    return str(e.value.message())


def _steps(config: dict[str, object]) -> list[dict[str, object]]:
    steps: list[dict[str, object]] = config["ensemble_scheduling"]["step"]  # type: ignore[index]
    return steps


def test_an_ensemble_naming_a_missing_model_is_refused_at_load(explicit: tuple[RunningServer, Path]) -> None:
    served, root = explicit
    config = _fan_config(root)
    _steps(config)[1]["model_name"] = "nowhere"
    message = _refused(served, config)
    assert "step 1 (model 'nowhere')" in message and "not found" in message


def test_an_ensemble_naming_a_tensor_its_model_lacks_is_refused_at_load(explicit: tuple[RunningServer, Path]) -> None:
    served, root = explicit
    config = _fan_config(root)
    _steps(config)[2]["output_map"] = {"d": "NEGATED"}
    message = _refused(served, config)
    assert "step 2 (model 'negate'): output_map names output 'd', which the model does not have (outputs: c)" in message


def test_an_ensemble_whose_tensors_disagree_is_refused_at_load(explicit: tuple[RunningServer, Path]) -> None:
    served, root = explicit
    config = _fan_config(root)
    config["inputs"] = [{"name": "X", "datatype": "INT32", "shape": [-1, 4]}]
    message = _refused(served, config)
    assert (
        "ensemble tensor 'X': step 1 (model 'double') input 'a' is FP32, but ensemble input 'X' gives INT32" in message
    )
    config["inputs"] = [{"name": "X", "datatype": "FP32", "shape": [-1, 5]}]
    message = _refused(served, config)
    assert "ensemble tensor 'X': step 1 (model 'double') input 'a' has shape [-1, 4], but ensemble input 'X'" in message
    config["inputs"] = [{"name": "X", "datatype": "FP32", "shape": [-1, 4]}]
    config["max_batch_size"] = 128  # more rows than its step models take
    assert "step 1 (model 'double'): the ensemble's max_batch_size 128 exceeds its model's 64" in _refused(
        served, config
    )


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda s: s[0].update(output_map={"c": "DOUBLE"}), "ensemble tensor 'DOUBLE' is written twice"),
        (lambda s: s[1].update(input_map={"a": "SUM"}), "the steps form a cycle"),
        (lambda s: s[1].update(input_map={"a": "Y"}), "reads ensemble tensor 'Y', which is neither an input"),
        (lambda s: s.append({"model_name": "fan", "output_map": {"c": "Z"}}), "names the ensemble itself"),
        (lambda s: s[0].update(model_version=True), "model_version must be -1 (the newest version) or a version"),
        (lambda s: s.clear(), "ensemble_scheduling.step must be a non-empty list"),
    ],
)
def test_an_ensemble_that_cannot_run_is_refused_at_load(
    explicit: tuple[RunningServer, Path], change: object, said: str
) -> None:
    served, root = explicit
    config = _fan_config(root)
    change(_steps(config))  # type: ignore[operator]
    assert said in _refused(served, config)


def test_a_traced_ensemble_request_has_a_span_for_each_step_under_its_own(repo: Path, tmp_path: Path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    s = start_server(
        ["--model-repository", str(repo), "--tracing-file", str(spans_file), "--trace-sample-ratio", "1"],
        tmp_path / "server.log",
    )
    try:
        with g.InferenceServerClient(s.url) as client:
            t = g.InferInput("X", [1, 4], "FP32")
            t.set_data_from_numpy(np.ones((1, 4), np.float32))
            client.infer("fan", [t])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the spans are written in the background, within about a second
            spans = [json.loads(x) for x in spans_file.read_text().splitlines()] if spans_file.exists() else []
            roots = [x for x in spans if x["attributes"].get("qkv.model") == "fan"]
            steps = [x for x in spans if x["name"].startswith("qkv.ensemble.step.")]
            if roots and len(steps) == 3:
                break
            time.sleep(0.1)
    finally:
        stop_server(s)
    [root] = roots
    assert {x["name"]: x["attributes"]["qkv.model"] for x in steps} == {
        "qkv.ensemble.step.0": "add",
        "qkv.ensemble.step.1": "double",
        "qkv.ensemble.step.2": "negate",
    }
    assert all(x["parentSpanId"] == root["spanId"] and x["traceId"] == root["traceId"] for x in steps)
    assert all(x["attributes"]["qkv.status"] == "OK" for x in steps)
