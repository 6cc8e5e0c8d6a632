"""An ensemble: one request that runs several models in turn, tensors passed between them in the server.

config.json's `ensemble_scheduling` (service/repository/ensemble_config.py) lists the steps. A request
runs the steps that lead to the outputs it asks for, each as soon as the tensors it reads are there
(independent steps run at once). Each step is a request to its model through the server's data plane
(`Steps`): arrays in, arrays out, never re-encoded; the step's model batches it with its other
requests, counts it in its own metrics and statistics, and traces it as a child of the ensemble's
request. A step that fails fails the request, with the step and its model named. Before a step runs,
each output it is asked for is predicted from its inputs' shapes and its model's declarations
(service/models/output_bounds.py) and refused over the limit of a tensor: an intermediate is bounded
before it exists.

At load, the step models must be served, and every tensor must agree: each mapped name is an input or
output of its step's model, each ensemble tensor has one datatype and compatible shapes wherever it
is written and read, and every output a step writes has a size that its inputs or a declared limit
bound. A step model loaded later in another form is checked again by its requests.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from service.datatypes import MAX_ELEMENTS
from service.errors import FailedPrecondition, Internal, InvalidArgument, ServingError, quote
from service.models.base import declared_spec
from service.models.catalog import StepModel, Steps
from service.models.common import Metadata, ModelStats, Result, check_outputs, checked_feeds, has_batch_axis
from service.models.output_bounds import Declared, predicted, unbounded
from service.models.runtime import TensorSpec
from service.observability.metrics import ModelObserver
from service.repository.ensemble_config import EnsembleConfig, EnsembleStep
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.admission import Admission
from service.scheduling.config import BatchingConfig
from service.scheduling.leases import InFlight

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["EnsembleModel"]

Tensors = dict[str, np.ndarray]


def _agree(written: tuple[TensorSpec, str], read: TensorSpec, reader: str, tensor: str) -> None:
    """An ensemble tensor's writer and reader agree on its datatype and on every dimension both fix."""
    spec, writer = written
    if spec.datatype != read.datatype:
        raise RepositoryError(
            f"ensemble tensor '{tensor}': {reader} is {read.datatype}, but {writer} gives {spec.datatype}"
        )
    fixed = all(a < 0 or b < 0 or a == b for a, b in zip(spec.shape, read.shape, strict=False))
    if len(spec.shape) != len(read.shape) or not fixed:
        raise RepositoryError(
            f"ensemble tensor '{tensor}': {reader} has shape {list(read.shape)}, but {writer} gives {list(spec.shape)}"
        )


def _declared(model: StepModel) -> Declared:
    """What bounds a step model's outputs: its inputs, batch axis, and the limits its kind or config.json
    declares (an ensemble's outputs are each within MAX_ELEMENTS: its own steps are checked)."""
    axis_limits = getattr(model, "axis_limits", None)  # a kind that bounds its own axes (g2p's words)
    most = getattr(model, "max_output_elements", None)  # a kind that bounds its outputs whole (limits, an ensemble)
    return Declared(tuple(model.metadata.inputs), model.metadata.max_batch_size > 0, axis_limits or {}, most)


def _renamed(error: ServingError, message: str) -> ServingError:
    """`error` (its code and retry advice kept) saying `message`."""
    out = copy.copy(error)
    out.message, out.args = message, (message,)
    out.__cause__ = out.__context__ = out.__traceback__ = None
    return out


