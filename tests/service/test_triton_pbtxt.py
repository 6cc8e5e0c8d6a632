"""A model directory written for Triton: config.pbtxt (or config.json in Triton's JSON form, or a load
request's config) read field by field, served by a real server, and answered back as the file says.

Models built here with onnx.helper; clients are tritonclient's."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from google.protobuf import json_format, text_format
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service.models.catalog import recognised
from service.repository.layout import RepositoryError, load_model, load_model_config
from tests.conftest import RunningServer, start_server, stop_server

SIMPLE_PBTXT = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest { num_versions: 1 } }
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] label_filename: "labels.txt" },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { count: 3 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
optimization { graph { level: 1 } }
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
parameters { key: "execution_mode" value { string_value: "0" } }
parameters { key: "batching.token_budget" value { string_value: "4096" } }
"""


def _simple_graph(directory: Path, batched: bool = True) -> None:
    """INPUT0, INPUT1 INT32 [batch, 16] -> OUTPUT0 = sum, OUTPUT1 = difference (Triton's `simple`)."""
    shape: list[int | str] = ["batch", 16] if batched else [16]
    a, b = (helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("INPUT0", "INPUT1"))
    s, d = (helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("OUTPUT0", "OUTPUT1"))
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]  # fmt: skip
    model = helper.make_model(
        helper.make_graph(nodes, "simple", [a, b], [s, d]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    (directory / "labels.txt").write_text("\n".join(f"l{i}" for i in range(16)) + "\n")


def _simple(directory: Path, pbtxt: str = SIMPLE_PBTXT) -> None:
    _simple_graph(directory)
    (directory / "config.pbtxt").write_text(pbtxt)


def _triton_json(pbtxt: str) -> dict:  # type: ignore[type-arg]
    message = g.model_config_pb2.ModelConfig()
    text_format.Parse(pbtxt, message)
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[no-any-return]


def test_config_pbtxt_is_read_field_by_field(tmp_path: Path) -> None:
    _simple(tmp_path / "simple")
    c = recognised(load_model_config(tmp_path / "simple"))
    assert c.kind == "tensor" and c.batching.max_batch_size == 8 and "max_batch_size" in c.batching_given
    assert [(d["name"], d["datatype"], d["shape"]) for d in c.inputs] == [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]
    assert c.outputs[0]["labels"][:2] == ("l0", "l1") and c.outputs[0]["label_filename"] == "labels.txt"
    assert c.instances == 3 and c.intra_op_threads == 1 and c.optimization == "extended"
    assert c.batching.max_queue_delay_ms == 0.5 and c.batching.token_budget == 4096
    assert c.session == {"execution_mode": False}
    assert c.triton is not None and c.triton["max_batch_size"] == 8


def test_triton_json_config_and_pbtxt_read_the_same(tmp_path: Path) -> None:
    _simple(tmp_path / "a")
    _simple_graph(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text(json.dumps(_triton_json(SIMPLE_PBTXT)))
    a, b = load_model_config(tmp_path / "a"), load_model_config(tmp_path / "b")
    assert (a.inputs, a.outputs, a.batching, a.instances, a.session, a.triton) == (
        b.inputs,
        b.outputs,
        b.batching,
        b.instances,
        b.session,
        b.triton,
    )
    # and as a load request's config (a parsed JSON object)
    c = load_model_config(tmp_path / "a", raw=_triton_json(SIMPLE_PBTXT))
    assert c.inputs == a.inputs and c.triton == a.triton


def test_both_files_in_one_model_are_refused(tmp_path: Path) -> None:
    _simple(tmp_path / "simple")
    (tmp_path / "simple" / "config.json").write_text("{}")
    with pytest.raises(RepositoryError, match=r"holds both config.pbtxt .* and config.json; keep one"):
        load_model_config(tmp_path / "simple")


def test_without_dynamic_batching_each_request_runs_alone_and_zero_means_no_batch_axis(tmp_path: Path) -> None:
    _simple(tmp_path / "simple", SIMPLE_PBTXT.replace("dynamic_batching { max_queue_delay_microseconds: 500 }", ""))
    assert load_model_config(tmp_path / "simple").batching.enabled is False
    _simple_graph(tmp_path / "flat", batched=False)
    (tmp_path / "flat" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx" max_batch_size: 0\n'
        'input [{ name: "INPUT0" data_type: TYPE_INT32 dims: [16] },\n'
        '       { name: "INPUT1" data_type: TYPE_INT32 dims: [16] }]\n'
    )
    flat = load_model_config(tmp_path / "flat")
    assert flat.batching.max_batch_size == 0 and flat.inputs[0]["shape"] == [16]


def test_qkv_settings_as_parameters(tmp_path: Path) -> None:
    extra = (
        'parameters { key: "sequence_axis" value { string_value: "1" } }\n'
        'parameters { key: "limits" value { string_value: "{\\"max_sequence_length\\": 16}" } }\n'
        'parameters { key: "inter_op_thread_count" value { string_value: "2" } }\n'
    )
    _simple(tmp_path / "simple", SIMPLE_PBTXT + extra)
    c = load_model_config(tmp_path / "simple")
    assert c.sequence_axis == 1 and c.limits == {"max_sequence_length": 16} and c.inter_op_threads == 2
    _simple(tmp_path / "bad", SIMPLE_PBTXT + 'parameters { key: "batching.token_budgt" value { string_value: "1" } }')
    with pytest.raises(RepositoryError, match=r"parameters.batching.token_budgt: unknown; known: .*token_budget"):
        load_model_config(tmp_path / "bad")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('platform: "onnxruntime_onnx"', 'platform: "tensorflow_savedmodel"'),
         "platform: platform 'tensorflow_savedmodel'"),
        (('platform: "onnxruntime_onnx"', 'backend: "python"'), "backend: backend 'python'"),
        (("kind: KIND_CPU", "kind: KIND_GPU"),
         "instance_group[0].kind: KIND_GPU needs onnxruntime's CUDAExecutionProvider"),
        (
            ("optimization { graph { level: 1 } }",
             'optimization { execution_accelerators { cpu_execution_accelerator: [{ name: "openvino" }] } }'),
            "'openvino' runs on onnxruntime's OpenVINOExecutionProvider, which this installation lacks",
        ),
        (("max_batch_size: 8", "max_batch_size: 8 model_transaction_policy { decoupled: true }"),
         "model_transaction_policy.decoupled"),
        (("max_batch_size: 8", 'max_batch_size: 8 batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "X" }]'),
         "batch_input: batch inputs"),
        (("max_batch_size: 8", 'max_batch_size: 8 default_model_filename: "other.onnx"'), "default_model_filename"),
        (("max_batch_size: 8", "max_batch_size: 8 max_batch_sise: 4"), 'no field named "max_batch_sise"'),
    ],
)  # fmt: skip
def test_a_field_qkv_does_not_honour_refuses_the_load_naming_it(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    old, new = change
    assert old in SIMPLE_PBTXT
    _simple(tmp_path / "simple", SIMPLE_PBTXT.replace(old, new, 1))
    with pytest.raises(RepositoryError) as e:
        load_model_config(tmp_path / "simple")
    assert message in str(e.value) and "config.pbtxt" in str(e.value), str(e.value)


def test_fields_left_aside_are_logged_once_naming_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    extra = (
        'metric_tags { key: "team" value: "a" }\n'
        "optimization { input_pinned_memory { enable: true } }\n"
        'parameters { key: "gpu_mem_limit" value { string_value: "1024" } }\n'
    )
    _simple(tmp_path / "simple", SIMPLE_PBTXT.replace("optimization { graph { level: 1 } }", "") + extra)
    with caplog.at_level(logging.WARNING, "qkv.repository"):
        load_model(tmp_path / "simple")
    said = [r.getMessage() for r in caplog.records if "left aside" in r.getMessage()]
    assert len(said) == 1, said
    for name in ("metric_tags", "optimization.input_pinned_memory", "parameters.gpu_mem_limit"):
        assert name in said[0]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton_pbtxt")
    _simple(root / "simple")
    # a model that declares nothing: inputs, outputs and max_batch_size come from the graph
    _simple_graph(root / "bare")
    (root / "bare" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(
        ["--model-repository", str(repository), "--model-control-mode", "explicit", "--load-model", "*"],
        tmp_path_factory.mktemp("server") / "server.log",  # its own: the start reads its ports from it
    )
    yield s
    stop_server(s)


def _infer(module: object, url: str, model: str = "simple") -> None:
    client = module.InferenceServerClient(url)  # type: ignore[attr-defined]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]  # type: ignore[attr-defined]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    answer = client.infer(model, inputs)
    np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(answer.as_numpy("OUTPUT1"), a - b)


def test_a_triton_repository_is_served_and_its_config_read_back_field_by_field(
    server: RunningServer, repository: Path
) -> None:
    for module, url in ((g, server.url), (h, server.http_url)):
        _infer(module, url)
    file = g.model_config_pb2.ModelConfig()
    text_format.Parse(SIMPLE_PBTXT, file)
    answered = g.InferenceServerClient(server.url).get_model_config("simple").config
    # over HTTP: the same config, in Triton's JSON form
    http = json_format.ParseDict(
        h.InferenceServerClient(server.http_url).get_model_config("simple"), g.model_config_pb2.ModelConfig()
    )
    for answer in (answered, http):  # every field the file set reads back as the file has it
        for descriptor, value in file.ListFields():
            assert getattr(answer, descriptor.name) == value, descriptor.name
        assert answer.backend == "onnxruntime" and answer.default_model_filename == "model.onnx"  # auto-completed
    # the classification extension reads the labels file
    client = g.InferenceServerClient(server.url)
    a = g.InferInput("INPUT0", [1, 16], "INT32")
    a.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    b = g.InferInput("INPUT1", [1, 16], "INT32")
    b.set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
    top = client.infer("simple", [a, b], outputs=[g.InferRequestedOutput("OUTPUT0", class_count=1)])
    assert top.as_numpy("OUTPUT0").tolist() == [[b"15:15:l15"]]


def test_what_the_file_omits_is_auto_completed_from_the_graph(server: RunningServer) -> None:
    config = g.InferenceServerClient(server.url).get_model_config("bare").config
    assert [(i.name, list(i.dims)) for i in config.input] == [("INPUT0", [16]), ("INPUT1", [16])]
    assert [o.name for o in config.output] == ["OUTPUT0", "OUTPUT1"] and config.max_batch_size > 0
    assert config.platform == "onnxruntime_onnx" and config.instance_group[0].count >= 1
    _infer(g, server.url, "bare")


def test_a_load_request_carries_a_config_in_triton_json_form(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    config = _triton_json(SIMPLE_PBTXT.replace("count: 3", "count: 1"))
    try:
        client.load_model("simple", config=json.dumps(config))
        assert client.get_model_config("simple").config.instance_group[0].count == 1
        _infer(g, server.url)
        bad = dict(config, platform="pytorch_libtorch")
        with pytest.raises(InferenceServerException, match="platform 'pytorch_libtorch'"):
            client.load_model("simple", config=json.dumps(bad))
    finally:  # a load without a config reads the file again: the module's other tests see the file's config
        client.load_model("simple")
    assert client.get_model_config("simple").config.instance_group[0].count == 3


def test_version_strings_are_refused_in_tritons_words(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("simple", model_version="abc")
    assert "failed to get model version from specified version string 'abc'" in e.value.message()
    assert "INVALID_ARGUMENT" in str(e.value.status())
    with pytest.raises(InferenceServerException, match="invalid model version specified '-2'"):
        client.get_model_metadata("simple", model_version="-2")
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'simple' version '7' is not found"):
        client.get_model_metadata("simple", model_version="7")


def test_sequence_settings_qkv_reads_but_does_not_use_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(
        "max_batch_size: 4\n"
        "sequence_batching { oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] }\n"
        '  state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_INT32 dims: [ 1 ]\n'
        "            use_growable_memory: true } ] }\n"
    )
    with caplog.at_level(logging.WARNING, "qkv.repository"):
        config = load_model_config(tmp_path / "m")
    assert config.sequence_batching is not None and config.sequence_batching.strategy == "oldest"
    for name in ("oldest.max_candidate_sequences", "oldest.preferred_batch_size", "state[0].use_growable_memory"):
        assert f"sequence_batching.{name}" in caplog.text
