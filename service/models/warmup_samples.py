"""A Triton config's `model_warmup` samples, run on every instance before the model reports ready.

Each sample (Triton's ModelWarmup, in its JSON form) names its inputs, each `zero_data`, `random_data` or
`input_data_file` (a file in the model's `warmup/` directory: raw row-major values; for TYPE_STRING each
element a 4-byte little-endian length, then its bytes), with its `dims`; a batching model gets
`batch_size` rows of it (default 1). Each runs `count` times (default 1) on each instance's session. A
sample that cannot be read or run stops the load, naming it, as in Triton. This is the config's
alternative to the warm-up each kind does from its graph (TensorModel.warm_up): both run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.datatypes import NUMPY_DTYPES, decode_bytes
from service.errors import ServingError
from service.repository.layout import RepositoryError

__all__ = ["MAX_SAMPLE_ELEMENTS", "run_warmup_samples", "sample_inputs", "warm_up_with_samples"]

log = logging.getLogger("qkv.models")

MAX_SAMPLE_ELEMENTS = 1 << 26  # one input of one sample: 64 Mi elements, bounded before it is made
MAX_COUNT = 1000


class _Runtime(Protocol):
    sessions: Sequence[Any]

    def run(
        self, instance: int, feeds: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> list[np.ndarray]: ...


def _datatype(name: str) -> str:
    return "BYTES" if name == "TYPE_STRING" else name.removeprefix("TYPE_")


def _input(name: str, raw: Mapping[str, Any], rows: int | None, directory: Path, at: str) -> np.ndarray:
    """One input of a sample: `rows` rows of `dims` (rows None: no batch axis)."""
    datatype = _datatype(str(raw.get("data_type", "TYPE_INVALID")))
    if datatype not in NUMPY_DTYPES:
        raise RepositoryError(f"{at}: data_type {raw.get('data_type')!r} is not a tensor type")
    dims = [int(d) for d in raw.get("dims", [])]
    if any(d < 0 for d in dims):
        raise RepositoryError(f"{at}: dims {dims} must be fixed (>= 0) in a warm-up sample")
    shape = ([rows] if rows is not None else []) + dims
    count = int(np.prod(shape, dtype=np.int64))
    if count > MAX_SAMPLE_ELEMENTS:
        raise RepositoryError(f"{at}: {count:,} elements, the limit is {MAX_SAMPLE_ELEMENTS:,}")
    dtype = NUMPY_DTYPES[datatype]
    if "input_data_file" in raw:
        path = (directory / "warmup" / str(raw["input_data_file"])).resolve()
        if path.parent != (directory / "warmup").resolve():
            raise RepositoryError(f"{at}: input_data_file must name a file in the model's warmup/ directory")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise RepositoryError(f"{at}: cannot read input_data_file {path.name}: {e}") from None
        one = int(np.prod(dims, dtype=np.int64))
        if datatype == "BYTES":
            try:
                values = decode_bytes(data, one, name)
            except ServingError as e:
                raise RepositoryError(f"{at}: input_data_file {path.name}: {e}") from None
        else:
            want = one * np.dtype(dtype).itemsize
            if len(data) != want:
                raise RepositoryError(f"{at}: input_data_file {path.name} holds {len(data)} bytes, dims need {want}")
            values = np.frombuffer(data, dtype=dtype)
        return np.broadcast_to(values.reshape(dims), shape).copy()
    if raw.get("random_data"):
        rng = np.random.default_rng(0)
        if datatype == "BYTES":
            return rng.integers(0, 10, size=shape).astype(str).astype(np.bytes_).astype(np.object_)
        if datatype == "BOOL":
            return rng.integers(0, 2, size=shape).astype(bool)
        if np.dtype(dtype).kind == "f":
            return rng.random(size=shape).astype(dtype)
        return rng.integers(0, 10, size=shape).astype(dtype)
    # zero_data, Triton's default
    if datatype == "BYTES":
        return np.full(shape, b"", dtype=np.object_)
    return np.zeros(shape, dtype=dtype)


def sample_inputs(sample: Mapping[str, Any], batched: bool, directory: Path, where: str) -> dict[str, np.ndarray]:
    """A sample's inputs, as arrays."""
    at = f"{where}: model_warmup '{sample.get('name', '')}'"
    rows = int(sample.get("batch_size", 1) or 1) if batched else None
    inputs = sample.get("inputs", {})
    if not inputs:
        raise RepositoryError(f"{at}: a warm-up sample needs inputs")
    return {name: _input(name, raw, rows, directory, f"{at} input '{name}'") for name, raw in inputs.items()}


def warm_up_with_samples(model: Any, samples: Sequence[Mapping[str, Any]], directory: Path) -> int:
    """The config's samples on a model's runtime (a tensor model's); 0 runs for a kind without one."""
    runtime = getattr(model, "runtime", None)
    if not samples or runtime is None or not hasattr(runtime, "sessions"):
        return 0
    where = f"model '{model.name}' version {model.version}"
    return run_warmup_samples(runtime, samples, model.max_batch_size > 0, directory, where)


def run_warmup_samples(
    runtime: _Runtime, samples: Sequence[Mapping[str, Any]], batched: bool, directory: Path, where: str
) -> int:
    """Run each sample `count` times on each of `runtime`'s sessions; returns the runs made."""
    runs = 0
    for sample in samples:
        feeds = sample_inputs(sample, batched, directory, where)
        count = min(int(sample.get("count", 1) or 1), MAX_COUNT)
        for instance in range(len(runtime.sessions)):
            for _ in range(count):
                try:
                    runtime.run(instance, feeds)
                except Exception as e:  # onnxruntime's own exception types
                    raise RepositoryError(
                        f"{where}: model_warmup '{sample.get('name', '')}' failed on instance {instance}: {e}"
                    ) from None
                runs += 1
    if runs:
        log.info("%s: %d warm-up run(s) of the config's model_warmup samples", where, runs)
    return runs
