"""The v2 REST protocol's bodies <-> the protocol's protobuf messages.

A REST inference request becomes the same `ModelInferRequest` a gRPC client sends, so both protocols
share one data plane. Tensors come as JSON `data` (flat or nested, row-major; BYTES as strings) or,
with Triton's binary tensor data extension, as raw bytes after the JSON header
(`Inference-Header-Content-Length`, `parameters.binary_data_size`). Either way they are handed on as
`raw_input_contents`, which `service.frontends.codec` checks as it checks a gRPC client's. Answers go back as
JSON `data`, or as raw bytes after the header for the outputs asked for in binary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from service import protocol
from service.datatypes import MAX_DIMS, NUMPY_DTYPES, decode_bytes, encode_bytes
from service.errors import InvalidArgument, quote
from service.frontends import shared_memory

__all__ = [
    "MAX_JSON_BYTES",
    "InferBody",
    "encode_infer",
    "message_json",
    "output_data",
    "parse_infer",
    "parse_json",
    "set_parameters",
]

# The JSON part of a request, at most. Parsing holds the event loop (measured here: 10 ms a MiB of
# integers, 17 of floats), and a parsed number costs some 30 bytes: larger tensors go in binary.
MAX_JSON_BYTES = 4 << 20
BINARY_SIZE = "binary_data_size"
# What a lone surrogate looks like in JSON: an escape \uD800-\uDFFF, or its UTF-8 form, which json.loads
# lets through too. A body without one is not walked.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


@dataclass
class InferBody:
    """A REST inference request as the gRPC path takes it, with how its answer is to be written."""

    request: Any  # protocol.ModelInferRequest
    binary_outputs: dict[str, bool] = field(default_factory=dict)  # output name -> in binary
    binary_default: bool = False  # for outputs not named above
    timeout: float | None = None  # seconds, from Triton's `timeout` parameter (microseconds)

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


def set_parameters(target: Any, params: Any, what: str = "parameters") -> None:
    """JSON parameters -> a protobuf map of InferParameter (bool, int64, double or string)."""
    if not isinstance(params, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    for key, value in params.items():
        p = target[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        elif isinstance(value, str):
            p.string_param = value
        else:
            raise InvalidArgument(f"{what}: {quote(key)} must be a boolean, a 64-bit integer, a number or a string")


def _shape(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InvalidArgument(f"input {quote(name)}: shape must be a list of integers")
    if len(value) > MAX_DIMS:
        raise InvalidArgument(f"input {quote(name)}: shape has {len(value)} dimensions, the limit is {MAX_DIMS}")
    if any(not -(2**63) <= d < 2**63 for d in value):
        raise InvalidArgument(f"input {quote(name)}: a dimension of the shape does not fit in 64 bits")
    return value


def _json_tensor(name: str, datatype: str, shape: list[int], data: Any) -> bytes:
    """JSON `data` (flat or nested) -> the raw little-endian bytes the protocol carries for it."""
    try:
        array = np.array(data)
    except (ValueError, TypeError, RecursionError):  # ragged nesting, or too deep for numpy
        raise InvalidArgument(f"input {quote(name)}: data is not a regular array of values") from None
    if array.ndim > MAX_DIMS:
        raise InvalidArgument(f"input {quote(name)}: data nested {array.ndim} deep, the limit is {MAX_DIMS}")
    flat = array.reshape(-1)
    if all(d >= 0 for d in shape) and flat.size != (needed := int(np.prod(shape, dtype=object))):
        raise InvalidArgument(f"input {quote(name)}: {flat.size} values in data, shape {shape} needs {needed}")
    kind = flat.dtype.kind
    if datatype == "BYTES":
        if flat.size and kind != "U":
            raise InvalidArgument(f"input {quote(name)}: BYTES data must be strings")
        return encode_bytes(flat.astype(object))
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
        return flat.astype(dtype.newbyteorder("<")).tobytes()


def parse_infer(body: bytes, header_length: str | None, model: str, version: str) -> InferBody:
    """A REST inference request (JSON, or JSON + binary tensors) -> the ModelInferRequest the gRPC path
    takes. Tensors' shapes, sizes and datatypes are checked later, by the codec, as a gRPC client's are."""
    if header_length is None:
        size = len(body)
    else:
        try:
            size = int(header_length)
        except ValueError:
            raise InvalidArgument(f"Inference-Header-Content-Length {quote(header_length)} is not a number") from None
        if not 0 <= size <= len(body):
            raise InvalidArgument(
                f"Inference-Header-Content-Length is {size}, the body has {len(body)} bytes: it must lie between"
            )
    view = memoryview(body)
    doc = parse_json(view[:size], "the inference request")
    request = protocol.ModelInferRequest(model_name=model, model_version=version)
    if "id" in doc:
        request.id = _string(doc["id"], "id")
    parsed = InferBody(request)
    params = doc.get("parameters", {})
    set_parameters(request.parameters, params)
    parsed.binary_default = bool(params.get("binary_data_output", False))
    if "timeout" in params:  # Triton's per-request timeout, microseconds: the request's deadline here
        timeout = params["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
            raise InvalidArgument("parameters: 'timeout' must be a positive integer (microseconds)")
        parsed.timeout = timeout / 1e6
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument("the inference request must have 'inputs': a list of tensors")
    offset = size
    for k, tensor in enumerate(inputs):
        if not isinstance(tensor, dict):
            raise InvalidArgument(f"inputs[{k}] must be a JSON object")
        name = _string(tensor.get("name"), f"inputs[{k}].name")
        datatype = _string(tensor.get("datatype"), f"input {quote(name)}: datatype")
        shape = _shape(tensor.get("shape"), name)
        if datatype not in NUMPY_DTYPES:
            raise InvalidArgument(f"input {quote(name)}: unknown datatype {quote(datatype)}")
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        tensor_params = tensor.get("parameters", {})
        if not isinstance(tensor_params, dict):
            raise InvalidArgument(f"input {quote(name)}: parameters must be a JSON object")
        binary = tensor_params.get(BINARY_SIZE)
        if shared_memory.REGION in tensor_params:  # read from the region by service.frontends.shared_memory
            if binary is not None or "data" in tensor:
                raise InvalidArgument(f"input {quote(name)}: both a shared memory region and data given")
            _shared_memory_parameters(request.inputs[-1].parameters, tensor_params, f"input {quote(name)}")
        elif binary is not None:
            if "data" in tensor:
                raise InvalidArgument(f"input {quote(name)}: both data and parameters.{BINARY_SIZE} given")
            if isinstance(binary, bool) or not isinstance(binary, int) or binary < 0:
                raise InvalidArgument(f"input {quote(name)}: parameters.{BINARY_SIZE} must be a non-negative integer")
            if offset + binary > len(body):
                raise InvalidArgument(
                    f"input {quote(name)}: {binary} binary bytes declared, {len(body) - offset} left in the body"
                )
            request.raw_input_contents.append(body[offset : offset + binary])
            offset += binary
        elif "data" in tensor:
            request.raw_input_contents.append(_json_tensor(name, datatype, shape, tensor["data"]))
        else:
            raise InvalidArgument(f"input {quote(name)}: neither data nor parameters.{BINARY_SIZE} given")
    if offset != len(body):
        raise InvalidArgument(f"{len(body) - offset} bytes after the last input's binary data: none may follow")
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument("'outputs' must be a list")
    for k, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise InvalidArgument(f"outputs[{k}] must be a JSON object")
        name = _string(out.get("name"), f"outputs[{k}].name")
        request.outputs.add(name=name)
        out_params = out.get("parameters", {})
        if not isinstance(out_params, dict):
            raise InvalidArgument(f"output {quote(name)}: parameters must be a JSON object")
        if "binary_data" in out_params:
            parsed.binary_outputs[name] = bool(out_params["binary_data"])
        _shared_memory_parameters(request.outputs[-1].parameters, out_params, f"output {quote(name)}")
    return parsed


def _shared_memory_parameters(target: Any, params: dict[str, Any], what: str) -> None:
    """A tensor's shared memory parameters (and no other) onto its protobuf message."""
    chosen = {k: v for k, v in params.items() if k in shared_memory.PARAMETERS}
    if chosen:
        set_parameters(target, chosen, f"{what}: parameters")