class EnsembleModel:
    """One version of an ensemble: its declared inputs and outputs, and its steps."""

    kind = "ensemble"
    platform = "ensemble"
    compute_span = "qkv.ensemble"
    max_output_elements = MAX_ELEMENTS  # each of its outputs: its own steps are held to the limit of a tensor
    provider = "ensemble"  # no sessions of its own: its steps' models have theirs

    def __init__(self, config: ModelConfig, steps: Steps | None, observer: ModelObserver) -> None:
        if config.ensemble is None or steps is None:
            raise RepositoryError(f"model '{config.name}': an ensemble needs its steps and a server to run them")
        self.config, self.ensemble, self._steps, self._observer = config, config.ensemble, steps, observer
        self.name, self.version = config.name, config.version
        self.inputs = [declared_spec(d) for d in config.inputs]
        self.outputs = [declared_spec(d) for d in config.outputs]
        batched = has_batch_axis(config, [*self.inputs, *self.outputs])
        given = config.batching.max_batch_size if "max_batch_size" in config.batching_given else 0
        self.max_batch_size = (given or BatchingConfig().max_batch_size) if batched else 0
        self.stats = ModelStats()
        self.in_flight = InFlight()
        # An ensemble queues nothing itself (its steps' models do): nothing here refuses a request.
        self.admission = Admission(self.name, BatchingConfig(), 1)

    # What the registry and the front ends ask of any version.

    def warm_up(self) -> None:
        """At load: the step models are served, and every tensor agrees between its writer and its readers."""
        self.check_steps(self.ensemble)

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        return None  # no scheduler of its own

    async def close(self) -> None:
        return None  # its requests are its steps', which their models finish

    def release(self) -> None:
        return None

    # The steps.

    def check_steps(self, ensemble: EnsembleConfig) -> None:
        where = f"model '{self.name}' version {self.version}"
        written = {s.name: (s, f"ensemble input '{s.name}'") for s in self.inputs}
        for step in ensemble.steps:
            try:
                model = self._steps.step_model(step.model_name, step.model_version)
            except ServingError as e:
                raise RepositoryError(f"{where}: {step.describe()}: {e.message}") from None
            ins, outs = {s.name: s for s in model.metadata.inputs}, {s.name: s for s in model.metadata.outputs}
            for model_tensor, tensor in step.input_map:
                if model_tensor not in ins:
                    raise RepositoryError(
                        f"{where}: {step.describe()}: input_map names input {quote(model_tensor)}, which the model "
                        f"does not have (inputs: {', '.join(sorted(ins))})"
                    )
                _agree(written[tensor], ins[model_tensor], f"{step.describe()} input '{model_tensor}'", tensor)
            unmapped = sorted(set(ins) - {k for k, _ in step.input_map})
            if unmapped:
                raise RepositoryError(f"{where}: {step.describe()}: input(s) {unmapped} are in no input_map")
            declared = _declared(model)
            for model_tensor, tensor in step.output_map:
                if model_tensor not in outs:
                    raise RepositoryError(
                        f"{where}: {step.describe()}: output_map names output {quote(model_tensor)}, which the "
                        f"model does not have (outputs: {', '.join(sorted(outs))})"
                    )
                why = unbounded(declared, outs[model_tensor])
                if why:
                    raise RepositoryError(
                        f"{where}: {step.describe()}: output {quote(model_tensor)}: {why}, so its size cannot be "
                        "known before the step runs (set limits.max_output_elements in the model's config.json)"
                    )
                written[tensor] = (outs[model_tensor], f"{step.describe()} output '{model_tensor}'")
            if self.max_batch_size > model.metadata.max_batch_size:
                raise RepositoryError(
                    f"{where}: {step.describe()}: the ensemble's max_batch_size {self.max_batch_size} exceeds its "
                    f"model's {model.metadata.max_batch_size}"
                    + (" (no batch axis)" if model.metadata.max_batch_size == 0 else "")
                )
        for s in self.outputs:
            _agree(written[s.name], s, f"ensemble output '{s.name}'", s.name)

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
        tensors = dict(checked_feeds(self.inputs, inputs, self.name))
        names = [o.name for o in self.outputs]
        check_outputs(names, outputs, self.name)
        rows = {a.shape[0] for a in tensors.values()} if self.max_batch_size else {1}
        if len(rows) > 1:
            raise InvalidArgument(f"inputs disagree on the batch size (axis 0): {sorted(rows)}")
        n = rows.pop()
        if self.max_batch_size and not 1 <= n <= self.max_batch_size:
            raise InvalidArgument(f"batch of {n}: model '{self.name}' takes 1 to max_batch_size {self.max_batch_size}")
        wanted = outputs or names
        started = time.perf_counter()
        seq_len = await self._run(self.ensemble.needed(wanted), tensors, params, deadline, trace)
        self.stats.executed(n, int((time.perf_counter() - started) * 1e9), by_size=False)
        return Result({o: tensors[o] for o in wanted}, seq_len, 0, 0)

    async def _run(
        self,
        steps: tuple[EnsembleStep, ...],
        tensors: Tensors,
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> int:
        """Run `steps`, each once the tensors it reads are in `tensors` (written there as steps end); the
        longest length any step counted."""
        waiting, running = list(steps), dict[asyncio.Future[tuple[Tensors, int]], EnsembleStep]()
        longest = 0
        try:
            while waiting or running:
                for step in [s for s in waiting if all(t in tensors for t in s.reads)]:
                    waiting.remove(step)
                    running[asyncio.ensure_future(self._step(step, tensors, params, deadline, trace))] = step
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    del running[task]
                    written, length = task.result()  # a failed step's error ends the request
                    tensors.update(written)
                    longest = max(longest, length)
        finally:
            for task in running:  # a step failed, or the request was cancelled: the others stop too
                task.cancel()
        return longest

    async def _step(
        self,
        step: EnsembleStep,
        tensors: Tensors,
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> tuple[Tensors, int]:
        feeds = {model_tensor: tensors[tensor] for model_tensor, tensor in step.input_map}
        asked = [model_tensor for model_tensor, _ in step.output_map]
        started = time.perf_counter()
        try:
            bounds = self._check_bounds(step, feeds, asked)
            answered, length = await self._steps.run_step(self.name, step, feeds, asked, params, deadline, trace)
            for name, most in bounds.items():
                if answered[name].size > most:
                    raise Internal(
                        f"output {quote(name)} holds {answered[name].size:,} elements, more than its model declares "
                        f"({most:,} for these inputs)"
                    )
        except ServingError as e:
            self._observer.step(step.position, step.model_name, e.code, time.perf_counter() - started)
            raise _renamed(e, f"ensemble '{self.name}' {step.describe()}: {e.message}") from None
        self._observer.step(step.position, step.model_name, "OK", time.perf_counter() - started)
        return {tensor: answered[model_tensor] for model_tensor, tensor in step.output_map}, length

    def _check_bounds(self, step: EnsembleStep, feeds: Tensors, asked: list[str]) -> dict[str, int]:
        """Each output the step is asked for, predicted from its inputs and its model's declarations, within
        the limit of a tensor: refused before the model runs (and allocates it), not at the next step.
        Returns each output's elements at most, which its answer is held to."""
        model = self._steps.step_model(step.model_name, step.model_version)
        declared, outs = _declared(model), {s.name: s for s in model.metadata.outputs}
        bounds = {}
        for name in asked:
            spec = outs.get(name)
            if spec is None:  # a model reloaded in another form: its own checks answer
                continue
            bound = predicted(declared, spec, feeds)
            if bound is None:  # (the load refused such a model; this one was reloaded in another form since)
                raise FailedPrecondition(
                    f"output {quote(name)}: {unbounded(declared, spec)}, since its model was reloaded: reload the "
                    "ensemble, or set limits.max_output_elements in the model's config.json"
                )
            if bound.elements > MAX_ELEMENTS:
                shape = f"shape up to {list(bound.shape)}, " if bound.shape is not None else ""
                raise InvalidArgument(
                    f"output {quote(name)} would hold {shape}{bound.elements:,} elements for these inputs, over "
                    f"the limit of {MAX_ELEMENTS:,} a tensor: refused before the step runs"
                )
            bounds[name] = bound.elements
        return bounds
