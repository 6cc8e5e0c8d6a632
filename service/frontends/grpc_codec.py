"""gRPC's tensors <-> numpy: an InferInputTensor's typed or raw contents as the data plane's source, and an
output's metadata on an InferOutputTensor (its contents there, or in its shared memory region). The raw bytes
themselves are service/frontends/codec.py's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from service import protocol
from service.datatypes import NUMPY_DTYPES, InputLimits, datatype_of
from service.errors import InvalidArgument, quote
from service.frontends.codec import check_element_bytes, output_bytes, raw_array
from service.frontends.shared_memory import RequestMemory
from service.serving.dataplane_types import Parameter, checked_shape

__all__ = ["CONTENTS_FIELD", "MessageSource", "fill_output", "place_output", "set_parameters"]

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


def _typed(values: Sequence[bool | int | float], dtype: DTypeLike, count: int) -> np.ndarray:
    """A repeated protobuf field of numbers -> a 1-d array, CONTENTS_SLICE values at a time."""
    if count <= CONTENTS_SLICE:
        return np.asarray(values, dtype=dtype)
    out = np.empty(count, dtype=dtype)
    for start in range(0, count, CONTENTS_SLICE):
        out[start : start + CONTENTS_SLICE] = values[start : start + CONTENTS_SLICE]
    return out


@dataclass(frozen=True)
class MessageSource:
    """An InferInputTensor of a gRPC message: its typed contents, or its raw contents (`raw` gives a copy
    out of the message, asked for only once the shape passed its limits). `refused`: why its raw contents
    cannot be matched to it (the message's counts disagree)."""

    tensor: protocol.ModelInferRequest.InferInputTensor
    raw: Callable[[], bytes] | None
    refused: str = ""

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        if self.refused:
            raise InvalidArgument(self.refused)
        checked, count = checked_shape(name, datatype, shape, limits)
        if self.raw is not None:
            if self.tensor.HasField("contents"):
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for {quote(name)}: "
                    "both typed contents and raw_input_contents given"
                )
            return raw_array(name, datatype, checked, count, self.raw(), limits)
        return _contents_array(self.tensor, name, datatype, checked, count, limits)


def _contents_array(
    tensor: protocol.ModelInferRequest.InferInputTensor,
    name: str,
    datatype: str,
    shape: tuple[int, ...],
    count: int,
    limits: InputLimits,
) -> np.ndarray:
    """An InferInputTensor's typed contents -> an array of its checked `shape`."""
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
        check_element_bytes(name, elements, limits.element_bytes)
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


def fill_output(tensor: protocol.ModelInferResponse.InferOutputTensor, array: np.ndarray) -> bytes:
    """Set name-independent metadata of an output tensor; return its raw little-endian bytes."""
    tensor.datatype = datatype_of(array)
    tensor.shape.extend(array.shape)
    return output_bytes(array)


def set_parameters(target: Mapping[str, protocol.InferParameter], params: Mapping[str, Parameter]) -> None:
    """Plain parameter values into a message's map of InferParameter, each in the field its type says."""
    for key, value in params.items():
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int):
            target[key].int64_param = value
        elif isinstance(value, float):
            target[key].double_param = value
        else:
            target[key].string_param = value


def place_output(
    memory: RequestMemory | None, tensor: protocol.ModelInferResponse.InferOutputTensor, array: np.ndarray
) -> bytes:
    """An output's metadata on `tensor`, and its raw contents for the answer: b"" for one written into its shared
    memory region, whose parameters then say where (every output keeps its entry in raw_output_contents, as
    Triton's do)."""
    data = fill_output(tensor, array)
    placed = memory.write(tensor.name, data) if memory is not None else None
    if placed is None:
        return data
    set_parameters(tensor.parameters, placed)
    return b""
