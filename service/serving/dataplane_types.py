"""The data plane's request and answer, free of any transport: what gRPC and REST decode into.

An input's elements are not in the request: it holds a `TensorSource`, where they are, read only once the
model is known and the tensor's declared shape has passed that model's limits. A gRPC message's tensor
(service/frontends/grpc_codec.py), REST's binary data or JSON values (service/frontends/codec.py), a
shared-memory region (service/frontends/shared_memory.py) and an array handed over in the process
(`ArraySource`) are sources: none of them is a protobuf message but gRPC's own. Inputs, outputs and
parameters are sequences and mappings so that a front end may hand them over as views of its message: the
data plane counts them (len, which builds nothing) before it reads any.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from service.callers import Caller
from service.datatypes import MAX_BYTES_ELEMENTS, MAX_DIMS, InputLimits, check_datatype, datatype_of
from service.errors import InvalidArgument, quote

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace

__all__ = [
    "ArraySource",
    "InferInput",
    "InferRequest",
    "InferResponse",
    "Parameter",
    "RequestedOutput",
    "TensorSource",
    "TraceCarrier",
    "checked_shape",
]

Parameter = bool | int | float | str  # the protocol's InferParameter choices
TraceCarrier = Mapping[str, str] | Iterable[tuple[str, str]]  # HTTP headers or gRPC metadata


def checked_shape(name: str, datatype: str, dims: Sequence[int], limits: InputLimits) -> tuple[tuple[int, ...], int]:
    """An input's declared shape and its element count, every count checked against `limits` before
    anything is allocated (zeros aside, so [0, 2**62] is refused too: numpy could not hold it)."""
    check_datatype(name, datatype)
    if len(dims) > MAX_DIMS:  # counted before the shape becomes Python ints
        raise InvalidArgument(f"input {quote(name)}: shape has {len(dims)} dimensions, the limit is {MAX_DIMS}")
    shape = tuple(map(int, dims))
    if shape and min(shape) < 0:
        raise InvalidArgument(f"input {quote(name)}: negative dimension in shape {list(shape)}")
    count, extent = 1, 1
    for d in shape:
        count *= d
        extent *= max(d, 1)
        if extent > limits.elements:
            aside = " (zero dimensions aside)" if 0 in shape else ""
            unit = "BYTES elements" if datatype == "BYTES" else "elements"
            why = f": {limits.why}" if limits.why else ""
            raise InvalidArgument(
                f"input {quote(name)}: shape {list(shape)} exceeds the limit of {limits.elements} {unit}{aside}{why}"
            )
    if datatype == "BYTES" and count > MAX_BYTES_ELEMENTS:
        # Decoding BYTES is a Python loop per element: bound it before it can hold the event loop.
        raise InvalidArgument(f"input {quote(name)}: {count} BYTES elements, the limit is {MAX_BYTES_ELEMENTS}")
    return shape, count


class TensorSource(Protocol):
    """Where an input tensor's elements are, not yet read."""

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        """The elements as an array of the declared `shape`, each count checked against `limits` before
        any element is touched; InvalidArgument naming the input when they do not match."""
        ...


@dataclass(frozen=True)
class ArraySource:
    """Elements already in an array of this process (a caller of the data plane that holds numpy)."""

    array: np.ndarray

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        shape, _ = checked_shape(name, datatype, shape, limits)
        if self.array.shape != shape or datatype_of(self.array) != datatype:
            raise InvalidArgument(
                f"input {quote(name)}: an array of {datatype_of(self.array)} {list(self.array.shape)}, declared "
                f"{datatype} {list(shape)}"
            )
        return self.array


@dataclass(frozen=True)
class InferInput:
    """One input tensor as declared (datatype and shape unchecked until read), and where its elements are."""

    name: str
    datatype: str
    shape: Sequence[int]
    source: TensorSource

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> InferInput:
        """An in-process array as an input."""
        return cls(name, datatype_of(array), array.shape, ArraySource(array))

    @property
    def elements(self) -> int:
        """The elements the shape declares, counted without building it (0 when it is invalid: `read` says
        why)."""
        if len(self.shape) > MAX_DIMS or (self.shape and min(self.shape) < 0):
            return 0
        return math.prod(self.shape)

    def read(self, limits: InputLimits) -> np.ndarray:
        return self.source.read(self.name, self.datatype, self.shape, limits)


@dataclass(frozen=True)
class RequestedOutput:
    """An output the client asked for, and its parameters (REST's binary_data; shared memory, later)."""

    name: str
    parameters: Mapping[str, Parameter] = field(default_factory=dict)


@dataclass
class InferRequest:
    """One inference request, as every front end hands it to the data plane.

    `deadline`: time.monotonic() by which it must be answered (None: no deadline). `trace_context`: the
    call's metadata or headers, read only for a W3C trace context when the server traces; `method`: what
    the trace calls the call (the RPC's name, or HTTP's "POST /v2/models/{model}/infer"). A step of an
    ensemble's request names the ensemble in `step_of` (it was admitted with it) and is traced under
    `parent_trace`, the ensemble request's. `caller`: whose token sent it, with --isolate-tokens (None
    otherwise): the state a model keeps for it across requests (a sequence) is that caller's alone."""

    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: Sequence[InferInput] = ()
    outputs: Sequence[RequestedOutput] = ()
    parameters: Mapping[str, Parameter] = field(default_factory=dict)
    deadline: float | None = None
    trace_context: TraceCarrier | None = None
    method: str = "ModelInfer"
    step_of: str = ""
    parent_trace: RequestTrace | None = None
    caller: Caller | None = None

    _elements: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def elements(self) -> int:
        """The elements its inputs declare, counted once: whether it is large is asked more than once.
        (Not functools.cached_property, which takes a lock on every first read.)"""
        if self._elements is None:
            self._elements = sum(t.elements for t in self.inputs)
        return self._elements


@dataclass
class InferResponse:
    """A request's answer: its outputs, in the model's order, as arrays (their datatype is the array's)."""

    model_name: str
    model_version: str
    id: str
    outputs: dict[str, np.ndarray]
    seq_len: int = 0  # the length the model counted the request by (the latency histogram's bucket)
