"""Warm-up that fits the model: inputs read from the graph (a zero-length past, masks of ones, position ids);
a model whose warm-up still fails stops the start (--exit-on-error, Triton's default) or, with
--exit-on-error=false, is UNAVAILABLE with its reason while the others serve; --strict-readiness decides
whether the server is then ready."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from onnx import TensorProto, helper

from service.models.runtime import TensorSpec
from service.models.warmup import dimension, graph_feeds
from service.tools.client import health_check
from tests.conftest import ROOT, RunningServer, scale_model, start_server, stop_server
from tests.service.onnx_models import save

HEADS, HEAD = 2, 4


def decoder_with_past(directory: Path) -> None:
    """A decoder step as optimum exports GPT-2 with past: input_ids and position_ids [batch_size,
    sequence_length], attention_mask [batch_size, past_sequence_length + sequence_length], and
    past_key_values.0.key [batch_size, HEADS, past_sequence_length, HEAD] -> logits and present.0.key (past and
    new keys concatenated). The mask must span the present keys (past and new), or the graph fails."""
    past = "past_sequence_length"
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
    positions = helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                         ["batch_size", f"{past} + sequence_length"])  # fmt: skip
    key = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch_size", HEADS, past, HEAD])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", 8])
    present = helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT,
                                            ["batch_size", HEADS, f"{past} + sequence_length", HEAD])  # fmt: skip
    table = np.random.default_rng(2).standard_normal((8, HEADS * HEAD)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["tokens"]),  # [b, s, HEADS*HEAD]
        helper.make_node("Gather", ["table", "position_ids"], ["places"]),
        helper.make_node("Add", ["tokens", "places"], ["embedded"]),
        helper.make_node("Reshape", ["embedded", "split_heads"], ["heads"]),  # [b, s, HEADS, HEAD]
        helper.make_node("Transpose", ["heads"], ["new_key"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["past_key_values.0.key", "new_key"], ["present.0.key"], axis=2),
        helper.make_node("ReduceSum", ["present.0.key", "over_heads"], ["per_position"], keepdims=0),  # [b, p+s]
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["per_position", "mask_f"], ["masked"]),  # fails unless the mask spans past + new
        helper.make_node("ReduceSum", ["masked", "last"], ["context"], keepdims=1),  # [b, 1]
        helper.make_node("MatMul", ["embedded", "out"], ["scores"]),  # [b, s, 8]
        helper.make_node("Unsqueeze", ["context", "last"], ["context3"]),
        helper.make_node("Add", ["scores", "context3"], ["logits"]),
    ]
    inits = [
        helper.make_tensor("table", TensorProto.FLOAT, table.shape, table.ravel().tolist()),
        helper.make_tensor("split_heads", TensorProto.INT64, [4], [0, -1, HEADS, HEAD]),
        helper.make_tensor("over_heads", TensorProto.INT64, [2], [1, 3]),
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("out", TensorProto.FLOAT, [HEADS * HEAD, 8], [0.1] * (HEADS * HEAD * 8)),
    ]
    save(nodes, "decoder_with_past", [ids, positions, mask, key], [logits, present], inits, directory)


def unrunnable(directory: Path) -> None:
    """x FP32 [batch, n] reshaped to [7, 3]: no input read from the graph fits, so its warm-up fails."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 3])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [7, 3])
    save([helper.make_node("Reshape", ["x", "shape"], ["y"])], "unrunnable", [x], [y], [shape], directory)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("warmup") / "models"
    decoder_with_past(root / "decoder")
    unrunnable(root / "broken")
    scale_model(root / "scale")
    return root


@pytest.fixture(scope="module")
def tolerant(repo: Path) -> Iterator[RunningServer]:
    """--exit-on-error=false, Triton's spelling, and the default --strict-readiness."""
    s = start_server(["--model-repository", str(repo), "--exit-on-error=false"], repo.parent / "tolerant.log")
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


