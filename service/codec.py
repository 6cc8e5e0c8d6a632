"""Protocol tensors <-> numpy: datatypes, typed contents, raw contents and the BYTES encoding.

The v2 protocol carries a tensor either in typed `contents` (one repeated field per type) or
as little-endian bytes in `raw_input_contents`; a BYTES element in raw form is a 4-byte
little-endian length followed by that many bytes.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from service.errors import InvalidArgument, quote

__all__ = [
    "MAX_DIMS",
    "NUMPY_DTYPES",
    "ONNX_DATATYPES",
    "datatype_of",
    "decode_bytes",
    "decode_tensor",
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
MAX_BYTES_ELEMENTS = 1 << 16  # BYTES elements in one tensor
MAX_DIMS = 32  # dimensions of one tensor (numpy itself stops at 64)
_DATATYPE_OF = {np.dtype(v).str: k for k, v in NUMPY_DTYPES.items() if k != "BYTES"}


def datatype_of(array: np.ndarray) -> str:
    if array.dtype == np.object_ or array.dtype.kind in "SU":
        return "BYTES"
    return _DATATYPE_OF[array.dtype.str]


def decode_bytes(raw: bytes, count: int, name: str) -> np.ndarray:
    """Length-prefixed BYTES elements -> object array of `count` bytes values."""
    out, offset = [], 0
    for _ in range(count):
        if offset + 4 > len(raw):
            raise InvalidArgument(f"input {quote(name)}: raw BYTES contents end inside an element's length prefix")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
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
    for x in array.reshape(-1):
        b = x if isinstance(x, bytes) else str(x).encode()
        parts.append(struct.pack("<I", len(b)) + b)
    return b"".join(parts)


def decode_tensor(tensor: Any, raw: bytes | None, max_elements: int) -> np.ndarray:
    """One InferInputTensor (and its raw contents, if any) -> numpy array of its declared shape."""
    name, datatype = tensor.name, tensor.datatype
    if datatype not in NUMPY_DTYPES:
        raise InvalidArgument(f"input {quote(name)}: unknown datatype {quote(datatype)}")
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(f"input {quote(name)}: shape has {len(shape)} dimensions, the limit is {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input {quote(name)}: negative dimension in shape {list(shape)}")
    # Checked before anything is allocated; zeros aside, so [0, 2**62] is refused too (numpy could not hold it).
    count, extent = 1, 1
    for d in shape:
        count *= d
        extent *= max(d, 1)
        if extent > max_elements:
            aside = " (zero dimensions aside)" if 0 in shape else ""
            raise InvalidArgument(
                f"input {quote(name)}: shape {list(shape)} exceeds the limit of {max_elements} elements{aside}"
            )
    if datatype == "BYTES" and count > MAX_BYTES_ELEMENTS:
        # Decoding BYTES is a Python loop per element: bound it before it can hold the event loop.
        raise InvalidArgument(f"input {quote(name)}: {count} BYTES elements, the limit is {MAX_BYTES_ELEMENTS}")
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidArgument(f"input {quote(name)}: both typed contents and raw_input_contents given")
        if datatype == "BYTES":
            return decode_bytes(raw, count, name).reshape(shape)
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
        return np.array(list(values), dtype=np.object_).reshape(shape)
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if datatype in _NARROW:  # carried widened (int32 / uint32): a value may not fit the declared type
        wide = np.asarray(values, dtype=_NARROW[datatype])
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            bad = int(wide.min()) if wide.min() < info.min else int(wide.max())
            raise InvalidArgument(
                f"input {quote(name)}: value {bad} in contents.{field} is outside {datatype} [{info.min}, {info.max}]"
            )
        return wide.astype(dtype).reshape(shape)
    return np.asarray(values, dtype=dtype).reshape(shape)


def fill_output(tensor: Any, array: np.ndarray) -> bytes:
    """Set name-independent metadata of an output tensor; return its raw little-endian bytes."""
    tensor.datatype = datatype_of(array)
    tensor.shape.extend(array.shape)
    if tensor.datatype == "BYTES":
        return encode_bytes(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
