"""Fields of Triton's config.pbtxt honoured on a real server: version_policy, ensemble_scheduling,
response_cache, model_warmup (zero, random and input_data_file samples, run before ready), the onnxruntime
backend's parameters, instance_group's count."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as g
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service.models.runtime import TensorRuntime
from service.repository.layout import load_model_config
from tests.conftest import RunningServer, start_server, stop_server
from tests.service.test_triton_pbtxt import SIMPLE_PBTXT, _simple, _simple_graph

WARMUP = """
model_warmup [
  { name: "zeros" batch_size: 2 inputs { key: "INPUT0" value { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } }
                                inputs { key: "INPUT1" value { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } } },
  { name: "random" count: 2 inputs { key: "INPUT0" value { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
                            inputs { key: "INPUT1" value { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } } },
  { name: "file" inputs { key: "INPUT0" value { data_type: TYPE_INT32 dims: [ 16 ] input_data_file: "ones" } }
                 inputs { key: "INPUT1" value { data_type: TYPE_INT32 dims: [ 16 ] input_data_file: "ones" } } }
]
"""
ENSEMBLE = """
name: "twice"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    { model_name: "simple" model_version: -1
      input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "S" } },
    { model_name: "simple" model_version: -1
      input_map { key: "INPUT0" value: "S" } input_map { key: "INPUT1" value: "S" }
      output_map { key: "OUTPUT0" value: "SUM" } }
  ]
}
"""


def _optional_model(directory: Path) -> None:
    """Y = X + B, X and B FP32 [batch, 2]; B optional: the graph's initializer [10, 20] when left out."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 2])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, ["batch", 2])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 2])
    default = helper.make_tensor("B", TensorProto.FLOAT, [1, 2], [10.0, 20.0])
    graph = helper.make_graph([helper.make_node("Add", ["X", "B"], ["Y"])], "opt", [x, b], [y], [default])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    (directory / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx" max_batch_size: 4 dynamic_batching { }\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] },\n'
        '        { name: "B" data_type: TYPE_FP32 dims: [ 2 ] optional: true } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton_fields")
    pbtxt = SIMPLE_PBTXT.replace("latest { num_versions: 1 }", "all { }") + WARMUP + "response_cache { enable: true }\n"
    _simple(root / "simple", pbtxt)
    (root / "simple" / "2").mkdir()
    (root / "simple" / "2" / "model.onnx").write_bytes((root / "simple" / "1" / "model.onnx").read_bytes())
    (root / "simple" / "warmup").mkdir()
    (root / "simple" / "warmup" / "ones").write_bytes(struct.pack("<16i", *([1] * 16)))
    _optional_model(root / "opt")
    (root / "twice" / "1").mkdir(parents=True)
    (root / "twice" / "config.pbtxt").write_text(ENSEMBLE)
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(
        ["--model-repository", str(repository), "--model-control-mode", "explicit", "--load-model", "*"],
        tmp_path_factory.mktemp("server") / "server.log",  # its own: the start reads its ports from it
    )
    yield s
    stop_server(s)


def _inputs(a: np.ndarray, b: np.ndarray, names: tuple[str, str] = ("INPUT0", "INPUT1")) -> list[g.InferInput]:
    out = []
    for name, x in zip(names, (a, b), strict=True):
        t = g.InferInput(name, list(x.shape), "INT32")
        t.set_data_from_numpy(x)
        out.append(t)
    return out


def test_version_policy_all_serves_every_version(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    assert list(client.get_model_metadata("simple").versions) == ["1", "2"]
    a = np.ones((1, 16), np.int32)
    assert (client.infer("simple", _inputs(a, a), model_version="1").as_numpy("OUTPUT0") == 2).all()


def test_warmup_samples_ran_on_every_instance_before_ready(server: RunningServer) -> None:
    # zeros once, random twice, file once; three instances (instance_group count 3); versions 1 and 2; all
    # before the model first serves (a later test may load it again, warming it up again)
    before_ready = server.output().split("model 'simple': serving version(s)")[0]
    assert before_ready.count("12 warm-up run(s) of the config's model_warmup samples") == 2


def test_a_warmup_sample_that_cannot_run_stops_the_load_naming_it(server: RunningServer, repository: Path) -> None:
    client = g.InferenceServerClient(server.url)
    config = (repository / "simple" / "config.pbtxt").read_text()
    try:
        (repository / "simple" / "config.pbtxt").write_text(
            config.replace('input_data_file: "ones"', 'input_data_file: "none"', 1)
        )
        with pytest.raises(InferenceServerException) as e:
            client.load_model("simple")
        assert "model_warmup 'file' input 'INPUT0': cannot read input_data_file none" in e.value.message()
    finally:
        (repository / "simple" / "config.pbtxt").write_text(config)
        client.load_model("simple")


def test_an_ensemble_in_config_pbtxt_runs_its_steps(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    a, b = np.arange(16, dtype=np.int32).reshape(1, 16), np.ones((1, 16), np.int32)
    answer = client.infer("twice", _inputs(a, b, ("A", "B")))
    np.testing.assert_array_equal(answer.as_numpy("SUM"), 2 * (a + b))
    assert client.get_model_config("twice").config.platform == "ensemble"


def test_response_cache_enable_keeps_answers(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)

    def counts() -> tuple[int, int]:
        stats = client.get_inference_statistics("simple", "2").model_stats[0].inference_stats
        return stats.cache_hit.count, stats.cache_miss.count

    before = counts()
    a = np.full((1, 16), 7, np.int32)
    for _ in range(2):
        client.infer("simple", _inputs(a, a), model_version="2")
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_onnxruntime_backend_parameters_and_instance_count_reach_the_sessions(tmp_path: Path) -> None:
    extra = (
        'parameters { key: "execution_mode" value { string_value: "1" } }\n'
        'parameters { key: "enable_mem_arena" value { string_value: "0" } }\n'
        'parameters { key: "inter_op_thread_count" value { string_value: "2" } }\n'
    )
    _simple(
        tmp_path / "simple",
        SIMPLE_PBTXT.replace('parameters { key: "execution_mode" value { string_value: "0" } }\n', "") + extra,
    )
    runtime = TensorRuntime(load_model_config(tmp_path / "simple"), ["CPUExecutionProvider"])
    assert len(runtime.sessions) == 3
    options = runtime.sessions[0].get_session_options()
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert options.enable_cpu_mem_arena is False and options.inter_op_num_threads == 2
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # graph level 1


def test_a_model_with_no_config_at_all_still_loads(tmp_path: Path) -> None:
    _simple_graph(tmp_path / "bare")
    assert load_model_config(tmp_path / "bare").triton is None


def test_an_optional_input_may_be_left_out(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    x = np.array([[1, 2]], np.float32)
    given = [g.InferInput("X", [1, 2], "FP32"), g.InferInput("B", [1, 2], "FP32")]
    given[0].set_data_from_numpy(x)
    given[1].set_data_from_numpy(x)
    assert client.infer("opt", given).as_numpy("Y").tolist() == [[2, 4]]
    assert client.infer("opt", given[:1]).as_numpy("Y").tolist() == [[11, 22]]  # the graph's default
    assert client.get_model_config("opt").config.input[1].optional
    with pytest.raises(InferenceServerException, match="missing input 'X'"):
        client.infer("opt", given[1:])
