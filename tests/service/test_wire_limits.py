"""A large ModelInferRequest counted on the wire before it is parsed (service/frontends/wire_limits.py):
the walk's decisions on messages built field by field, and on a real server a large legal request that
still works, 65 parameters refused naming the limit whether the message is walked or not, and a refusal
on a stream that answers its request and lets the stream go on."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g
from onnx import TensorProto, helper

from service import protocol
from service.frontends.wire_limits import WALKED_BYTES, infer_request_deserializer, over_limit
from tests.conftest import RunningServer, start_server, stop_server
from tests.service.onnx_models import save_graph as _save
from tests.service.test_attacks import _field

TENSOR = _field(1, b"x") + _field(2, b"FP32") + _field(3, b"\x01\x02")  # input x, FP32, shape [1, 2]
PAD = _field(7, b"\0" * 8)  # raw_input_contents: x's 8 bytes
PARAMETER = _field(2, b"\x08\x01")  # InferParameter(bool_param=True)


def _parameters(n: int, field: int = 4) -> bytes:
    return b"".join(_field(field, _field(1, b"k%d" % i) + PARAMETER) for i in range(n))


def _request(*fields: bytes) -> bytes:
    return _field(1, b"copy") + _field(5, TENSOR) + PAD + b"".join(fields)


def _large(body: bytes) -> bytes:
    """`body` grown past WALKED_BYTES by an unknown field (number 15), which the walk skips by its length."""
    return body + _field(15, b"\0" * WALKED_BYTES)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (_request(_parameters(65)), "parameters: more than 64 in a {n}-byte request, the limit is 64 (MAX_PARAMETERS)"),
        (
            _request(_field(6, b"") * 1025),
            "outputs: more than 1024 in a {n}-byte request, the limit is 1024 (MAX_TENSORS)",
        ),
        (_request(_field(5, TENSOR) * 1024), "inputs: more than 1024"),
        (_request(PAD * 1024), "raw_input_contents: more than 1024"),
        (_field(5, TENSOR + _parameters(65)), "inputs[0].parameters: more than 64"),
        (_field(5, TENSOR) + _field(5, TENSOR + _parameters(65)), "inputs[1].parameters: more than 64"),
        (_field(6, _field(1, b"y") + _parameters(65, field=2)), "outputs[0].parameters: more than 64"),
        (
            _field(5, TENSOR + _field(5, _field(8, b"") * 65_537)),
            "inputs[0].contents.bytes_contents: more than 65536 in a {n}-byte request, the limit is 65536 "
            "(MAX_BYTES_ELEMENTS)",
        ),
        (_request(bytes([15 << 3, 0]) * 65), "fields other than parameters, inputs, outputs, raw_input_contents: more"),
        (_field(5, TENSOR + bytes([3 << 3, 0]) * 65), "inputs[0].fields other than parameters, contents: more than 64"),
        (_field(5, (TENSOR + _field(5, _field(8, b"") * 60_000)) * 5), "protobuf fields: more than 262144"),
        (_request(bytes([9 << 3 | 3, 9 << 3 | 4])), "field 9: a group, which no message of the protocol has"),
    ],
)
def test_the_walk_refuses_the_first_field_over_its_limit(body: bytes, reason: str) -> None:
    refused = over_limit(body)
    assert refused is not None and reason.format(n=len(body)) in refused.reason, refused and refused.reason


def test_a_refusal_names_the_request_it_refuses() -> None:
    refused = over_limit(_field(3, b"r-1") + _request(_field(6, b"") * 1025))
    assert refused is not None and (refused.model_name, refused.id) == ("copy", "r-1")


@pytest.mark.parametrize(
    "body",
    [
        _request(_parameters(64), _field(6, b"") * 1024),
        _request(PAD * 1023, _field(5, TENSOR) * 1023),
        _field(5, TENSOR + _parameters(64) + _field(5, _field(8, b"ab") * 65_536)),
        _request(_field(7, b"\0" * (16 << 20))),
        _request(bytes([15 << 3, 0]) * 60),  # unknown fields, as a newer client might send
    ],
)
def test_a_message_within_every_limit_is_left_to_the_parse(body: bytes) -> None:
    assert over_limit(body) is None
    assert isinstance(infer_request_deserializer(body), protocol.ModelInferRequest)


def test_a_small_message_is_parsed_without_the_walk() -> None:
    body = _request(_field(6, _field(1, b"y")) * 1025)  # 1025 outputs: the data plane's to refuse
    assert len(body) <= WALKED_BYTES
    message = infer_request_deserializer(body)
    assert isinstance(message, protocol.ModelInferRequest) and len(message.outputs) == 1025


@pytest.mark.parametrize(
    "body",
    [
        _large(_request())[:-1],  # the id's bytes cut short
        _large(_request()) + bytes([6 << 3 | 2, 0x80]),  # a length that never ends
        _large(_request()) + bytes([8 << 3 | 7]),  # wire type 7
    ],
)
def test_a_message_the_walk_cannot_follow_is_the_parses_error(body: bytes) -> None:
    assert over_limit(body) is None
    message = infer_request_deserializer(body)
    assert type(message) is protocol.Undecodable
    assert message.reason.startswith("the request is not a valid ModelInferRequest: Error parsing message")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """`copy`: x FP32 [batch, n] -> y, the same numbers."""
    repo = tmp_path_factory.mktemp("wire") / "models"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])
    _save(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "copy", [x], [y]), repo / "copy")
    s = start_server(["--model-repository", str(repo)], repo.parent / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


def test_a_16_mib_tensor_goes_through_the_walk_and_comes_back(server: RunningServer) -> None:
    x = np.arange(1 << 22, dtype=np.float32).reshape(1, -1)  # 16 MiB
    client = g.InferenceServerClient(server.url)
    tensor = g.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("copy", [tensor], parameters={"note": "large"})
    np.testing.assert_array_equal(result.as_numpy("y"), x)


@pytest.mark.parametrize("size", ["small", "large"])
def test_65_parameters_are_refused_naming_the_limit(server: RunningServer, size: str) -> None:
    body = _request(_parameters(65))
    body = _large(body) if size == "large" else body
    assert (len(body) > WALKED_BYTES) == (size == "large")
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary(f"/{protocol.SERVICE_NAME}/ModelInfer")(body, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    expected = {
        "small": "65 parameters, the limit is 64 (MAX_PARAMETERS)",  # the data plane's count
        "large": f"parameters: more than 64 in a {len(body)}-byte request, the limit is 64 (MAX_PARAMETERS)",
    }
    assert refused.value.details() == expected[size]


def test_a_refusal_on_a_stream_answers_that_request_and_the_stream_goes_on(server: RunningServer) -> None:
    over = _field(3, b"over") + _request(_parameters(65), _field(7, b"\0" * WALKED_BYTES))
    good = protocol.ModelInferRequest(model_name="copy", id="after")
    good.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    good.raw_input_contents.append(np.array([[1.5, 2.5]], dtype=np.float32).tobytes())
    with grpc.insecure_channel(server.url) as channel:
        stream = channel.stream_stream(f"/{protocol.SERVICE_NAME}/ModelStreamInfer")
        replies = [
            protocol.ModelStreamInferResponse.FromString(r) for r in stream(iter([over, good.SerializeToString()]))
        ]
    assert [(r.infer_response.model_name, r.infer_response.id) for r in replies] == [
        ("copy", "over"),
        ("copy", "after"),
    ]
    assert replies[0].error_message == (
        f"INVALID_ARGUMENT: parameters: more than 64 in a {len(over)}-byte request, the limit is 64 (MAX_PARAMETERS)"
    )
    assert not replies[1].error_message
    y = np.frombuffer(replies[1].infer_response.raw_output_contents[0], dtype=np.float32)
    np.testing.assert_array_equal(y, [1.5, 2.5])
