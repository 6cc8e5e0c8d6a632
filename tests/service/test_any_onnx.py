"""Any ONNX model, served as onnxruntime runs it: string tensors reach the graph as text (UTF-8), and a model
without a batch axis (max_batch_size 0, or fixed first dimensions) is served with the shapes it declares.

Models built here with onnx.helper, served by a real server and called with tritonclient (gRPC, HTTP JSON and
HTTP binary); every answer is compared to onnxruntime run in process on the same input."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service.models.common import has_batch_axis
from service.models.runtime import TensorSpec
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.config import BatchingConfig
from tests.conftest import RunningServer
from tests.service.onnx_models import save_graph, serving

NO_BATCH = ("nobatch", "nobatch_auto")  # [3, 4, 4] -> [10]: max_batch_size 0 in config.json, and none
WIDTH = 16  # Triton's simple_string: two BYTES [batch, 16] inputs of decimal strings
# Encodings a client may use: gRPC, HTTP with JSON data, HTTP with binary data.
ENCODINGS = ("grpc", "http-json", "http-binary")


def _identity(directory: Path) -> None:
    """TEXT BYTES [batch, n] -> OUT, the same strings."""
    x = helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["batch", "n"])
    y = helper.make_tensor_value_info("OUT", TensorProto.STRING, ["batch", "n"])
    save_graph(helper.make_graph([helper.make_node("Identity", ["TEXT"], ["OUT"])], "identity", [x], [y]), directory)


def _simple_string(directory: Path) -> None:
    """Triton's simple_string: INPUT0, INPUT1 decimal strings [batch, 16] -> OUTPUT0 = sum, OUTPUT1 = difference
    (strings), and PLUS1 = INPUT0 + 1 (INT64): the strings parsed as numbers by the graph."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.STRING, ["batch", WIDTH]) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.STRING, ["batch", WIDTH]) for n in ("OUTPUT0", "OUTPUT1")]
    outputs.append(helper.make_tensor_value_info("PLUS1", TensorProto.INT64, ["batch", WIDTH]))
    nodes = [
        helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT64),
        helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT64),
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Sub", ["a", "b"], ["difference"]),
        helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
        helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=TensorProto.STRING),
        helper.make_node("Add", ["a", "one"], ["PLUS1"]),
    ]
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    save_graph(helper.make_graph(nodes, "simple_string", inputs, outputs, [one]), directory)


def _densenet_like(directory: Path, config: dict[str, Any] | None) -> None:
    """x FP32 [3, 4, 4] (an image, no batch axis) -> y FP32 [10]: each channel's mean times a fixed matrix."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [10])
    w = np.random.default_rng(3).standard_normal((3, 10)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["means"], axes=[1, 2], keepdims=0),
        helper.make_node("MatMul", ["means", "w"], ["y"]),
    ]
    weights = helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel().tolist())
    save_graph(helper.make_graph(nodes, "densenet_like", [x], [y], [weights]), directory, config)


def _centred(directory: Path) -> None:
    """x FP32 [n, 4] -> y = x minus its mean over axis 0, max_batch_size 0: axis 0 is the model's own, so
    requests concatenated with others would change each other's answers."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["y"]),
    ]
    save_graph(helper.make_graph(nodes, "centred", [x], [y]), directory, {"max_batch_size": 0, "instances": 1})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("any_onnx") / "models"
    _identity(root / "identity")
    _simple_string(root / "simple_string")
    _densenet_like(root / "nobatch", {"max_batch_size": 0})
    _densenet_like(root / "nobatch_auto", None)
    _centred(root / "centred")
    return root


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    yield from serving(repo)


@pytest.fixture(scope="module")
def local(repo: Path) -> Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """onnxruntime in process on a model of the repository: what the server must answer."""
    sessions: dict[str, ort.InferenceSession] = {}

    def run(model: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if model not in sessions:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            path = str(repo / model / "1" / "model.onnx")
            sessions[model] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        session = sessions[model]
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds), strict=True))

    return run


def _infer(
    served: RunningServer, encoding: str, model: str, inputs: dict[str, np.ndarray], datatypes: dict[str, str]
) -> dict[str, np.ndarray]:
    """Every output of `model` for `inputs`, as the client of `encoding` gives it."""
    if encoding == "grpc":
        with g.InferenceServerClient(served.url) as gc:
            tensors = []
            for name, a in inputs.items():
                t = g.InferInput(name, list(a.shape), datatypes[name])
                t.set_data_from_numpy(a)
                tensors.append(t)
            result = gc.infer(model, tensors)
            names = [o["name"] for o in gc.get_model_metadata(model, as_json=True)["outputs"]]
            return {n: result.as_numpy(n) for n in names}
    binary = encoding == "http-binary"
    with h.InferenceServerClient(served.http_url) as hc:
        hts = []
        for name, a in inputs.items():
            ht = h.InferInput(name, list(a.shape), datatypes[name])
            ht.set_data_from_numpy(a, binary_data=binary)
            hts.append(ht)
        names = [o["name"] for o in hc.get_model_metadata(model)["outputs"]]
        outputs = [h.InferRequestedOutput(n, binary_data=binary) for n in names]
        answer = hc.infer(model, hts, outputs=outputs)
        return {n: answer.as_numpy(n) for n in names}


