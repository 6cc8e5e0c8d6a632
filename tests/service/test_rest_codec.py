"""REST bodies become the data plane's inputs without protobuf: JSON data an array of the declared datatype,
binary data a view of the body (copied only when it lies unaligned), generate's text its own UTF-8."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.datatypes import InputLimits
from service.errors import InvalidArgument
from service.frontends.codec import FlatSource, RawSource
from service.frontends.rest_codec import encode_infer, parse_infer
from service.serving.dataplane_types import InferResponse

LIMITS = InputLimits()


def _binary_body(header_pad: int, values: np.ndarray) -> tuple[bytes, str]:
    """A request of one FP32 input in binary, its JSON header padded to `header_pad` bytes."""
    doc = {
        "id": "",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(values.shape), "parameters": {}}],
    }
    doc["inputs"][0]["parameters"]["binary_data_size"] = values.nbytes
    header = json.dumps(doc).encode()
    header += b" " * (header_pad - len(header))
    return header + values.astype("<f4").tobytes(), str(len(header))


def test_binary_data_is_read_in_place_when_aligned() -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    body, length = _binary_body(128, values)
    tensor = parse_infer(body, length, "m", "").request.inputs[0]
    assert isinstance(tensor.source, RawSource)
    array = tensor.read(LIMITS)
    np.testing.assert_array_equal(array, values)
    assert np.shares_memory(array, np.frombuffer(body, dtype=np.uint8))  # the body's bytes, not a copy
    assert not array.flags.writeable


def test_binary_data_after_a_header_of_odd_length_is_copied_aligned() -> None:
    values = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    body, length = _binary_body(129, values)
    array = parse_infer(body, length, "m", "").request.inputs[0].read(LIMITS)
    np.testing.assert_array_equal(array, values)
    assert array.flags.aligned
    assert not np.shares_memory(array, np.frombuffer(body, dtype=np.uint8))


@pytest.mark.parametrize(
    ("datatype", "data", "dtype"),
    [
        ("INT64", [[1, 2], [3, 4]], np.int64),
        ("UINT64", [2**64 - 1, 0, 1, 2], np.uint64),  # read exactly, not through float64
        ("FP16", [0.5, 1, 2, 1e300], np.float16),
        ("BOOL", [True, False, True, True], np.bool_),
        ("INT8", [-128, 127, 0, 1], np.int8),
    ],
)
def test_json_data_becomes_an_array_of_the_declared_datatype(datatype: str, data: list, dtype: type) -> None:
    body = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [2, 2], "data": data}]}).encode()
    tensor = parse_infer(body, None, "m", "").request.inputs[0]
    assert isinstance(tensor.source, FlatSource)
    array = tensor.read(LIMITS)
    assert array.dtype == dtype and array.shape == (2, 2)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(array.reshape(-1), np.array(data, dtype=object).reshape(-1).astype(dtype))


def test_json_strings_are_their_utf8_and_each_is_held_to_the_element_limit() -> None:
    body = json.dumps({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2], "data": ["héllo", "ok"]}]})
    tensor = parse_infer(body.encode(), None, "m", "").request.inputs[0]
    assert tensor.read(LIMITS).tolist() == ["héllo".encode(), b"ok"]
    with pytest.raises(InvalidArgument, match=r"input 't' element 0: 6 bytes, the limit is 5"):
        tensor.read(InputLimits(element_bytes=5))


def test_json_data_is_counted_against_the_shape_it_declares() -> None:
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]}]})
    with pytest.raises(InvalidArgument, match=r"input 'x': 3 values in data, shape \[2, 2\] needs 4"):
        parse_infer(body.encode(), None, "m", "")
    # counted again as it is read: a source handed a shape its elements do not fill is refused by name
    with pytest.raises(InvalidArgument, match=r"input 'x': 3 values in data, shape \[4\] needs 4"):
        FlatSource(np.zeros(3, np.float32)).read("x", "FP32", [4], LIMITS)


def test_a_tensor_in_shared_memory_is_described_by_plain_values() -> None:
    region = {"shared_memory_region": "r", "shared_memory_byte_size": 16, "shared_memory_offset": 8}
    body = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "parameters": region}],
            "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}],
        }
    )
    parsed = parse_infer(body.encode(), None, "m", "")
    (inp,), (out,) = parsed.shared_inputs, parsed.shared_outputs
    assert (inp.name, dict(inp.parameters), inp.has_data) == ("x", region, False)
    assert (out.name, dict(out.parameters)) == ("y", {"shared_memory_region": "r", "shared_memory_byte_size": 4})
    with pytest.raises(InvalidArgument, match="its shared memory region was not attached"):
        parsed.request.inputs[0].read(LIMITS)  # until the front end leases the region


def test_fp32_json_answers_give_back_every_float32_exactly_and_others_as_before() -> None:
    values = np.array([[0.1, -0.0, 1e-45, 3.4028235e38], [1 / 3, -2.5, 7e-39, 123456.79]], dtype=np.float32)
    ints = np.array([[1, -2]], dtype=np.int64)
    answer = InferResponse("m", "1", "r", {"OUT": values, "IDS": ints})
    body = parse_infer(b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1]}]}', None, "m", "")
    text, binary_length = encode_infer(answer, body)
    doc = json.loads(text)
    assert binary_length is None and [o["name"] for o in doc["outputs"]] == ["OUT", "IDS"] and doc["id"] == "r"
    out, ids = doc["outputs"]
    got = np.array(out["data"], dtype=np.float32)
    assert out["shape"] == [2, 4] and out["datatype"] == "FP32" and got.tobytes() == values.reshape(-1).tobytes()
    assert b"0.100000001" in text and b"0.10000000149" not in text  # 9 digits, not the float64 widening's 17
    assert ids == {"name": "IDS", "datatype": "INT64", "shape": [1, 2], "data": [1, -2]}
    odd = InferResponse("m", "1", "", {"OUT": np.array([np.nan, np.inf], dtype=np.float32)})
    nan, inf = json.loads(encode_infer(odd, body)[0])["outputs"][0]["data"]  # as json.dumps writes them
    assert np.isnan(nan) and inf == float("inf")