def test_dimensions_are_sized_from_their_names() -> None:
    sequence = frozenset({"sequence_length"})
    assert dimension("past_sequence_length", 9, sequence) == 0
    assert dimension("past_sequence_length + sequence_length", 9, sequence) == 9
    assert dimension("past_sequence_length + sequence_length", 9, frozenset()) == 1
    assert dimension("encoder_sequence_length_out", 9, sequence) == 1
    assert dimension("past_decoder_sequence_length + 1", 9, sequence) == 1
    assert dimension(None, 9, sequence) == 1
    specs = [
        TensorSpec("input_ids", "INT64", (-1, -1), ("batch", "sequence_length")),
        TensorSpec("attention_mask", "INT64", (-1, -1), ("batch", "sequence_length")),
        TensorSpec("position_ids", "INT64", (-1, -1), ("batch", "sequence_length")),
        TensorSpec("token_type_ids", "INT64", (-1, -1), ("batch", "sequence_length")),
        TensorSpec("use_cache_branch", "BOOL", (1,), (None,)),
        TensorSpec("pixel_values", "FP32", (-1, 3), ("batch", None)),
    ]
    feeds = graph_feeds(specs, 2, 5, True, sequence, {"input_ids": 3})
    assert feeds["input_ids"].shape == (2, 5) and feeds["input_ids"].min() >= 1 and feeds["input_ids"].max() < 3
    assert (feeds["attention_mask"] == 1).all()
    assert feeds["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    assert (feeds["token_type_ids"] == 0).all()
    assert not feeds["use_cache_branch"].any()
    assert feeds["pixel_values"].shape == (2, 3) and np.abs(feeds["pixel_values"]).max() < 1
    plain = graph_feeds(specs, 1, 5, True, sequence, seed=None)
    assert (plain["input_ids"] == 0).all() and (plain["pixel_values"] == 0).all()


def test_a_decoder_with_past_warms_up_and_serves_and_a_broken_model_is_unavailable_with_its_reason(
    tolerant: RunningServer,
) -> None:
    log = tolerant.output()
    assert (
        "model 'broken' is UNAVAILABLE: model 'broken' version 1: warm-up failed on inputs read from the graph" in log
    )
    assert "UNAVAILABLE: broken" in log  # the ready line names it
    with g.InferenceServerClient(tolerant.url) as client:
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["broken"].state == "UNAVAILABLE"
        assert "warm-up failed" in index["broken"].reason and "Reshape" in index["broken"].reason
        assert index["decoder"].state == "READY" and index["scale"].state == "READY"
        ids = np.array([[3, 1, 4]], dtype=np.int64)
        inputs = {
            "input_ids": ids,
            "position_ids": np.arange(3, dtype=np.int64)[None],
            "attention_mask": np.ones((1, 3), dtype=np.int64),
            "past_key_values.0.key": np.zeros((1, HEADS, 0, HEAD), dtype=np.float32),
        }
        tensors = []
        for name, a in inputs.items():
            t = g.InferInput(name, list(a.shape), "INT64" if a.dtype == np.int64 else "FP32")
            t.set_data_from_numpy(a)
            tensors.append(t)
        answer = client.infer("decoder", tensors)
        assert answer.as_numpy("logits").shape == (1, 3, 8)
        assert answer.as_numpy("present.0.key").shape == (1, HEADS, 3, HEAD)
        x = g.InferInput("x", [1, 3], "FP32")
        x.set_data_from_numpy(np.ones((1, 3), dtype=np.float32))
        assert client.infer("scale", [x]).as_numpy("y").tolist() == [[1.0, 2.0, 3.0]]
        assert not client.is_server_ready(), "--strict-readiness: not ready while a model is unavailable"
        assert client.is_server_live()
        assert client.is_model_ready("scale") and not client.is_model_ready("broken")
    with h.InferenceServerClient(tolerant.http_url) as http:
        assert not http.is_server_ready()
    assert health_check(tolerant.url, "") == "NOT_SERVING"  # the whole server, as ServerReady
    assert health_check(tolerant.url, "scale") == "SERVING"


def test_without_strict_readiness_the_server_is_ready_beside_an_unavailable_model(repo: Path, tmp_path: Path) -> None:
    args = ["--model-repository", str(repo), "--no-exit-on-error", "--strict-readiness=false"]
    with start_server(args, tmp_path / "loose.log") as s, g.InferenceServerClient(s.url) as client:
        assert client.is_server_ready()
        assert not client.is_model_ready("broken")
        assert health_check(s.url, "") == "SERVING"


def test_by_default_a_model_that_cannot_warm_up_stops_the_start(repo: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--model-repository", str(repo), "--host", "127.0.0.1",
         "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "model 'broken' version 1: warm-up failed" in done.stderr