def _as_bytes(a: np.ndarray) -> list[bytes]:
    """A BYTES answer's elements as bytes (HTTP JSON gives them as str)."""
    return [x if isinstance(x, bytes) else str(x).encode() for x in a.reshape(-1)]


def _refusal(served: RunningServer, encoding: str, model: str, inputs: dict[str, np.ndarray]) -> tuple[str, str]:
    """(status, message) of a request the server must refuse."""
    with pytest.raises(InferenceServerException) as e:
        _infer(served, encoding, model, inputs, dict.fromkeys(inputs, "BYTES"))
    return str(e.value.status()), str(e.value.message())


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_strings_reach_the_graph_as_text_and_come_back_byte_identical(
    served: RunningServer, local: Callable[..., dict[str, np.ndarray]], encoding: str
) -> None:
    words = ["abc", "naïve", "", "日本語 ✓", "b'x'"]
    text = np.array([[w.encode() for w in words]], dtype=np.object_)
    answer = _infer(served, encoding, "identity", {"TEXT": text}, {"TEXT": "BYTES"})["OUT"]
    expected = local("identity", {"TEXT": np.array([words], dtype=np.object_)})["OUT"]
    assert answer.shape == expected.shape == (1, len(words))
    assert _as_bytes(answer) == [w.encode() for w in expected.reshape(-1)] == [w.encode() for w in words]


@pytest.mark.parametrize("encoding", ["grpc", "http-binary"])  # JSON strings cannot carry bytes that are not UTF-8
def test_bytes_that_are_not_utf8_are_refused_naming_the_input_and_element(served: RunningServer, encoding: str) -> None:
    text = np.array([[b"fine", b"bad \xff\xfe", b"also fine"]], dtype=np.object_)
    status, message = _refusal(served, encoding, "identity", {"TEXT": text})
    assert status in ("StatusCode.INVALID_ARGUMENT", "400"), (status, message)
    assert "input 'TEXT' element 1 is not valid UTF-8" in message, message
    # the server goes on answering
    good = np.array([[b"ok"]], dtype=np.object_)
    assert _as_bytes(_infer(served, encoding, "identity", {"TEXT": good}, {"TEXT": "BYTES"})["OUT"]) == [b"ok"]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_graph_that_parses_its_strings_as_numbers_answers_the_right_numbers(
    served: RunningServer, local: Callable[..., dict[str, np.ndarray]], encoding: str
) -> None:
    a = np.arange(2 * WIDTH, dtype=np.int64).reshape(2, WIDTH) * 7 - 20
    b = np.full((2, WIDTH), 3, dtype=np.int64)
    as_text = np.vectorize(lambda v: str(v).encode(), otypes=[np.object_])
    feeds = {"INPUT0": as_text(a), "INPUT1": as_text(b)}
    answer = _infer(served, encoding, "simple_string", feeds, {"INPUT0": "BYTES", "INPUT1": "BYTES"})
    expected = local("simple_string", {k: v.astype(str).astype(np.object_) for k, v in feeds.items()})
    assert _as_bytes(answer["OUTPUT0"]) == [str(v).encode() for v in (a + b).reshape(-1)]
    assert _as_bytes(answer["OUTPUT1"]) == [str(v).encode() for v in (a - b).reshape(-1)]
    for name in ("OUTPUT0", "OUTPUT1"):
        assert answer[name].shape == (2, WIDTH)
        assert _as_bytes(answer[name]) == [x.encode() for x in expected[name].reshape(-1)]
    assert answer["PLUS1"].dtype == np.int64
    np.testing.assert_array_equal(answer["PLUS1"], a + 1)
    np.testing.assert_array_equal(answer["PLUS1"], expected["PLUS1"])


def test_a_string_the_graph_cannot_parse_is_onnxruntimes_error_for_that_request_only(served: RunningServer) -> None:
    bad = np.full((1, WIDTH), b"seven", dtype=np.object_)
    status, message = _refusal(served, "grpc", "simple_string", {"INPUT0": bad, "INPUT1": bad})
    assert status == "StatusCode.INVALID_ARGUMENT"  # it fails alone: its inputs are at fault
    assert "model 'simple_string' cannot run on this request's inputs: " in message, message
    good = np.full((1, WIDTH), b"7", dtype=np.object_)
    answer = _infer(
        served, "grpc", "simple_string", {"INPUT0": good, "INPUT1": good}, dict.fromkeys(("INPUT0", "INPUT1"), "BYTES")
    )
    assert _as_bytes(answer["OUTPUT0"]) == [b"14"] * WIDTH


