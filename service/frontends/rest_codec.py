"""The v2 REST protocol's bodies <-> the data plane's requests and answers.

A REST inference request becomes the data plane's `InferRequest` (service/serving/dataplane_types.py), as a
gRPC message does. Tensors come as JSON `data` (flat or nested, row-major; BYTES as strings) or, with
Triton's binary tensor data extension, as raw bytes after the JSON header (`Inference-Header-Content-Length`,
`parameters.binary_data_size`). JSON data becomes an array of the declared datatype as it is parsed
(`codec.FlatSource`); binary data stays in the body, read in place (`codec.RawSource`, a numpy view); a tensor in
shared memory is read from its region (`shared_memory.RegionSource`). The data plane checks each as it checks a
gRPC client's. Answers go back as JSON `data`, or as raw bytes after the header for the outputs asked for in
binary. No protobuf message is built on the way: the inference path is numpy and JSON only.

The control endpoints (metadata, configuration, statistics, the repository index) answer with JSON of the
protocol's messages, as Triton's REST API does (service/frontends/messages.py, `message_json`): building the
message and writing it as proto3 JSON is the shortest way to Triton's exact field names, defaults and enum
names, and those answers are off the inference path. This module imports no protobuf (a contract says so).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.datatypes import (
    MAX_DIMS,
    NUMPY_DTYPES,
    InputLimits,
    check_datatype,
    datatype_of,
    decode_bytes,
)
from service.errors import InvalidArgument, quote
from service.frontends import shared_memory
from service.frontends.codec import FlatSource, RawSource, output_bytes
from service.frontends.json_numbers import floats
from service.serving.dataplane_types import InferInput, InferRequest, InferResponse, Parameter, RequestedOutput

__all__ = [
    "MAX_JSON_BYTES",
    "InferBody",
    "encode_infer",
    "output_text",
    "parameters",
    "parse_infer",
    "parse_json",
]

# The JSON part of a request, at most. Parsing holds the event loop (measured here: 10 ms a MiB of
# integers, 17 of floats), and a parsed number costs some 30 bytes: larger tensors go in binary.
MAX_JSON_BYTES = 4 << 20
BINARY_SIZE = "binary_data_size"
# What a lone surrogate looks like in JSON: an escape \uD800-\uDFFF, or its UTF-8 form, which json.loads
# lets through too. A body without one is not walked.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


@dataclass
class InferBody:
    """A REST inference request as the data plane takes it, with how its answer is to be written."""

    request: InferRequest
    binary_outputs: dict[str, bool] = field(default_factory=dict)  # output name -> in binary
    binary_default: bool = False  # for outputs not named above
    # Tensors in system shared memory (Triton's extension): name -> (datatype, shape, their parameters)
    # Tensors that name a system shared memory region (Triton's extension), for the registry to lease
    shared_inputs: list[shared_memory.TensorRegion] = field(default_factory=list)
    shared_outputs: list[shared_memory.TensorRegion] = field(default_factory=list)

    def binary(self, name: str) -> bool:
        return self.binary_outputs.get(name, self.binary_default)


def parse_json(data: bytes | bytearray | memoryview, what: str = "the body") -> dict[str, Any]:
    """A JSON object, or InvalidArgument saying why not."""
    if len(data) > MAX_JSON_BYTES:
        raise InvalidArgument(f"{what} is {len(data):,} bytes of JSON, the limit is {MAX_JSON_BYTES:,}")
    try:
        value = json.loads(bytes(data))
    except RecursionError:
        raise InvalidArgument(f"{what} is JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidArgument(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object, not {type(value).__name__}")
    if _SURROGATE.search(data):
        _unicode(value, what)
    return value


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _unicode(doc: Any, what: str) -> None:
    """InvalidArgument naming the first string of `doc` (a key or a value) that is not valid Unicode (a lone
    surrogate, which JSON can escape but UTF-8 cannot carry). A walk without recursion: any depth json.loads
    reached."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                raise InvalidArgument(f"{what}: {path or 'the value'} holds a lone surrogate: {quote(value)}")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    raise InvalidArgument(
                        f"{what}: a key of {path or 'the object'} holds a lone surrogate: {quote(key)}"
                    )
                stack.append((item, _member(path, key)))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{k}]") for k, item in enumerate(value))


