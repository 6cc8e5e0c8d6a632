"""The tensor kind: any ONNX graph (model.py), and a stateful one through the sequence batcher (stateful.py)."""

from __future__ import annotations

from functools import partial

from service.models.catalog import Context, Kind, ServedVersion
from service.models.runtime import TensorRuntime
from service.models.tensor.model import TensorModel
from service.models.tensor.stateful import StatefulTensorModel
from service.repository.layout import ModelConfig

__all__ = ["KIND", "StatefulTensorModel", "TensorModel"]


def _build(config: ModelConfig, context: Context) -> ServedVersion:
    # config.json sequence_batching: a stateful model, through the sequence batcher
    kind = TensorModel if config.sequence_batching is None else StatefulTensorModel
    runtime = context.compute.run_lowered(partial(TensorRuntime, config, context.providers))
    return kind(config, runtime, context.observer, context.compute)


KIND = Kind(_build, limits=("max_sequence_length", "vocab_size", "value_range", "max_output_elements"))
