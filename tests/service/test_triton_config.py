"""The model configuration Triton users write: `reshape` (the client's shape versus the graph's), an input's
`format`, an output's `label_filename`, and the classification extension's ranking.

Models built here with onnx.helper and served by a real server; answers compared with onnxruntime in process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as g
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service.errors import InvalidArgument
from service.models.classification import MAX_CLASS_COUNT, classify
from service.repository.layout import MAX_LABELS_BYTES, RepositoryError, load_model_config
from tests.conftest import RunningServer, start_server, stop_server


def _save(directory: Path, graph: onnx.GraphProto, config: dict[str, Any]) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    (directory / "config.json").write_text(json.dumps(config))


def _flat_sum(directory: Path) -> None:
    """X FP32 [batch, 4] -> Y = X * 2 [batch, 4], S = sum over the row [batch, 1]; clients see X and Y as
    [batch, 2, 2] (reshape), S as it is."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])
    s = helper.make_tensor_value_info("S", TensorProto.FLOAT, ["batch", 1])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("Mul", ["X", "two"], ["Y"]), helper.make_node("ReduceSum", ["X", "axis"], ["S"])]
    config = {
        "max_batch_size": 8,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 2, 2], "reshape": {"shape": [-1, 4]},
                    "format": "FORMAT_NONE"}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 2, 2], "reshape": {"shape": [-1, 4]}},
                    {"name": "S", "datatype": "FP32", "shape": [-1, 1], "label_filename": "labels.txt"}],
    }  # fmt: skip
    _save(directory, helper.make_graph(nodes, "flat_sum", [x], [y, s], initializer=[two, axis]), config)
    (directory / "labels.txt").write_text("total\n")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton_config")
    _flat_sum(root / "flat_sum")
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[RunningServer]:
    s = start_server(["--model-repository", str(repository)], repository.parent / "server.log")
    yield s
    stop_server(s)


def test_reshape_clients_send_and_get_the_declared_shape(server: RunningServer, repository: Path) -> None:
    client = g.InferenceServerClient(server.url)
    meta = client.get_model_metadata("flat_sum")
    assert {t.name: list(t.shape) for t in meta.inputs} == {"X": [-1, 2, 2]}
    assert {t.name: list(t.shape) for t in meta.outputs} == {"Y": [-1, 2, 2], "S": [-1, 1]}
    x = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    t = g.InferInput("X", list(x.shape), "FP32")
    t.set_data_from_numpy(x)
    answer = client.infer("flat_sum", [t])
    graph = ort.InferenceSession(str(repository / "flat_sum" / "1" / "model.onnx"))
    y, s = graph.run(["Y", "S"], {"X": x.reshape(3, 4)})
    np.testing.assert_array_equal(answer.as_numpy("Y"), y.reshape(3, 2, 2))
    np.testing.assert_array_equal(answer.as_numpy("S"), s)
    # a shape that the declared one does not allow is refused, naming the input
    bad = g.InferInput("X", [3, 4], "FP32")
    bad.set_data_from_numpy(x.reshape(3, 4))
    with pytest.raises(InferenceServerException) as e:
        client.infer("flat_sum", [bad])
    assert "X" in e.value.message() and "INVALID_ARGUMENT" in str(e.value.status())


def test_format_reshape_and_labels_are_read_and_checked(tmp_path: Path) -> None:
    _flat_sum(tmp_path / "flat_sum")
    config = load_model_config(tmp_path / "flat_sum")
    assert config.inputs[0]["format"] == "FORMAT_NONE" and config.inputs[0]["reshape"] == [-1, 4]
    assert config.outputs[1]["labels"] == ("total",)
    raw = json.loads((tmp_path / "flat_sum" / "config.json").read_text())
    cases = [
        (("inputs", 0, "format", "FORMAT_NCWH"), "inputs[0].format must be one of FORMAT_NONE, FORMAT_NCHW"),
        (("inputs", 0, "reshape", [4]), 'inputs[0].reshape must be {"shape": [...]}'),
        (("outputs", 0, "format", "FORMAT_NCHW"), "outputs[0]: unknown setting(s) ['format']"),
        (("outputs", 1, "label_filename", "missing.txt"), "outputs[1].label_filename: cannot read missing.txt"),
        (("outputs", 1, "label_filename", "../../etc/passwd"), "must name a file in the model's directory"),
    ]
    for (section, i, key, value), message in cases:
        changed = json.loads(json.dumps(raw))
        changed[section][i][key] = value
        with pytest.raises(RepositoryError) as e:
            load_model_config(tmp_path / "flat_sum", raw=changed)
        assert message in str(e.value), str(e.value)
    big = tmp_path / "flat_sum" / "labels.txt"
    with big.open("wb") as f:
        f.truncate(MAX_LABELS_BYTES + 1)
    with pytest.raises(RepositoryError) as e:
        load_model_config(tmp_path / "flat_sum")
    assert "the limit is" in str(e.value)


