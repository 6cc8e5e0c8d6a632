"""The protocol's raw tensor bytes <-> numpy, for every transport.

The data plane reads an input through a `TensorSource` (service/serving/dataplane_types.py): REST's binary
data is a `RawSource` (a view of the body, not a copy), its JSON data a `FlatSource` (an array of the declared
datatype, built as the body is parsed); a gRPC message's tensor is service/frontends/grpc_codec.py's `MessageSource`.

The v2 protocol carries a tensor either in typed `contents` (one repeated field per type, gRPC's alone) or
as little-endian bytes (`raw_input_contents`, REST's binary data; BYTES in the length-prefixed form of
service/datatypes.py). The datatypes themselves and the bounds on one tensor are service/datatypes.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from service.datatypes import (
    NUMPY_DTYPES,
    InputLimits,
    datatype_of,
    decode_bytes,
    encode_bytes,
)
from service.errors import InvalidArgument, quote
from service.serving.dataplane_types import checked_shape

__all__ = ["FlatSource", "RawSource", "check_element_bytes", "output_bytes", "raw_array"]

# Each numeric datatype's numpy type as it travels (little-endian) and as this machine holds it.
_WIRE_DTYPES = {
    name: (np.dtype(t).newbyteorder("<"), np.dtype(t).newbyteorder("="))
    for name, t in NUMPY_DTYPES.items()
    if name != "BYTES"
}


def raw_array(
    name: str, datatype: str, shape: tuple[int, ...], count: int, raw: bytes | memoryview, limits: InputLimits
) -> np.ndarray:
    """A tensor's little-endian bytes (BYTES: length-prefixed) -> an array of its checked `shape`: a view of
    `raw` (read-only) where this machine is little-endian and the bytes lie aligned for their type, else a copy."""
    if datatype == "BYTES":
        return decode_bytes(bytes(raw), count, name, limits.element_bytes).reshape(shape)
    dtype, native = _WIRE_DTYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidArgument(
            f"input {quote(name)}: raw contents are {len(raw)} bytes, shape {list(shape)} of {datatype} needs "
            f"{count * dtype.itemsize}"
        )
    array = np.frombuffer(raw, dtype=dtype).astype(native, copy=False)
    if not array.flags.aligned:  # binary data after a JSON header of any length: onnxruntime wants it aligned
        array = array.copy()
    return array.reshape(shape)


@dataclass(frozen=True)
class RawSource:
    """An input's elements as the protocol's raw bytes (REST's binary data: a view of the body), read in place."""

    raw: bytes | memoryview

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        checked, count = checked_shape(name, datatype, shape, limits)
        return raw_array(name, datatype, checked, count, self.raw, limits)


def check_element_bytes(name: str, elements: Iterable[bytes], limit: int | None) -> None:
    """InvalidArgument naming the first BYTES element longer than `limit` (None: no limit)."""
    if limit is None:
        return
    for i, b in enumerate(elements):
        if len(b) > limit:
            raise InvalidArgument(f"input {quote(name)} element {i}: {len(b)} bytes, the limit is {limit}")


@dataclass(frozen=True)
class FlatSource:
    """An input's elements already as a flat array of its declared datatype (REST's JSON `data`, converted as
    it was parsed; generate's text): shaped on read, once its count matches the checked shape."""

    flat: np.ndarray

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        checked, count = checked_shape(name, datatype, shape, limits)
        if self.flat.size != count:
            raise InvalidArgument(
                f"input {quote(name)}: {self.flat.size} values in data, shape {list(checked)} needs {count}"
            )
        if datatype == "BYTES":
            check_element_bytes(name, self.flat.tolist(), limits.element_bytes)
        return self.flat.reshape(checked)


def output_bytes(array: np.ndarray) -> bytes:
    """An output's elements as the protocol carries them: little-endian, BYTES length-prefixed."""
    if datatype_of(array) == "BYTES":
        return encode_bytes(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
