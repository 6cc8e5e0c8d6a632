"""The core of a kind written in Python, with its defaults: a subclass gives `compute`, and is a kind.

`PythonModel` serves the inputs and outputs config.json declares (`inputs`, `outputs`: name, datatype,
shape, -1 a dynamic dimension; a first dimension -1 on all of them is the batch axis unless
`max_batch_size` is 0). Each request's inputs are checked against them, `compute(inputs)` runs on a worker
thread, and the outputs it returns are checked against the declarations before they are answered: a
wrong one fails that request (INTERNAL, naming the output), never the server. No batching, no sessions:
a kind that needs them is written as the built-in ones are (service/models/tensor/). docs/kinds.md.
"""

from __future__ import annotations

import asyncio
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from service.datatypes import datatype_of
from service.errors import Internal, InvalidArgument, quote
from service.models.catalog import Context
from service.models.common import Metadata, ModelStats, Result, check_outputs, checked_feeds, has_batch_axis
from service.models.runtime import TensorSpec
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.config import BatchingConfig
from service.scheduling.leases import InFlight

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace

__all__ = ["PythonModel", "declared_spec"]

Tensors = dict[str, np.ndarray]


def declared_spec(declared: dict[str, Any]) -> TensorSpec:
    """A config.json declaration ({"name", "datatype", "shape"}) as a TensorSpec."""
    shape = tuple(declared["shape"])
    return TensorSpec(declared["name"], declared["datatype"], shape, (None,) * len(shape))


class PythonModel:
    """A version of a kind whose requests are computed by `compute`, in Python."""

    platform: ClassVar[str] = "python"  # ModelMetadata's platform
    provider: ClassVar[str] = "python"  # no onnxruntime provider
    compute_span: ClassVar[str] = "qkv.compute"

    def __init__(self, config: ModelConfig, context: Context) -> None:
        self.config, self.context = config, context
        self.name, self.version, self.kind = config.name, config.version, config.kind
        where = f"model '{config.name}' version {config.version}"
        if not config.inputs or not config.outputs:
            raise RepositoryError(f"{where}: a {config.kind} model needs config.json's inputs and outputs")
        self.inputs = [declared_spec(d) for d in config.inputs]
        self.outputs = [declared_spec(d) for d in config.outputs]
        batched = has_batch_axis(config, [*self.inputs, *self.outputs])
        given = config.batching.max_batch_size if "max_batch_size" in config.batching_given else 0
        self.max_batch_size = (given or BatchingConfig().max_batch_size) if batched else 0
        self.stats = ModelStats()
        self.in_flight = InFlight()

    def compute(self, inputs: Tensors) -> Tensors:
        """The outputs of one request's (checked) inputs, by name: every declared output."""
        raise NotImplementedError(f"{type(self).__name__}.compute")

    @cached_property
    def metadata(self) -> Metadata:
        """What the version is (ModelMetadata, ModelConfig): fixed once it is loaded."""
        return Metadata(
            self.kind, self.platform, self.provider, self.max_batch_size, self.inputs, self.outputs, self.compute_span
        )

    async def infer(
        self,
        inputs: Tensors,
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> Result:
        feeds = checked_feeds(self.inputs, inputs, self.name)
        check_outputs([o.name for o in self.outputs], outputs, self.name)
        rows = {a.shape[0] for a in feeds.values() if a.ndim} if self.max_batch_size else {1}
        if len(rows) > 1:
            raise InvalidArgument(f"inputs disagree on the batch size (axis 0): {sorted(rows)}")
        started = time.perf_counter_ns()
        answer = await asyncio.to_thread(self.compute, feeds)
        self.stats.executed(rows.pop() if rows else 1, time.perf_counter_ns() - started, by_size=False)
        wanted = outputs or [o.name for o in self.outputs]
        specs = {o.name: o for o in self.outputs}
        out = {}
        for name in wanted:
            array = answer.get(name) if isinstance(answer, dict) else None
            if not isinstance(array, np.ndarray):
                raise Internal(f"model '{self.name}' computed no array for output {quote(name)}")
            spec = specs[name]
            if datatype_of(array) != spec.datatype or array.ndim != len(spec.shape):
                raise Internal(
                    f"model '{self.name}' computed output {quote(name)} as {datatype_of(array)} "
                    f"{list(array.shape)}; it declares {spec.datatype} {list(spec.shape)}"
                )
            out[name] = array
        return Result(out, 0, 0, 0)