def _json_data(datatype: str, shape: list[int], raw: bytes) -> list[Any]:
    """An output's raw bytes -> its values, flat and row-major, as JSON holds them."""
    if datatype == "BYTES":
        count = int(np.prod(shape)) if shape else 1
        return [b.decode("utf-8", "replace") for b in decode_bytes(raw, count, "output").tolist()]
    values: list[Any] = np.frombuffer(raw, dtype=np.dtype(NUMPY_DTYPES[datatype]).newbyteorder("<")).tolist()
    return values


def output_data(response: Any) -> dict[str, list[Any]]:
    """Each output of a ModelInferResponse -> its values, flat."""
    return {
        t.name: _json_data(t.datatype, list(t.shape), raw)
        for t, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


def encode_infer(response: Any, parsed: InferBody) -> tuple[bytes, int | None]:
    """A ModelInferResponse -> the REST body, and the length of its JSON header when binary data follows."""
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    outputs, binary = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        shape = list(tensor.shape)
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": shape}
        if shared_memory.REGION in tensor.parameters:  # written into the region: where, and no data
            out["parameters"] = {
                k: getattr(p, str(p.WhichOneof("parameter_choice"))) for k, p in tensor.parameters.items()
            }
        elif parsed.binary(tensor.name):
            out["parameters"] = {BINARY_SIZE: len(raw)}
            binary.append(raw)
        else:
            out["data"] = _json_data(tensor.datatype, shape, raw)
        outputs.append(out)
    doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not binary:
        return header, None
    return b"".join([header, *binary]), len(header)


def _numbers(message: Message, doc: Any) -> Any:
    """Undo proto3 JSON's strings for 64-bit integers: Triton's REST answers carry numbers, and
    perf_analyzer and tritonclient read them as numbers."""
    if not isinstance(doc, dict):
        return doc
    for f in message.DESCRIPTOR.fields:
        if f.name not in doc:
            continue
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            entry = f.message_type.fields_by_name["value"]
            if entry.message_type is not None:
                for key, sub in value.items():
                    _numbers(sub, doc[f.name][str(key)])
        elif f.message_type is not None:
            subs = list(value) if f.label == FieldDescriptor.LABEL_REPEATED else [value]
            targets = doc[f.name] if f.label == FieldDescriptor.LABEL_REPEATED else [doc[f.name]]
            for sub, target in zip(subs, targets, strict=True):
                _numbers(sub, target)
        elif f.type in _INT64_TYPES:
            doc[f.name] = [int(v) for v in doc[f.name]] if isinstance(doc[f.name], list) else int(doc[f.name])
    return doc


def message_json(message: Message) -> Any:
    """A protocol message as Triton's REST API writes it: field names as in the .proto, every field
    present (zeros too), enums by name, 64-bit integers as numbers."""
    doc = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message, doc)