@pytest.mark.parametrize("model", NO_BATCH)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_model_without_a_batch_axis_answers_its_whole_output(
    served: RunningServer, local: Callable[..., dict[str, np.ndarray]], model: str, encoding: str
) -> None:
    x = np.random.default_rng(7).standard_normal((3, 4, 4)).astype(np.float32)
    answer = _infer(served, encoding, model, {"x": x}, {"x": "FP32"})["y"]
    expected = local(model, {"x": x})["y"]
    assert answer.shape == expected.shape == (10,)
    np.testing.assert_allclose(answer, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model", NO_BATCH)
def test_a_model_without_a_batch_axis_reports_its_declared_shapes(served: RunningServer, model: str) -> None:
    with g.InferenceServerClient(served.url) as gc:
        meta = gc.get_model_metadata(model)
        config = gc.get_model_config(model).config
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [3, 4, 4])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("y", "FP32", [10])]
    assert config.max_batch_size == 0
    assert [list(i.dims) for i in config.input] == [[3, 4, 4]]
    assert [list(o.dims) for o in config.output] == [[10]]
    with h.InferenceServerClient(served.http_url) as hc:
        assert hc.get_model_metadata(model)["outputs"][0]["shape"] == [10]
        assert hc.get_model_config(model).get("max_batch_size", 0) == 0


def test_a_batching_model_still_reports_its_batch_axis(served: RunningServer) -> None:
    with g.InferenceServerClient(served.url) as gc:
        config = gc.get_model_config("simple_string").config
        meta = gc.get_model_metadata("simple_string")
    assert config.max_batch_size > 0 and [list(i.dims) for i in config.input] == [[WIDTH], [WIDTH]]
    assert [list(t.shape) for t in meta.inputs] == [[-1, WIDTH], [-1, WIDTH]]


@pytest.mark.parametrize("model", NO_BATCH)
def test_concurrent_requests_without_a_batch_axis_each_get_their_own_answer(
    served: RunningServer, local: Callable[..., dict[str, np.ndarray]], model: str
) -> None:
    rng = np.random.default_rng(11)
    images = [rng.standard_normal((3, 4, 4)).astype(np.float32) for _ in range(16)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda x: _infer(served, "grpc", model, {"x": x}, {"x": "FP32"})["y"], images))
    for x, answer in zip(images, answers, strict=True):
        assert answer.shape == (10,)
        np.testing.assert_allclose(answer, local(model, {"x": x})["y"], rtol=1e-6, atol=1e-6)


def test_max_batch_size_0_keeps_a_dynamic_first_axis_the_models_own(
    served: RunningServer, local: Callable[..., dict[str, np.ndarray]]
) -> None:
    """Requests of different row counts at once: each is centred on its own rows, never on a batch's."""
    rng = np.random.default_rng(5)
    requests = [rng.standard_normal((rows, 4)).astype(np.float32) * (rows + 1) for rows in (1, 2, 3, 5, 8) * 3]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda x: _infer(served, "grpc", "centred", {"x": x}, {"x": "FP32"})["y"], requests))
    for x, answer in zip(requests, answers, strict=True):
        expected = local("centred", {"x": x})["y"]
        assert answer.shape == x.shape
        np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-5)
    with g.InferenceServerClient(served.url) as gc:
        config = gc.get_model_config("centred").config
        meta = gc.get_model_metadata("centred")
    assert config.max_batch_size == 0 and [list(i.dims) for i in config.input] == [[-1, 4]]
    assert [list(t.shape) for t in meta.inputs] == [[-1, 4]]


def _spec(name: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, "FP32", shape, (None,) * len(shape))


@pytest.mark.parametrize(
    ("given", "specs", "batch_axis"),
    [
        (None, [_spec("x", -1, 3), _spec("y", -1)], True),  # autocomplete: every first dimension dynamic
        (None, [_spec("x", -1, 3), _spec("y", 10)], False),  # one fixed: no batch axis
        (None, [_spec("x"), _spec("y", -1)], False),  # a scalar has no axis 0
        (0, [_spec("x", -1, 3), _spec("y", -1)], False),  # max_batch_size 0: none, whatever the graph
        (8, [_spec("x", -1, 3), _spec("y", -1)], True),
    ],
)
def test_the_batch_axis_is_decided_as_triton_decides_it(
    given: int | None, specs: list[TensorSpec], batch_axis: bool
) -> None:
    batching = BatchingConfig() if given is None else BatchingConfig(max_batch_size=given)
    keys = frozenset() if given is None else frozenset({"max_batch_size"})
    config = ModelConfig("m", "tensor", "1", Path("."), batching=batching, batching_given=keys)
    assert has_batch_axis(config, specs) is batch_axis


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (4, "max_batch_size 4 needs a dynamic batch axis 0 on every input and output, but 'x' has first dimension 3"),
        (-1, "max_batch_size must be >= 0 (0: the model has no batch axis), got -1"),
    ],
)
def test_a_max_batch_size_the_graph_cannot_have_is_refused_at_load(given: int, message: str) -> None:
    config = ModelConfig(
        "m",
        "tensor",
        "1",
        Path("."),
        BatchingConfig(max_batch_size=given),
        batching_given=frozenset({"max_batch_size"}),
    )
    with pytest.raises(RepositoryError) as e:
        has_batch_axis(config, [_spec("x", 3, 4, 4), _spec("y", 10)])
    assert message in str(e.value)
