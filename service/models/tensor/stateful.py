"""A stateful tensor model: an ONNX graph served through the sequence batcher, when its config.json has
Triton's "sequence_batching" section (service/scheduling/sequence.py; docs/sequences.md).

The graph's control inputs (START, END, READY, CORRID) and implicit state inputs are filled by the server,
so clients neither see them in the model's metadata nor may send them. Each request is one row (batch
size 1) of the sequence named by its parameters `sequence_id` (an integer or a string), `sequence_start`
and `sequence_end`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from service.callers import CALLER
from service.datatypes import NUMPY_DTYPES
from service.errors import InvalidArgument, ServingError, quote
from service.models.common import Result, _as_strings, check_outputs, checked_feeds
from service.models.runtime import TensorRuntime
from service.models.tensor.model import TensorModel
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.sequence import SequenceBatcher, SequenceStep, initial_state

if TYPE_CHECKING:
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["StatefulTensorModel"]


class StatefulTensorModel(TensorModel):
    kind = "tensor"

    def __init__(
        self,
        config: ModelConfig,
        runtime: TensorRuntime,
        observer: ModelObserver,
        compute: ComputeThreads | None = None,
    ) -> None:
        super().__init__(config, runtime, observer, compute)
        sequence = config.sequence_batching
        assert sequence is not None
        self.sequence = sequence
        where = f"model '{self.name}' version {self.version}: sequence_batching"
        graph = {s.name: s for s in runtime.inputs}
        graph_outputs = {s.name for s in runtime.outputs}
        if not self.batchable:
            raise RepositoryError(f"{where} needs a batch axis (max_batch_size above 0): each request is one row")
        for c in sequence.controls:
            spec = graph.get(c.input_name)
            if spec is None:
                raise RepositoryError(f"{where}: control input '{c.input_name}' is not an input of the graph")
            if spec.datatype != c.datatype:
                raise RepositoryError(
                    f"{where}: control input '{c.input_name}' is {c.datatype} in config.json, "
                    f"{spec.datatype} in the graph"
                )
        for s in sequence.states:
            spec = graph.get(s.input_name)
            if spec is None or s.output_name not in graph_outputs:
                missing = s.input_name if spec is None else s.output_name
                raise RepositoryError(f"{where}: state tensor '{missing}' is not in the graph")
            if spec.datatype != s.datatype:
                raise RepositoryError(f"{where}: state '{s.input_name}' is {s.datatype}, the graph's {spec.datatype}")
        try:
            initial = {s.input_name: initial_state(s, config.directory.parent) for s in sequence.states}
        except ValueError as e:
            raise RepositoryError(f"{where}: {e}") from None
        self.graph_inputs = runtime.inputs
        self.inputs = [s for s in runtime.inputs if s.name not in sequence.hidden_inputs]  # what clients send
        self.sequencer = SequenceBatcher(
            self.name,
            sequence,
            self._run_steps,
            self.max_batch_size,
            len(runtime.sessions),
            initial=initial,
            observer=observer,
            compute=compute,
        )

    def warm_up(self, length: int = 64) -> None:
        """One row of ones through each instance: a graph that loads but cannot run is refused here.
        (No batching sweep: the sequence batcher has no settings to tune.)"""
        feeds = {}
        for s in self.graph_inputs:
            dims = [1 if d < 0 else d for d in s.shape]
            dims[0] = 1
            value = "1" if s.datatype == "BYTES" else 1
            feeds[s.name] = np.full(dims, value, dtype=NUMPY_DTYPES[s.datatype])
        try:
            for instance in range(len(self.runtime.sessions)):
                self.runtime.run(instance, feeds)
        except Exception as e:  # onnxruntime's own exception types
            raise RepositoryError(f"model '{self.name}' version {self.version}: warm-up failed: {e}") from e

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        """Sequences are served; `on_failure` hears if the batcher's dispatcher or reaper dies."""
        self.sequencer.on_failure = on_failure
        self.sequencer.start()

    async def close(self) -> None:
        await self.sequencer.close()
        await self.batcher.close()

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> Result:
        filled = sorted(set(inputs) & self.sequence.hidden_inputs)
        if filled:
            raise InvalidArgument(
                f"model '{self.name}': input {quote(filled[0])} is filled by the server (sequence_batching "
                "control or state); send only " + ", ".join(s.name for s in self.inputs)
            )
        feeds = checked_feeds(self.inputs, inputs, self.name)
        self._checked_limits(feeds)  # a bad row refused here, before it can fail the batch it would join
        names = [o.name for o in self.outputs]
        check_outputs(names, outputs, self.name)
        flags = {}
        for key in ("sequence_start", "sequence_end"):
            value = params.get(key, False)
            if not isinstance(value, bool):
                raise InvalidArgument(f"parameter '{key}' must be true or false, got {value!r}")
            flags[key] = value
        feeds = {
            s.name: _as_strings(feeds[s.name], s.name, self.name) if s.datatype == "BYTES" else feeds[s.name]
            for s in self.inputs
        }
        step = SequenceStep(
            params.get("sequence_id", 0),
            flags["sequence_start"],
            flags["sequence_end"],
            feeds,
            asyncio.get_running_loop().create_future(),
            tuple(outputs),
            caller=CALLER.get(),  # with --isolate-tokens, the sequence is this caller's
        )
        result = await self.sequencer.submit(step)
        if outputs:
            result = {k: v for k, v in result.items() if k in outputs}
        return Result(result, 0, 1, 0)  # a step has no sequence length of its own: no seq_len label

    def _run_steps(self, steps: list[SequenceStep], instance: int) -> list[dict[str, np.ndarray]]:
        """Runs on an instance thread: the rows stacked, one run, each row's outputs cut back out."""
        feeds = {}
        for s in self.graph_inputs:
            batch = np.concatenate([step.feeds[s.name] for step in steps])
            if len(s.shape) == 1 and batch.ndim == 2:  # a control the graph takes as [batch]
                batch = batch.reshape(-1)
            if batch.dtype == np.object_:  # onnxruntime takes a string tensor as str
                batch = np.vectorize(lambda x: x.decode() if isinstance(x, bytes) else x, otypes=[object])(batch)
            feeds[s.name] = batch
        names = [o.name for o in self.outputs]
        arrays = self.runtime.run(instance, feeds, names)
        self.stats.executed(len(steps), 0)
        return [
            {n: np.ascontiguousarray(a[i : i + 1]) for n, a in zip(names, arrays, strict=True)}
            for i in range(len(steps))
        ]
