"""What a served model version is to the rest of the server, and the table of kinds that build one.

`ServedVersion` is all the registry, the data plane, the front ends and the metrics may ask of a model
version; nothing above this package names a kind. `KINDS` maps config.json's `kind` to the factory that
builds a version of it (sessions loaded at compute priority): a new kind is one module and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from service.datatypes import InputLimits
from service.errors import ServingError
from service.models.common import ModelStats, Result
from service.models.ensemble.model import EnsembleModel, Steps
from service.models.g2p.model import G2PModel
from service.models.g2p.runtime import G2PRuntime
from service.models.generation.model import build_generation_model
from service.models.response_cache import ResponseCache
from service.models.runtime import TensorRuntime, TensorSpec
from service.models.tensor.model import TensorModel
from service.models.tensor.stateful import StatefulTensorModel
from service.models.text import build_text_model
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig
from service.scheduling.admission import Admission
from service.scheduling.config import BatchingConfig
from service.scheduling.leases import InFlight

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["BATCHING_SHOWN", "KINDS", "Context", "KindFactory", "ServedVersion", "Steps", "build"]

# The batching settings a kind that tunes them shows (ModelConfig parameters, qkv_batching_setting).
BATCHING_SHOWN = ("max_batch_size", "token_budget", "max_queue_delay_ms", "inline_max_tokens")


class ServedVersion(Protocol):
    """One loaded version of a model, whatever its kind: numpy arrays in, numpy arrays out."""

    in_flight: InFlight  # leases of requests between their lookup and their answer (the data plane's)

    @property
    def kind(self) -> str: ...  # config.json's kind, shown in ModelConfig and the start-up line
    @property
    def platform(self) -> str: ...  # ModelMetadata's platform, before ':PROVIDER'
    @property
    def compute_span(self) -> str: ...  # the name of a traced request's compute span
    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def config(self) -> ModelConfig: ...
    @property
    def inputs(self) -> list[TensorSpec]: ...
    @property
    def outputs(self) -> list[TensorSpec]: ...
    @property
    def max_batch_size(self) -> int: ...  # 0: no batch axis
    @property
    def stats(self) -> ModelStats: ...
    @property
    def admission(self) -> Admission: ...  # refuses early, before a request's tensors are decoded

    def batching(self) -> BatchingConfig:
        """The batching in force."""
        ...

    def batching_sources(self) -> dict[str, str] | None:
        """Each BATCHING_SHOWN setting -> where its value came from, for a kind that tunes its batching;
        None for one that does not (its settings are not shown)."""
        ...

    def input_limits(self, name: str) -> InputLimits:
        """What input `name` may hold, checked before it is decoded."""
        ...

    def config_parameters(self) -> dict[str, str]:
        """What the kind adds to its ModelConfig's parameters (g2p: the version of its text rules)."""
        ...

    def text_words(self, text: str) -> list[tuple[str, str]] | None:
        """For a kind that takes text (Triton's generate extension): each whitespace-separated token of
        `text` that holds a word, with the word as the model reads it; None for a kind that takes none."""
        ...

    def max_text_words(self) -> int:
        """The words one request of a text kind may hold (0 for other kinds)."""
        ...

    def warm_up(self) -> None: ...
    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        """Its scheduler begins; `on_failure` hears if the scheduler dies."""
        ...

    async def close(self) -> None: ...
    def release(self) -> None: ...

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> Result: ...


Cache = ResponseCache[Any] | None  # the server's response cache, for a kind that keeps answers itself


@dataclass(frozen=True)
class Context:
    """What the server hands a kind's factory besides the version's configuration."""

    providers: list[Any]  # onnxruntime's execution providers, in order of preference
    observer: ModelObserver  # the version's metrics
    cache: Cache = None  # the response cache, for a kind that keeps answers itself
    steps: Steps | None = None  # the served models, for a kind that runs others (an ensemble)
    compute: ComputeThreads = field(default_factory=ComputeThreads)  # the server's compute threads


KindFactory = Callable[[ModelConfig, Context], ServedVersion]


def _tensor(config: ModelConfig, context: Context) -> ServedVersion:
    # config.json sequence_batching: a stateful model, through the sequence batcher
    kind = TensorModel if config.sequence_batching is None else StatefulTensorModel
    runtime = context.compute.run_lowered(partial(TensorRuntime, config, context.providers))
    return kind(config, runtime, context.observer, context.compute)


def _g2p(config: ModelConfig, context: Context) -> ServedVersion:
    runtime = context.compute.run_lowered(partial(G2PRuntime, config, context.providers))
    model = G2PModel(config, runtime, context.observer, context.compute)
    model.cache = context.cache if config.response_cache else None  # it keeps each word's answer
    return model


def _ensemble(config: ModelConfig, context: Context) -> ServedVersion:
    return EnsembleModel(config, context.steps, context.observer)


def _text(config: ModelConfig, context: Context) -> ServedVersion:
    return build_text_model(config, context.providers, context.observer, context.compute)


def _generation(config: ModelConfig, context: Context) -> ServedVersion:
    return build_generation_model(config, context.providers, context.observer, context.compute)


KINDS: dict[str, KindFactory] = {
    "tensor": _tensor,
    "g2p": _g2p,
    "ensemble": _ensemble,
    "text": _text,
    "generation": _generation,
}


def build(config: ModelConfig, context: Context) -> ServedVersion:
    """A version of `config.kind` (layout.py has refused unknown kinds), sessions built, not yet warm."""
    return KINDS[config.kind](config, context)