def _plain(key: str) -> bool:
    return key.isascii() and key.replace("_", "").isalnum() and len(key) <= 64


def _member(path: str, key: str) -> str:
    """A path's member `key` as a message names it: inputs[0].name, or parameters['a b'] (client keys quoted)."""
    if _plain(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{quote(key)}]" if path else quote(key)


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string")
    return value


def parameters(params: Any, what: str = "parameters") -> dict[str, Parameter]:
    """JSON parameters -> the protocol's parameter values (bool, int64, double or string)."""
    if not isinstance(params, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    out: dict[str, Parameter] = {}
    for key, value in params.items():
        if isinstance(value, bool | float | str) or (isinstance(value, int) and -(2**63) <= value < 2**63):
            out[key] = value
        else:
            raise InvalidArgument(f"{what}: {quote(key)} must be a boolean, a 64-bit integer, a number or a string")
    return out


def _shape(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InvalidArgument(f"input {quote(name)}: shape must be a list of integers")
    if len(value) > MAX_DIMS:
        raise InvalidArgument(f"input {quote(name)}: shape has {len(value)} dimensions, the limit is {MAX_DIMS}")
    if any(not -(2**63) <= d < 2**63 for d in value):
        raise InvalidArgument(f"input {quote(name)}: a dimension of the shape does not fit in 64 bits")
    return value


def _json_array(name: str, datatype: str, shape: list[int], data: Any) -> np.ndarray:
    """JSON `data` (flat or nested) -> a flat array of `datatype` (BYTES: UTF-8 bytes objects), every value
    checked to fit it."""
    try:
        array = np.array(data)
    except (ValueError, TypeError, RecursionError):  # ragged nesting, or too deep for numpy
        raise InvalidArgument(f"input {quote(name)}: data is not a regular array of values") from None
    if array.ndim > MAX_DIMS:
        raise InvalidArgument(f"input {quote(name)}: data nested {array.ndim} deep, the limit is {MAX_DIMS}")
    flat = array.reshape(-1)
    if all(d >= 0 for d in shape) and flat.size != (needed := int(np.prod(shape, dtype=object))):
        raise InvalidArgument(f"input {quote(name)}: {flat.size} values in data, shape {shape} needs {needed}")
    if flat.dtype.kind in "fO" and np.dtype(NUMPY_DTYPES[datatype]).kind in "iu":
        exact = _integers(data, name, datatype)  # UINT64 over 2**63 - 1 among others, or an out-of-range value
        flat = flat if exact is None else exact
    kind = flat.dtype.kind
    if datatype == "BYTES":
        if flat.size and kind != "U":
            raise InvalidArgument(f"input {quote(name)}: BYTES data must be strings")
        return _utf8(flat.tolist() if flat.size else [])
    allowed = {"BOOL": "b", "FP16": "iuf", "FP32": "iuf", "FP64": "iuf"}.get(datatype, "iu")
    if flat.size and kind not in allowed:
        got = {"b": "booleans", "U": "strings", "f": "numbers with a fraction"}.get(
            kind, "nulls, mixed types or integers over 64 bits"
        )
        raise InvalidArgument(f"input {quote(name)}: {datatype} data cannot hold {got}")
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if kind in "iu" and dtype.kind in "iu" and flat.size:
        info = np.iinfo(dtype)
        low, high = int(flat.min()), int(flat.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidArgument(f"input {quote(name)}: value {bad} is outside {datatype} [{info.min}, {info.max}]")
    with np.errstate(over="ignore"):  # 1e300 as FP16 is inf, which the model refuses by name
        return flat.astype(dtype, copy=False)


def _utf8(texts: list[str]) -> np.ndarray:
    """JSON strings -> BYTES elements, their UTF-8 (a lone surrogate, which JSON can escape, refused)."""
    out = np.empty(len(texts), dtype=np.object_)
    for i, text in enumerate(texts):
        try:
            out[i] = text.encode()
        except UnicodeEncodeError as e:
            raise InvalidArgument(f"BYTES element {i} is not valid Unicode (character {e.start})") from None
    return out


def _integers(data: Any, name: str, datatype: str) -> np.ndarray | None:
    """Integer `data` read exactly, as Python integers: numpy reads a value over 2**63 - 1 beside any other as
    float64, rounded (over 2**64 - 1, as object). None when `data` holds anything but integers."""
    values = np.array(data, dtype=object).reshape(-1)
    if any(type(v) is not int for v in values):
        return None
    info = np.iinfo(NUMPY_DTYPES[datatype])
    low, high = min(values, default=0), max(values, default=0)
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise InvalidArgument(f"input {quote(name)}: value {bad} is outside {datatype} [{info.min}, {info.max}]")
    return np.array(values.tolist(), dtype=NUMPY_DTYPES[datatype])


def _header_size(body: bytes, header_length: str | None) -> int:
    """The length of the JSON header: the whole body, or what Inference-Header-Content-Length says."""
    if header_length is None:
        return len(body)
    try:
        size = int(header_length)
    except ValueError:
        raise InvalidArgument(f"Inference-Header-Content-Length {quote(header_length)} is not a number") from None
    if not 0 <= size <= len(body):
        raise InvalidArgument(
            f"Inference-Header-Content-Length is {size}, the body has {len(body)} bytes: it must lie between"
        )
    return size


def _input(
    tensor: Any, k: int, view: memoryview, offset: int, shared: list[shared_memory.TensorRegion]
) -> tuple[InferInput, int]:
    """inputs[k] of the JSON header, its binary data at `offset` of the body; and the offset after it."""
    if not isinstance(tensor, dict):
        raise InvalidArgument(f"inputs[{k}] must be a JSON object")
    name = _string(tensor.get("name"), f"inputs[{k}].name")
    datatype = _string(tensor.get("datatype"), f"input {quote(name)}: datatype")
    shape = _shape(tensor.get("shape"), name)
    check_datatype(name, datatype)
    tensor_params = tensor.get("parameters", {})
    if not isinstance(tensor_params, dict):
        raise InvalidArgument(f"input {quote(name)}: parameters must be a JSON object")
    if shared_memory.REGION in tensor_params or any(k in tensor_params for k in shared_memory.PARAMETERS):
        if "data" in tensor or BINARY_SIZE in tensor_params:
            raise InvalidArgument(f"input {quote(name)}: both a shared memory region and data given")
        shared.append(shared_memory.TensorRegion(name, parameters(tensor_params, f"input {quote(name)}: parameters")))
        return InferInput(name, datatype, shape, _UNATTACHED), offset
    binary = tensor_params.get(BINARY_SIZE)
    if binary is None:
        if "data" not in tensor:
            raise InvalidArgument(f"input {quote(name)}: neither data nor parameters.{BINARY_SIZE} given")
        return InferInput(name, datatype, shape, FlatSource(_json_array(name, datatype, shape, tensor["data"]))), offset
    if "data" in tensor:
        raise InvalidArgument(f"input {quote(name)}: both data and parameters.{BINARY_SIZE} given")
    if isinstance(binary, bool) or not isinstance(binary, int) or binary < 0:
        raise InvalidArgument(f"input {quote(name)}: parameters.{BINARY_SIZE} must be a non-negative integer")
    if offset + binary > len(view):
        raise InvalidArgument(
            f"input {quote(name)}: {binary} binary bytes declared, {len(view) - offset} left in the body"
        )
    return InferInput(name, datatype, shape, RawSource(view[offset : offset + binary])), offset + binary


def _outputs(outputs: Any, parsed: InferBody) -> list[RequestedOutput]:
    """The JSON header's outputs, and which of them are asked for in binary."""
    if not isinstance(outputs, list):
        raise InvalidArgument("'outputs' must be a list")
    requested = []
    for k, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise InvalidArgument(f"outputs[{k}] must be a JSON object")
        name = _string(out.get("name"), f"outputs[{k}].name")
        out_params = out.get("parameters", {})
        if not isinstance(out_params, dict):
            raise InvalidArgument(f"output {quote(name)}: parameters must be a JSON object")
        plain = {key: v for key, v in out_params.items() if isinstance(v, bool | int | float | str)}
        requested.append(RequestedOutput(name, plain))
        if any(k in plain for k in shared_memory.PARAMETERS):
            parsed.shared_outputs.append(shared_memory.TensorRegion(name, plain))
        if "binary_data" in out_params:
            parsed.binary_outputs[name] = bool(out_params["binary_data"])
    return requested


def parse_infer(
    body: bytes, header_length: str | None, model: str, version: str, arrived: float | None = None
) -> InferBody:
    """A REST inference request (JSON, or JSON + binary tensors) -> the data plane's request. Tensors'
    shapes, sizes and datatypes are checked later, by the data plane, as a gRPC client's are. `arrived`:
    time.monotonic() at its arrival, from which Triton's `timeout` parameter counts."""
    size = _header_size(body, header_length)
    view = memoryview(body)
    doc = parse_json(view[:size], "the inference request")
    request = InferRequest(model_name=model, model_version=version, method="POST /v2/models/{model}/infer")
    if "id" in doc:
        request.id = _string(doc["id"], "id")
    parsed = InferBody(request)
    params = doc.get("parameters", {})
    request.parameters = parameters(params)
    parsed.binary_default = bool(params.get("binary_data_output", False))
    if "timeout" in params:  # Triton's per-request timeout, microseconds: the request's deadline here
        timeout = params["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
            raise InvalidArgument("parameters: 'timeout' must be a positive integer (microseconds)")
        request.deadline = (arrived if arrived is not None else time.monotonic()) + timeout / 1e6
    tensors = doc.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise InvalidArgument("the inference request must have 'inputs': a list of tensors")
    inputs, offset = [], size
    for k, tensor in enumerate(tensors):
        tensor_input, offset = _input(tensor, k, view, offset, parsed.shared_inputs)
        inputs.append(tensor_input)
    if offset != len(body):
        raise InvalidArgument(f"{len(body) - offset} bytes after the last input's binary data: none may follow")
    request.inputs, request.outputs = inputs, _outputs(doc.get("outputs", []), parsed)
    return parsed


class _Unattached:
    """An input in shared memory before its region is leased (the front end replaces it with the region's
    contents once it has the lease)."""

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        raise InvalidArgument(f"input {quote(name)}: its shared memory region was not attached")


_UNATTACHED = _Unattached()


def _json_data(datatype: str, shape: list[int], raw: bytes) -> list[Any]:
    """An output's raw bytes -> its values, flat and row-major, as JSON holds them."""
    if datatype == "BYTES":
        count = int(np.prod(shape)) if shape else 1
        return [b.decode("utf-8", "replace") for b in decode_bytes(raw, count, "output").tolist()]
    values: list[Any] = np.frombuffer(raw, dtype=np.dtype(NUMPY_DTYPES[datatype]).newbyteorder("<")).tolist()
    return values


def output_text(response: InferResponse, name: str) -> str:
    """The first element of a BYTES output, as text (bytes that are not UTF-8 replaced)."""
    array = response.outputs[name]
    return str(_json_data("BYTES", list(array.shape), output_bytes(array))[0])


def encode_infer(
    response: InferResponse, parsed: InferBody, memory: shared_memory.RequestMemory | None = None
) -> tuple[bytes, int | None]:
    """The data plane's answer -> the REST body, and the length of its JSON header when binary data follows.
    An output asked for in shared memory is written there, and answered with its parameters, no data."""
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    outputs, binary = [], []
    for name, array in response.outputs.items():
        shape, datatype = list(array.shape), datatype_of(array)
        out: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        # the protocol's bytes are made only for an output that needs them (not one written as JSON floats)
        placed = memory.write(name, output_bytes(array)) if memory is not None and name in memory.outputs else None
        if placed is not None:
            out["parameters"] = placed
        elif parsed.binary(name):
            raw = output_bytes(array)
            out["parameters"] = {BINARY_SIZE: len(raw)}
            binary.append(raw)
        elif datatype == "FP32":  # written as text here: 9 digits a value, not the 17 of its float64 widening
            text = json.dumps(out, separators=(",", ":"))
            outputs.append(f'{text[:-1]},"data":{floats(np.asarray(array, dtype=np.float32).reshape(-1))}}}')
            continue
        else:
            out["data"] = _json_data(datatype, shape, output_bytes(array))
        outputs.append(json.dumps(out, separators=(",", ":")))
    doc["outputs"] = []
    head = json.dumps(doc, separators=(",", ":"))
    header = f"{head[:-2]}{','.join(outputs)}]}}".encode()
    if not binary:
        return header, None
    return b"".join([header, *binary]), len(header)
