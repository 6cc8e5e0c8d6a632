"""Protocol tensors <-> numpy: typed contents, raw contents, and the answer's outputs.

The v2 protocol carries a tensor either in typed `contents` (one repeated field per type) or
as little-endian bytes in `raw_input_contents` (BYTES in the length-prefixed form of
service/datatypes.py). The datatypes themselves and the bounds on one tensor are service/datatypes.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from service.datatypes import (
    MAX_BYTES_ELEMENTS,
    MAX_DIMS,
    NUMPY_DTYPES,
    InputLimits,
    check_datatype,
    datatype_of,
    decode_bytes,
    encode_bytes,
)
from service.errors import InvalidArgument, quote

__all__ = ["CONTENTS_FIELD", "decode_tensor", "element_count", "fill_output"]

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
# Typed contents become an array this many values at a time: each slice is a bounded list of Python
# numbers, and a thread converting a large tensor lets the event loop run between two slices.
CONTENTS_SLICE = 1 << 16


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
    check_datatype(name, datatype)
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
            raise InvalidArgument(
                f"contents field must not be specified when using raw_input_contents for {quote(name)}: "
                "both typed contents and raw_input_contents given"
            )
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
