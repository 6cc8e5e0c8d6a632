"""The v2 protocol's datatypes: their numpy and ONNX equivalents, the bounds on one tensor, and the
BYTES serialization (each element a 4-byte little-endian length, then that many bytes).

The base of the tensor path: the wire codecs, the model kinds and the client all use it.
"""

from __future__ import annotations

import struct
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
    "ONNX_UNSERVED",
    "UNSERVED",
    "InputLimits",
    "check_datatype",
    "datatype_of",
    "decode_bytes",
    "encode_bytes",
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
# Datatypes of the v2 protocol (and ONNX) that are not served, and why: a request or a graph that uses one
# is refused saying so.
UNSERVED = {"BF16": "onnxruntime's Python API takes and gives no bfloat16 arrays"}
ONNX_UNSERVED = {"tensor(bfloat16)": "BF16"}
MAX_ELEMENTS = 1 << 24  # elements of one tensor, whatever the model
MAX_BYTES_ELEMENTS = 1 << 16  # BYTES elements in one tensor
MAX_DIMS = 32  # dimensions of one tensor (numpy itself stops at 64)


@dataclass(frozen=True)
class InputLimits:
    """What one input tensor may hold, checked on the message as received, before anything is decoded."""

    elements: int = MAX_ELEMENTS
    element_bytes: int | None = None  # each BYTES element, at most
    why: str = ""  # where `elements` comes from, said in the refusal


_DATATYPE_OF = {np.dtype(v).str: k for k, v in NUMPY_DTYPES.items() if k != "BYTES"}


def check_datatype(name: str, datatype: str) -> None:
    """InvalidArgument naming input `name` unless its `datatype` is one served."""
    if datatype in NUMPY_DTYPES:
        return
    if datatype in UNSERVED:
        raise InvalidArgument(f"input {quote(name)}: datatype {datatype} is not served: {UNSERVED[datatype]}")
    raise InvalidArgument(f"input {quote(name)}: unknown datatype {quote(datatype)}")


def datatype_of(array: np.ndarray) -> str:
    dtype = array.dtype
    if dtype.kind in "OSU":  # by kind: comparing with np.object_ builds a dtype every call
        return "BYTES"
    return _DATATYPE_OF[dtype.str]


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
