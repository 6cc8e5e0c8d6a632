"""Protocol tensors <-> numpy: datatypes, typed contents, raw contents and the BYTES encoding.

The v2 protocol carries a tensor either in typed `contents` (one repeated field per type) or
as little-endian bytes in `raw_input_contents`; a BYTES element in raw form is a 4-byte
little-endian length followed by that many bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.errors import InvalidArgument, quote

__all__ = [
    "MAX_BYTES_ELEMENTS",
    "MAX_DIMS",
    "MAX_ELEMENTS",
    "NUMPY_DTYPES",
    "ONNX_DATATYPES",
    "InputLimits",
    "datatype_of",
    "decode_bytes",
    "decode_tensor",
    "element_count",
    "encode_bytes",
    "fill_output",
]

NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
ONNX_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
# The typed-contents field that carries each datatype (smaller ints travel widened).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
# Datatypes whose typed contents travel in a wider field, and that field's numpy type.
_NARROW = {"INT8": np.int32, "INT16": np.int32, "UINT8": np.uint32, "UINT16": np.uint32}
MAX_ELEMENTS = 1 << 24  # elements of one tensor, whatever the model
MAX_BYTES_ELEMENTS = 1 << 16  # BYTES elements in one tensor
MAX_DIMS = 32  # dimensions of one tensor (numpy itself stops at 64)
# Typed contents become an array this many values at a time: each slice is a bounded list of Python
# numbers, and a thread converting a large tensor lets the event loop run between two slices.
CONTENTS_SLICE = 1 << 16


@dataclass(frozen=True)
class InputLimits:
    """What one input tensor may hold, checked on the message as received, before anything is decoded."""

    elements: int = MAX_ELEMENTS
    element_bytes: int | None = None  # each BYTES element, at most
    why: str = ""  # where `elements` comes from, said in the refusal


_DATATYPE_OF = {np.dtype(v).str: k for k, v in NUMPY_DTYPES.items() if k != "BYTES"}


def datatype_of(array: np.ndarray) -> str:
    if array.dtype == np.object_ or array.dtype.kind in "SU":
        return "BYTES"
    return _DATATYPE_OF[array.dtype.str]


def decode_bytes(raw: bytes, count: int, name: str, max_bytes: int | None = None) -> np.ndarray:
    """Length-prefixed BYTES elements -> object array of `count` bytes values; an element longer than
    `max_bytes` is refused before it is copied."""
    out, offset = [], 0
    for i in range(count):
        if offset + 4 > len(raw):
            raise InvalidArgument(f"input {quote(name)}: raw BYTES contents end inside an element's length prefix")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if max_bytes is not None and n > max_bytes:
            raise InvalidArgument(f"input {quote(name)} element {i}: {n} bytes, the limit is {max_bytes}")
        if offset + n > len(raw):
            raise InvalidArgument(
                f"input {quote(name)}: raw BYTES element of {n} bytes runs past the end of the contents"
            )
        out.append(raw[offset : offset + n])
        offset += n
    if offset != len(raw):
        raise InvalidArgument(f"input {quote(name)}: {len(raw) - offset} bytes left over after {count} BYTES elements")
    return np.array(out, dtype=np.object_)


def encode_bytes(array: np.ndarray) -> bytes:
    parts = []
    for i, x in enumerate(array.reshape(-1)):
        try:
            b = x if isinstance(x, bytes) else str(x).encode()
        except UnicodeEncodeError as e:  # a lone surrogate, as JSON's \ud800 gives
            raise InvalidArgument(f"BYTES element {i} is not valid Unicode (character {e.start})") from None
        parts.append(struct.pack("<I", len(b)) + b)
    return b"".join(parts)


def element_count(tensor: Any) -> int:
    """The elements an InferInputTensor's shape declares, counted without building the shape (0 when
    the shape is invalid: decode_tensor says why)."""
    if len(tensor.shape) > MAX_DIMS:
        return 0
    count = 1
    for d in tensor.shape:
        count *= max(int(d), 0)
    return count


def _typed(values: Any, dtype: Any, count: int) -> np.ndarray:
    """A repeated protobuf field of numbers -> a 1-d array, CONTENTS_SLICE values at a time."""
    if count <= CONTENTS_SLICE:
        return np.asarray(values, dtype=dtype)
    out = np.empty(count, dtype=dtype)
    for start in range(0, count, CONTENTS_SLICE):
        out[start : start + CONTENTS_SLICE] = values[start : start + CONTENTS_SLICE]
    return out


def decode_tensor(tensor: Any, raw_contents: Callable[[], bytes] | None, limits: InputLimits) -> np.ndarray:
    """One InferInputTensor (and its raw contents, if any) -> numpy array of its declared shape.
    Every count is checked against `limits` before the elements are touched; `raw_contents` gives the
    raw contents (a copy, out of the message), asked for only then."""
    name, datatype = tensor.name, tensor.datatype
    if datatype not in NUMPY_DTYPES:
        raise InvalidArgument(f"input {quote(name)}: unknown datatype {quote(datatype)}")
    if len(tensor.shape) > MAX_DIMS:  # counted before the shape becomes Python ints
        raise InvalidArgument(f"input {quote(name)}: shape has {len(tensor.shape)} dimensions, the limit is {MAX_DIMS}")
    shape = tuple(int(d) for d in tensor.shape)
    max_elements = limits.elements
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input {quote(name)}: negative dimension in shape {list(shape)}")
    # Checked before anything is allocated; zeros aside, so [0, 2**62] is refused too (numpy could not hold it).
    count, extent = 1, 1
    for d in shape:
        count *= d
        extent *= max(d, 1)
        if extent > max_elements:
            aside = " (zero dimensions aside)" if 0 in shape else ""
            unit = "BYTES elements" if datatype == "BYTES" else "elements"
            why = f": {limits.why}" if limits.why else ""
            raise InvalidArgument(
                f"input {quote(name)}: shape {list(shape)} exceeds the limit of {max_elements} {unit}{aside}{why}"
            )
    if datatype == "BYTES" and count > MAX_BYTES_ELEMENTS:
        # Decoding BYTES is a Python loop per element: bound it before it can hold the event loop.
        raise InvalidArgument(f"input {quote(name)}: {count} BYTES elements, the limit is {MAX_BYTES_ELEMENTS}")
    if raw_contents is not None:
        if tensor.HasField("contents"):
            raise InvalidArgument(f"input {quote(name)}: both typed contents and raw_input_contents given")
        raw = raw_contents()
        if datatype == "BYTES":
            return decode_bytes(raw, count, name, limits.element_bytes).reshape(shape)
        dtype = np.dtype(NUMPY_DTYPES[datatype]).newbyteorder("<")
        if len(raw) != count * dtype.itemsize:
            raise InvalidArgument(
                f"input {quote(name)}: raw contents are {len(raw)} bytes, shape {list(shape)} of {datatype} needs "
                f"{count * dtype.itemsize}"
            )
        return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=False).reshape(shape)
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(f"input {quote(name)}: {datatype} travels only in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidArgument(
            f"input {quote(name)}: {len(values)} values in contents.{field}, shape {list(shape)} needs {count}"
        )
    if datatype == "BYTES":
        elements = list(values)
        if limits.element_bytes is not None:
            for i, b in enumerate(elements):
                if len(b) > limits.element_bytes:
                    raise InvalidArgument(
                        f"input {quote(name)} element {i}: {len(b)} bytes, the limit is {limits.element_bytes}"
                    )
        return np.array(elements, dtype=np.object_).reshape(shape)
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if datatype in _NARROW:  # carried widened (int32 / uint32): a value may not fit the declared type
        wide = _typed(values, _NARROW[datatype], count)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            bad = int(wide.min()) if wide.min() < info.min else int(wide.max())
            raise InvalidArgument(
                f"input {quote(name)}: value {bad} in contents.{field} is outside {datatype} [{info.min}, {info.max}]"
            )
        return wide.astype(dtype).reshape(shape)
    return _typed(values, dtype, count).reshape(shape)


def fill_output(tensor: Any, array: np.ndarray) -> bytes:
    """Set name-independent metadata of an output tensor; return its raw little-endian bytes."""
    tensor.datatype = datatype_of(array)
    tensor.shape.extend(array.shape)
    if tensor.datatype == "BYTES":
        return encode_bytes(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
