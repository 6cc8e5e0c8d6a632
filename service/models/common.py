"""What every kind shares: a request's result, the per-model statistics, and the checks of a request's
inputs and outputs against what a model declares."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from service.datatypes import NUMPY_DTYPES, ONNX_UNSERVED, UNSERVED, datatype_of
from service.errors import InvalidArgument, quote
from service.models.runtime import TensorSpec
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.admission import WorkItem

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    pass

__all__ = ["Metadata", "ModelStats", "Result", "check_inputs", "check_outputs", "checked_feeds", "has_batch_axis"]

log = logging.getLogger("qkv.models")

MAX_REQUEST_ELEMENTS = 1 << 24  # elements of one input tensor, before any per-model limit


@dataclass(frozen=True)
class Metadata:
    """What a version is, as ModelMetadata and ModelConfig show it: fixed once it is loaded."""

    kind: str  # config.json's kind, shown in ModelConfig and the start-up line
    platform: str  # ModelMetadata's platform, before ':PROVIDER'
    provider: str  # the onnxruntime execution provider its sessions run on (or what runs it)
    max_batch_size: int  # 0: no batch axis
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    compute_span: str = "qkv.compute"  # the name of a traced request's compute span


@dataclass
class Result:
    outputs: dict[str, np.ndarray]
    seq_len: int  # what the latency histogram is split by; 0: no length, no seq_len label
    tokens_in: int
    tokens_out: int


@dataclass
class ModelStats:
    """Per-model counts and times for Triton's ModelStatistics (nanoseconds).

    Updated from every instance thread and from the event loop at once: each update takes the lock (an
    uncontended one costs little next to a batch), and readers take a `snapshot`, consistent as a whole."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    inference_count: int = 0  # rows
    execution_count: int = 0  # batch runs
    last_inference_ms: int = 0
    batches: dict[int, list[int]] = field(default_factory=dict)  # batch size -> [count, compute ns]
    request_compute_ns: int = 0  # summed over requests: each counts its whole batch, as Triton does
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def account_request(self, item: WorkItem) -> None:
        """A request answered by its batch: its time queued and its batch's compute."""
        started = item.started or item.arrived
        queued, computed = int((started - item.arrived) * 1e9), int((time.monotonic() - started) * 1e9)
        with self._lock:
            self.queue_ns += queued
            self.request_compute_ns += computed

    def executed(self, rows: int, ns: int, by_size: bool = True) -> None:
        """A batch of `rows` computed in `ns` (`by_size`: counted under its size too)."""
        now_ms = int(time.time() * 1000)
        with self._lock:
            self.inference_count += rows
            self.execution_count += 1
            self.compute_ns += ns
            self.last_inference_ms = now_ms
            if by_size:
                entry = self.batches.setdefault(rows, [0, 0])
                entry[0] += 1
                entry[1] += ns

    def answered(self, ok: bool, ns: int) -> None:
        """A request answered (`ok`) or failed, `ns` after it arrived."""
        with self._lock:
            if ok:
                self.success_count += 1
                self.success_ns += ns
            else:
                self.fail_count += 1
                self.fail_ns += ns

    def snapshot(self) -> ModelStats:
        """A copy of the counts as they are now, no update half made."""
        with self._lock:
            return replace(self, batches={k: list(v) for k, v in self.batches.items()}, _lock=threading.Lock())


