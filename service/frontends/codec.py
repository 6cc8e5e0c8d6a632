"""The protocol's raw tensor bytes <-> numpy, for every transport.

The data plane reads an input through a `TensorSource` (service/serving/dataplane_types.py): REST's raw or
JSON data is a `RawSource`; a gRPC message's tensor is service/frontends/grpc_codec.py's `MessageSource`.

The v2 protocol carries a tensor either in typed `contents` (one repeated field per type, gRPC's alone) or
as little-endian bytes (`raw_input_contents`, REST's binary data; BYTES in the length-prefixed form of
service/datatypes.py). The datatypes themselves and the bounds on one tensor are service/datatypes.py.
"""

from __future__ import annotations

from collections.abc import Sequence
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

__all__ = ["RawSource", "output_bytes", "raw_array"]

# Each numeric datatype's numpy type as it travels (little-endian) and as this machine holds it.
_WIRE_DTYPES = {
    name: (np.dtype(t).newbyteorder("<"), np.dtype(t).newbyteorder("="))
    for name, t in NUMPY_DTYPES.items()
    if name != "BYTES"
}


def raw_array(
    name: str, datatype: str, shape: tuple[int, ...], count: int, raw: bytes, limits: InputLimits
) -> np.ndarray:
    """A tensor's little-endian bytes (BYTES: length-prefixed) -> an array of its checked `shape`."""
    if datatype == "BYTES":
        return decode_bytes(raw, count, name, limits.element_bytes).reshape(shape)
    dtype, native = _WIRE_DTYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidArgument(
            f"input {quote(name)}: raw contents are {len(raw)} bytes, shape {list(shape)} of {datatype} needs "
            f"{count * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype).astype(native, copy=False).reshape(shape)


@dataclass(frozen=True)
class RawSource:
    """An input's elements as the protocol's raw bytes: REST's binary data, or its JSON data converted."""

    raw: bytes | memoryview

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        checked, count = checked_shape(name, datatype, shape, limits)
        return raw_array(name, datatype, checked, count, bytes(self.raw), limits)


def output_bytes(array: np.ndarray) -> bytes:
    """An output's elements as the protocol carries them: little-endian, BYTES length-prefixed."""
    if datatype_of(array) == "BYTES":
        return encode_bytes(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