def test_classification_ranks_by_value_highest_first_ties_by_index() -> None:
    scores = np.array([[1, 5, 10, 4], [7, 7, 0, 7]], dtype=np.float32)
    assert classify(scores, 2, ("a", "b", "c", "d"), True, "P").tolist() == [
        [b"10.000000:2:c", b"5.000000:1:b"],
        [b"7.000000:0:a", b"7.000000:1:b"],
    ]
    # unbatched: every element of the tensor is a class (a [4, 1, 1] output is 4 classes); integers as they are
    assert classify(np.array([[[3]], [[9]], [[1]], [[4]]], np.int32), 3, (), False, "P").tolist() == [
        b"9:1",
        b"4:3",
        b"3:0",
    ]
    assert classify(scores, 10, (), True, "P").shape == (2, 4)  # at most as many classes as there are
    for bad, count in ((np.array(["x"], dtype=np.object_), 1), (scores, 0)):
        with pytest.raises(InvalidArgument):
            classify(bad, count, (), True, "P")


def test_classification_picks_what_a_full_sort_picks_and_clamps_the_count() -> None:
    """The partial top k is the full stable sort's first k, ties and NaN included; a count above
    MAX_CLASS_COUNT answers MAX_CLASS_COUNT classes a row."""
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.int64):
        scores = rng.integers(-5, 5, (6, 40)).astype(dtype)  # many ties
        if dtype == np.float32:
            scores[1, 3:9] = np.nan
        for k in (1, 7, 39, 40):
            expected = [
                [
                    f"{float(v):f}" if dtype == np.float32 else str(v)
                    for v in row[np.argsort(-np.nan_to_num(row.astype(np.float64), nan=-np.inf), kind="stable")[:k]]
                ]
                for row in scores
            ]
            got = [[x.decode().split(":")[0] for x in row] for row in classify(scores, k, (), True, "P")]
            assert got == expected, (dtype, k)
            indices = [[int(x.decode().split(":")[1]) for x in row] for row in classify(scores, k, (), True, "P")]
            keys = -np.nan_to_num(scores.astype(np.float64), nan=-np.inf)
            assert indices == np.argsort(keys, axis=1, kind="stable")[:, :k].tolist(), (dtype, k)
    wide = rng.standard_normal((2, 5000)).astype(np.float32)
    top = classify(wide, 10**9, (), True, "P")
    assert top.shape == (2, MAX_CLASS_COUNT)
    assert int(top[0, 0].decode().split(":")[1]) == int(np.argmax(wide[0]))


def test_classification_over_grpc_and_http_with_labels_and_the_config_triton_clients_read(
    server: RunningServer,
) -> None:
    """An output asked for with `class_count` comes back as its top classes, labelled from label_filename;
    the model's configuration shows the format, the reshape and the labels file as Triton's does."""
    import tritonclient.http as h

    x = np.array([[[1, 2], [3, 4]], [[-1, -2], [-3, -4]]], dtype=np.float32)
    for module, url in ((g, server.url), (h, server.http_url)):
        client = module.InferenceServerClient(url)
        t = module.InferInput("X", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        answer = client.infer("flat_sum", [t], outputs=[module.InferRequestedOutput("S", class_count=1)])
        assert answer.as_numpy("S").tolist() == [[b"10.000000:0:total"], [b"-10.000000:0:total"]], module
        with pytest.raises(InferenceServerException):  # a class count that is not a positive integer
            client.infer("flat_sum", [t], outputs=[module.InferRequestedOutput("S", class_count=-1)])
    config = g.InferenceServerClient(server.url).get_model_config("flat_sum").config
    assert g.model_config_pb2.ModelInput.Format.Name(config.input[0].format) == "FORMAT_NONE"
    assert list(config.input[0].dims) == [2, 2] and list(config.input[0].reshape.shape) == [4]
    assert config.output[1].label_filename == "labels.txt"
    assert "classification" in g.InferenceServerClient(server.url).get_server_metadata().extensions
