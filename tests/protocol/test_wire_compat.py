"""Our protocol is wire-identical to tritonclient's, and the two live in one process.

tritonclient ships the ``_pb2`` modules Triton generated from its own .proto files; they are
the reference: every message, field and RPC of ours must have the same number, type and label
there, messages must cross between the two unchanged, and a real tritonclient must talk to a
server built on ``service.protocol``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from service import protocol

ROOT = Path(__file__).resolve().parents[2]
OUR_FILES = [protocol.POOL.FindFileByName(name) for name in ("model_config.proto", "grpc_service.proto")]
TRITON_POOL = service_pb2.DESCRIPTOR.pool
# tritonclient's messages under one roof, like ours: (service|model_config)_pb2.Name -> TRITON.Name
TRITON = SimpleNamespace(**{**vars(model_config_pb2), **vars(service_pb2)})


def _walk(messages: Any) -> Iterator[Descriptor]:
    for message in messages:
        yield message
        yield from _walk(message.nested_types)  # includes map entries (e.g. ParametersEntry)


def _our_messages() -> list[Descriptor]:
    return [message for file in OUR_FILES for message in _walk(file.message_types_by_name.values())]


def _our_enums() -> list[EnumDescriptor]:
    top = [enum for file in OUR_FILES for enum in file.enum_types_by_name.values()]
    return top + [enum for message in _our_messages() for enum in message.enum_types]


def _type_name(field: FieldDescriptor) -> str | None:
    if field.message_type is not None:
        return str(field.message_type.full_name)
    if field.enum_type is not None:
        return str(field.enum_type.full_name)
    return None


def _as_dict(message: Message) -> dict[str, Any]:
    # JSON ignores unknown fields, so a field one side lacks shows up as a difference here
    # (byte equality alone would not notice: unknown fields are re-serialised verbatim).
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _assert_same_message(ours: Message, theirs: Message) -> None:
    assert _as_dict(ours) == _as_dict(theirs)
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)


# --- descriptors ---------------------------------------------------------------------------


def test_our_pool_is_private() -> None:
    ours = protocol.POOL.FindMessageTypeByName("inference.ModelInferRequest")
    assert ours is not TRITON_POOL.FindMessageTypeByName("inference.ModelInferRequest")
    assert protocol.ModelInferRequest.DESCRIPTOR is ours


@pytest.mark.parametrize("message", _our_messages(), ids=lambda message: message.full_name)
def test_message_fields_match_tritonclient(message: Descriptor) -> None:
    theirs = TRITON_POOL.FindMessageTypeByName(message.full_name)
    assert message.GetOptions().map_entry == theirs.GetOptions().map_entry
    for field in message.fields:
        assert field.name in theirs.fields_by_name, f"{message.full_name}.{field.name} is not Triton's"
        reference = theirs.fields_by_name[field.name]
        assert field.number == reference.number, field.full_name
        assert field.type == reference.type, field.full_name
        assert field.is_repeated == reference.is_repeated, field.full_name
        assert field.has_presence == reference.has_presence, field.full_name
        assert _type_name(field) == _type_name(reference), field.full_name


@pytest.mark.parametrize("enum", _our_enums(), ids=lambda enum: enum.full_name)
def test_enum_values_match_tritonclient(enum: EnumDescriptor) -> None:
    theirs = TRITON_POOL.FindEnumTypeByName(enum.full_name)
    assert {value.name: value.number for value in enum.values} == {
        value.name: value.number for value in theirs.values if value.name in enum.values_by_name
    }
    assert set(enum.values_by_name) <= set(theirs.values_by_name)


def test_data_type_enum_matches_proto() -> None:
    enum = protocol.POOL.FindEnumTypeByName("inference.DataType")
    assert {member.name: member.value for member in protocol.DataType} == {v.name: v.number for v in enum.values}
    assert len(protocol.DataType) == len(model_config_pb2.DataType.values())


def test_rpcs_match_tritonclient() -> None:
    theirs = TRITON_POOL.FindServiceByName(protocol.SERVICE_NAME)
    assert protocol.SERVICE.full_name == protocol.SERVICE_NAME
    for method in protocol.SERVICE.methods:
        reference = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == reference.input_type.full_name, method.name
        assert method.output_type.full_name == reference.output_type.full_name, method.name
        assert (method.client_streaming, method.server_streaming) == (
            reference.client_streaming,
            reference.server_streaming,
        )
    expected = {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"}
    assert expected | {"ModelConfig", "ModelStatistics"} <= set(protocol.SERVICE.methods_by_name)


def test_stub_declares_every_rpc() -> None:
    assert list(protocol.Stub.__annotations__) == [method.name for method in protocol.SERVICE.methods]


def test_message_class_names() -> None:
    assert protocol.message_class("inference.ModelInferRequest") is protocol.ModelInferRequest
    nested = protocol.message_class("ModelInferRequest.InferInputTensor")
    assert nested.DESCRIPTOR.full_name == "inference.ModelInferRequest.InferInputTensor"
    assert protocol.message_class("grpc.health.v1.HealthCheckRequest").DESCRIPTOR.file.pool is protocol.POOL
    with pytest.raises(KeyError, match="NoSuchMessage"):
        protocol.message_class("NoSuchMessage")
    not_messages = {
        "POOL",
        "SERVICE",
        "SERVICE_NAME",
        "ORCA_SERVICE",
        "ORCA_SERVICE_NAME",
        "DataType",
        "Stub",
        "Message",
    }
    orca = {"OrcaLoadReport": "xds.data.orca.v3", "OrcaLoadReportRequest": "xds.service.orca.v3"}
    for name in protocol.__all__:
        if name[0].isupper() and name not in not_messages | {"Undecodable"}:
            package = orca.get(name, "inference")
            assert getattr(protocol, name).DESCRIPTOR.full_name == f"{package}.{name}"


def test_import_pulls_in_neither_torch_nor_tritonclient() -> None:
    code = (
        "import sys, service.protocol; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'tritonclient'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --- messages crossing between the two -----------------------------------------------------


def _set_parameters(parameters: Any) -> None:
    parameters["sequence_start"].bool_param = True
    parameters["offset"].int64_param = -(2**40)
    parameters["note"].string_param = "prononciation é"
    parameters["ratio"].double_param = 0.25
    parameters["priority"].uint64_param = 2**63 + 1


TYPED = {
    "bool_contents": ("BOOL", [True, False, True]),
    "int_contents": ("INT32", [-(2**31), 0, 7]),
    "int64_contents": ("INT64", [-(2**62), 0, 2**40]),
    "uint_contents": ("UINT32", [0, 2**32 - 1, 3]),
    "uint64_contents": ("UINT64", [0, 2**64 - 1, 3]),
    "fp32_contents": ("FP32", [0.5, -1.25, 3.0]),
    "fp64_contents": ("FP64", [1e-300, -2.5, 1e300]),
    "bytes_contents": ("BYTES", [b"attention", "transformér".encode(), b""]),
}


def _typed_request(module: Any) -> Message:
    request = module.ModelInferRequest(model_name="g2p", model_version="1", id="req-7")
    _set_parameters(request.parameters)
    for field, (datatype, values) in TYPED.items():
        tensor = request.inputs.add(name=field.upper(), datatype=datatype, shape=[1, len(values)])
        getattr(tensor.contents, field).extend(values)
        tensor.parameters["binary_data_size"].int64_param = 0
    output = request.outputs.add(name="PHONEMES")
    output.parameters["binary_data"].bool_param = True
    request.outputs.add(name="ATTENTION")
    return request


def _raw_request(module: Any) -> Message:
    request = module.ModelInferRequest(model_name="g2p_encoder", id="raw")
    _set_parameters(request.parameters)
    text = np.array([b"attention", "naïve".encode(), b"a b c"], dtype=np.object_)
    ids = np.arange(12, dtype=np.int64).reshape(2, 6) - 3
    request.inputs.add(name="TEXT", datatype="BYTES", shape=list(text.shape))
    request.raw_input_contents.append(serialize_byte_tensor(text).item())
    request.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    request.raw_input_contents.append(ids.tobytes())
    _set_parameters(request.inputs[1].parameters)
    return request


@pytest.mark.parametrize("build", [_typed_request, _raw_request], ids=["typed", "raw"])
def test_infer_request_from_tritonclient_parses_with_ours(build: Callable[[Any], Message]) -> None:
    theirs = build(TRITON)
    ours = protocol.ModelInferRequest.FromString(theirs.SerializeToString())
    _assert_same_message(ours, theirs)
    _assert_same_message(ours, build(protocol))
    assert ours.parameters["priority"].uint64_param == 2**63 + 1
    assert ours.parameters["note"].WhichOneof("parameter_choice") == "string_param"


def test_raw_bytes_tensor_decodes() -> None:
    ours = protocol.ModelInferRequest.FromString(_raw_request(TRITON).SerializeToString())
    assert [tensor.name for tensor in ours.inputs] == ["TEXT", "input_ids"]
    text = deserialize_bytes_tensor(ours.raw_input_contents[0])
    assert [item.decode() for item in text] == ["attention", "naïve", "a b c"]
    ids = np.frombuffer(ours.raw_input_contents[1], dtype=np.int64).reshape(tuple(ours.inputs[1].shape))
    assert ids[1, 5] == 8


def _infer_response(module: Any) -> Message:
    response = module.ModelInferResponse(model_name="g2p", model_version="1", id="req-7")
    _set_parameters(response.parameters)
    phonemes = np.array([b"AH0 T EH1 N SH AH0 N"], dtype=np.object_)
    response.outputs.add(name="PHONEMES", datatype="BYTES", shape=[1])
    response.raw_output_contents.append(serialize_byte_tensor(phonemes).item())
    attention = response.outputs.add(name="ATTENTION", datatype="FP32", shape=[1, 2])
    attention.contents.fp32_contents.extend([0.75, 0.25])
    attention.parameters["binary_data"].bool_param = False
    return response


def _model_config_response(module: Any) -> Message:
    config = module.ModelConfig(name="g2p", platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=64)
    config.input.add(name="TEXT", data_type=module.DataType.TYPE_STRING, dims=[-1])
    config.output.add(name="PHONEMES", data_type=module.DataType.TYPE_STRING, dims=[-1])
    config.output.add(name="ATTENTION", data_type=module.DataType.TYPE_FP32, dims=[-1, -1, -1])
    config.dynamic_batching.preferred_batch_size.extend([16, 32])
    config.dynamic_batching.max_queue_delay_microseconds = 2_000
    config.instance_group.add(name="cpu", kind=module.ModelInstanceGroup.KIND_CPU, count=2)
    config.parameters["max_tokens"].string_value = "4096"
    return module.ModelConfigResponse(config=config)


def _statistics_response(module: Any) -> Message:
    response = module.ModelStatisticsResponse()
    stats = response.model_stats.add(name="g2p", version="1", last_inference=1_733_000_000_000)
    stats.inference_count, stats.execution_count = 96, 4
    for number, name in enumerate(["success", "fail", "queue", "compute_input", "compute_infer", "compute_output"]):
        duration = getattr(stats.inference_stats, name)
        duration.count, duration.ns = 96 + number, 2**40 + number
    stats.inference_stats.cache_miss.count = 0
    batch = stats.batch_stats.add(batch_size=32)
    batch.compute_infer.count, batch.compute_infer.ns = 3, 123_456_789
    return response


def _metadata_response(module: Any) -> Message:
    response = module.ModelMetadataResponse(name="g2p", versions=["1"], platform="qkv_g2p")
    response.inputs.add(name="TEXT", datatype="BYTES", shape=[-1])
    response.outputs.add(name="PHONEMES", datatype="BYTES", shape=[-1])
    return response


def _server_and_repository(module: Any) -> list[Message]:
    return [
        module.ServerMetadataResponse(name="qkv", version="0.1.0", extensions=["model_configuration", "statistics"]),
        module.RepositoryIndexResponse(models=[module.RepositoryIndexResponse.ModelIndex(name="g2p", state="READY")]),
        module.ModelReadyRequest(name="g2p", version="1"),
        module.RepositoryIndexRequest(ready=True),
    ]


@pytest.mark.parametrize(
    "build",
    [_infer_response, _model_config_response, _statistics_response, _metadata_response],
    ids=["infer", "config", "statistics", "metadata"],
)
def test_our_messages_parse_with_tritonclient(build: Callable[[Any], Message]) -> None:
    ours = build(protocol)
    theirs = type(build(TRITON)).FromString(ours.SerializeToString())
    _assert_same_message(ours, theirs)
    _assert_same_message(ours, build(TRITON))


def test_small_messages_cross_both_ways() -> None:
    for ours, reference in zip(_server_and_repository(protocol), _server_and_repository(TRITON), strict=True):
        _assert_same_message(type(reference).FromString(ours.SerializeToString()), ours)
        _assert_same_message(type(ours).FromString(reference.SerializeToString()), reference)


# --- a real tritonclient against a server built on service.protocol -------------------------


def _echo_config() -> Message:
    config = protocol.ModelConfig(name="echo", backend="qkv", max_batch_size=8)
    config.input.add(name="input_ids", data_type=protocol.DataType.TYPE_INT64, dims=[-1])
    config.dynamic_batching.max_queue_delay_microseconds = 500
    return config


class _Echo:
    """Returns each input as output ``OUT_<name>``; has no ServerReady (so that is UNIMPLEMENTED)."""

    def ServerLive(self, request: Message, context: grpc.ServicerContext) -> Message:
        return protocol.ServerLiveResponse(live=True)

    def ModelConfig(self, request: Any, context: grpc.ServicerContext) -> Message:
        if request.name != "echo":
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        return protocol.ModelConfigResponse(config=_echo_config())

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Message:
        response = protocol.ModelInferResponse(model_name=request.model_name, id=request.id)
        for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
            response.outputs.add(name=f"OUT_{tensor.name}", datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(raw)
        return response


@pytest.fixture
def echo_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((protocol.generic_handler(_Echo()),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_tritonclient_talks_to_our_server(echo_server: str) -> None:
    client = triton.InferenceServerClient(echo_server)
    try:
        assert client.is_server_live()
        config = client.get_model_config("echo").config
        assert (config.name, config.max_batch_size, list(config.input[0].dims)) == ("echo", 8, [-1])
        assert config.input[0].data_type == model_config_pb2.TYPE_INT64
        assert config.dynamic_batching.max_queue_delay_microseconds == 500
        with pytest.raises(triton.InferenceServerException, match="NOT_FOUND"):
            client.get_model_config("missing")
        with pytest.raises(triton.InferenceServerException, match="UNIMPLEMENTED"):
            client.is_server_ready()

        ids = np.array([[3, 1, 4, 1, 5]], dtype=np.int64)
        text = np.array([b"attention", "naïve".encode()], dtype=np.object_)
        inputs = [triton.InferInput("input_ids", list(ids.shape), "INT64"), triton.InferInput("TEXT", [2], "BYTES")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(text)
        result = client.infer("echo", inputs, request_id="r1")
        np.testing.assert_array_equal(result.as_numpy("OUT_input_ids"), ids)
        np.testing.assert_array_equal(result.as_numpy("OUT_TEXT"), text)
        assert result.get_response().id == "r1"
    finally:
        client.close()


def test_stub_on_a_sync_channel(echo_server: str) -> None:
    with grpc.insecure_channel(echo_server) as channel:
        stub = protocol.Stub(channel)
        assert stub.ServerLive(protocol.ServerLiveRequest(), timeout=10).live
        config = stub.ModelConfig(protocol.ModelConfigRequest(name="echo"), timeout=10).config
        assert config == _echo_config()
        with pytest.raises(grpc.RpcError) as error:
            stub.ServerReady(protocol.ServerReadyRequest(), timeout=10)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


class _AsyncEcho:
    async def ServerLive(self, request: Message, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        return protocol.ServerLiveResponse(live=True)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        response = protocol.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="OUT", datatype="BYTES", shape=[1])
        response.outputs[0].contents.bytes_contents.append(request.inputs[0].contents.bytes_contents[0].upper())
        return response


async def _aio_round_trip() -> tuple[bool, bytes]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((protocol.generic_handler(_AsyncEcho()),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = protocol.Stub(channel)
            live = await stub.ServerLive(protocol.ServerLiveRequest(), timeout=10)
            request = protocol.ModelInferRequest(model_name="g2p", id="a")
            request.inputs.add(name="TEXT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"qkv")
            response = await stub.ModelInfer(request, timeout=10)
            return live.live, response.outputs[0].contents.bytes_contents[0]
    finally:
        await server.stop(grace=None)


def test_async_implementation_and_stub_on_grpc_aio() -> None:
    assert asyncio.run(_aio_round_trip()) == (True, b"QKV")