def checked_feeds(
    specs: list[TensorSpec], inputs: dict[str, np.ndarray], model: str, optional: frozenset[str] = frozenset()
) -> dict[str, np.ndarray]:
    """`inputs` checked against the model's `specs`; an `optional` one (Triton's `optional: true`) may be
    left out, and the graph then runs without it."""
    check_inputs(sorted(s.name for s in specs), inputs, model)
    for s in specs:
        if s.name not in inputs:
            if s.name in optional:
                continue
            raise InvalidArgument(f"model '{model}': missing input '{s.name}'")
        a = inputs[s.name]
        if datatype_of(a) != s.datatype:
            raise InvalidArgument(f"input '{s.name}': datatype {datatype_of(a)}, model '{model}' expects {s.datatype}")
        if a.ndim != len(s.shape):
            raise InvalidArgument(
                f"input '{s.name}': shape {list(a.shape)} has {a.ndim} dimensions, model '{model}' expects "
                f"{len(s.shape)} ({list(s.shape)})"
            )
        for axis, (got, want) in enumerate(zip(a.shape, s.shape, strict=True)):
            if want >= 0 and got != want:
                raise InvalidArgument(
                    f"input '{s.name}': dimension {axis} is {got}, model '{model}' expects {want} ({list(s.shape)})"
                )
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise InvalidArgument(f"input '{s.name}': contains NaN or infinite values")
    return inputs


def check_inputs(names: list[str], given: Iterable[str], model: str) -> None:
    """InvalidArgument naming the first (by name) of the `given` inputs that the model (its inputs `names`)
    lacks."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidArgument(f"model '{model}' has no input {quote(unknown[0])} (inputs: {', '.join(names)})")


def check_outputs(names: list[str], asked: list[str], model: str) -> None:
    """InvalidArgument naming the first of the `asked` outputs that the model (its outputs `names`) lacks."""
    for o in asked:
        if o not in names:
            raise InvalidArgument(f"model '{model}' has no output {quote(o)} (outputs: {', '.join(names)})")


def has_batch_axis(config: ModelConfig, specs: list[TensorSpec]) -> bool:
    """Whether axis 0 of every input and output is a batch axis, as Triton decides it: max_batch_size 0 in
    config.json says there is none (shapes are served as declared); above 0, there is one and the graph must
    leave it dynamic; not given, there is one when every first dimension is dynamic (Triton's autocomplete)."""
    fixed = next((s for s in specs if not (s.shape and s.shape[0] < 0)), None)
    if "max_batch_size" not in config.batching_given:
        return fixed is None
    size = config.batching.max_batch_size
    where = f"model '{config.name}' version {config.version}"
    if size < 0:
        raise RepositoryError(f"{where}: max_batch_size must be >= 0 (0: the model has no batch axis), got {size}")
    if size > 0 and fixed is not None:
        first = f"first dimension {fixed.shape[0]}" if fixed.shape else "no dimension (a scalar)"
        raise RepositoryError(
            f"{where}: max_batch_size {size} needs a dynamic batch axis 0 on every input and output, but "
            f"'{fixed.name}' has {first} (shape {list(fixed.shape)}); set max_batch_size 0 to serve the shapes "
            "as declared, without a batch axis"
        )
    return size > 0


def _check_served(config: ModelConfig, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """Refuse at load a graph with an input or output of a datatype that is not served, naming it."""
    for what, specs in (("input", inputs), ("output", outputs)):
        for s in specs:
            if s.datatype in NUMPY_DTYPES:
                continue
            v2 = ONNX_UNSERVED.get(s.datatype)
            why = f"datatype {v2} is not served: {UNSERVED[v2]}" if v2 else "no v2 datatype carries it"
            raise RepositoryError(
                f"model '{config.name}' version {config.version}: {what} {quote(s.name)} is {s.datatype}: {why}"
            )


def _as_strings(array: np.ndarray, name: str, model: str) -> np.ndarray:
    """BYTES elements -> Python str, UTF-8 decoded: onnxruntime takes a string tensor as str (a bytes
    element would reach the graph as its repr, b'...')."""
    out = np.empty(array.size, dtype=np.object_)
    for i, x in enumerate(array.reshape(-1)):
        if isinstance(x, str):
            out[i] = x
            continue
        try:
            out[i] = bytes(x).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(
                f"input '{name}' element {i} is not valid UTF-8 (byte {e.start}): model '{model}' takes it as a "
                "string tensor"
            ) from None
    return out.reshape(array.shape)
