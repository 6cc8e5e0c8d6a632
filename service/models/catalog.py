"""What a served model version is to the rest of the server, the capabilities a kind may add, and the kinds.

`ServedVersion` is the core every version answers: its identity, configuration, the tensors it declares,
its statistics and admission, and one `infer`, with its start and stop. What only some kinds do is a
capability, a Protocol of its own (`TakesText`, `TunesBatching`, ...): the server asks `capability(model,
Cap)`, never a kind's name or a model's tensors.

A kind is a `Kind` (its factory, its `limits` keys, the config.json sections it reads), found by
config.json's `kind`: a built-in name (`BUILT_IN`, each the kind's own package), a name registered in the
Python entry point group `qkv.kinds`, or an import path `module:attribute` naming a `Kind` or a class
built as `cls(config, context)` (service/models/base.py gives such a class its defaults; docs/kinds.md).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from service.datatypes import InputLimits
from service.errors import ConfigError, ServingError
from service.models.common import Metadata, ModelStats, Result
from service.models.response_cache import ResponseCache
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.ensemble_config import EnsembleStep
from service.repository.layout import ModelConfig, load_model
from service.scheduling.config import BatchingConfig
from service.scheduling.leases import InFlight

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = [
    "BATCHING_SHOWN",
    "BUILT_IN",
    "ENTRY_POINTS",
    "AdmitsEarly",
    "CachesParts",
    "Context",
    "Kind",
    "KindFactory",
    "Lifecycle",
    "LimitsInputs",
    "Metadata",
    "ServedVersion",
    "ShowsParameters",
    "StepModel",
    "Steps",
    "TakesText",
    "TextAnswer",
    "TextAsk",
    "Tokenizes",
    "TunesBatching",
    "build",
    "capability",
    "check",
    "find_kind",
    "input_limits",
    "lifecycle",
    "load_checked",
    "recognised",
]

# The batching settings a kind that tunes them shows (ModelConfig parameters, qkv_batching_setting).
BATCHING_SHOWN = ("max_batch_size", "token_budget", "max_queue_delay_ms", "inline_max_tokens")
# The built-in kinds, each `module:attribute` of its package's Kind: the one list of them.
BUILT_IN = {
    "tensor": "service.models.tensor:KIND",
    "g2p": "service.models.g2p:KIND",
    "ensemble": "service.models.ensemble:KIND",
    "text": "service.models.text:KIND",
    "generation": "service.models.generation.model:KIND",
}
ENTRY_POINTS = "qkv.kinds"  # the entry point group an installed package registers its kinds in
# The built-in kinds asked, most particular first, whether a folder whose config names no kind is theirs;
# FOLDER_KIND serves any other (an ONNX graph, tensors in and out).
RECOGNISING = ("ensemble", "generation", "text")
FOLDER_KIND = "tensor"


Tensors = dict[str, np.ndarray]


class StepModel(Protocol):
    """What an ensemble's load-time checks read of a step's model."""

    @property
    def name(self) -> str: ...
    @property
    def metadata(self) -> Metadata: ...


class Steps(Protocol):
    """The server, as an ensemble sees it: its served models, and a request to one of them."""

    def step_model(self, name: str, version: str) -> StepModel:
        """The version a step names ("" for the newest ready one); a ServingError saying why not."""
        ...

    async def run_step(
        self,
        ensemble: str,
        step: EnsembleStep,
        inputs: Tensors,
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> tuple[Tensors, int]:
        """`step`'s model run on `inputs` (its own tensor names): the `outputs` asked for, and the length the
        model counts the request by; a ServingError when it fails."""
        ...


class ServedVersion(Protocol):
    """The core of one loaded version of a model, whatever its kind: numpy arrays in, numpy arrays out. What
    only some kinds do is a capability below, found with `capability(model, Cap)`."""

    in_flight: InFlight  # leases of requests between their lookup and their answer (the data plane's)

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def config(self) -> ModelConfig: ...
    @property
    def metadata(self) -> Metadata: ...  # kind, platform, provider, max_batch_size, inputs and outputs
    @property
    def stats(self) -> ModelStats: ...

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


@dataclass(frozen=True)
class Kind:
    """A model kind: how a version of it is built, and what of config.json it reads beyond the common keys."""

    build: KindFactory  # sessions built (at compute priority, through context.compute), not yet warm
    limits: tuple[str, ...] = ()  # the keys its config.json `limits` may hold
    sections: tuple[str, ...] = ()  # the config.json sections only it reads ("text")
    # A version folder whose config names no kind is this kind's when its platform is one of these (Triton's
    # "ensemble"), or when `recognises` says the folder's files are its (an exported text model).
    platforms: tuple[str, ...] = ()
    recognises: Callable[[Path], bool] | None = None


# Capabilities: what some kinds do beyond the core, each asked for by `capability(model, Cap)`.


@runtime_checkable
class Lifecycle(Protocol):
    """A kind with sessions or a scheduler: warmed at load, started once served, closed and released."""

    def warm_up(self) -> None: ...

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        """Its scheduler begins; `on_failure` hears if the scheduler dies."""
        ...

    async def close(self) -> None: ...

    def release(self) -> None: ...


@runtime_checkable
class AdmitsEarly(Protocol):
    """A kind that queues requests: it refuses one early, before its tensors are decoded, when its queue
    cannot take it by its `deadline` (a ServingError saying why)."""

    def admit_early(self, deadline: float | None) -> None: ...


@runtime_checkable
class TunesBatching(Protocol):
    """A kind that batches requests: the batching in force (ModelConfig's dynamic batching)."""

    def batching(self) -> BatchingConfig: ...

    def batching_sources(self) -> dict[str, str] | None:
        """Each BATCHING_SHOWN setting -> where its value came from, for a kind that tunes its batching;
        None for one that does not (its settings are not shown)."""
        ...


@runtime_checkable
class LimitsInputs(Protocol):
    """A kind that bounds its inputs before they are decoded (beyond the limit of any tensor)."""

    def input_limits(self, name: str) -> InputLimits: ...


@runtime_checkable
class ShowsParameters(Protocol):
    """A kind that adds to its ModelConfig's parameters (the version of its text rules, its task...)."""

    def config_parameters(self) -> dict[str, str]: ...


@runtime_checkable
class CachesParts(Protocol):
    """A kind that keeps parts of its answers in the response cache itself: the server keeps no whole ones."""

    def caches_parts(self) -> bool: ...


@runtime_checkable
class TakesText(Protocol):
    """A kind that answers Triton's generate extension from one text, word by word (generate and
    generate_stream): what a request of one text is, and what its answer says."""

    def text_words(self, text: str) -> list[tuple[str, str]]:
        """Each whitespace-separated token of `text` that holds a word, with the word as the model reads it."""
        ...

    def max_text_words(self) -> int:
        """The words one request may hold."""
        ...

    def text_io(self, detailed: bool) -> tuple[str, tuple[str, ...]]:
        """A request's text input, and the outputs it asks for (`detailed`: each word's answer too)."""
        ...

    def text_answer(self, outputs: Mapping[str, np.ndarray]) -> tuple[str, list[dict[str, str]] | None]:
        """An answer's text_output, and each word's answer (word, phonemes, source, reason) when it has them."""
        ...


@dataclass(frozen=True)
class TextAsk:
    """What a text endpoint asks a model of a task: texts (or token ids, one list a text), the query a reranker
    scores them against, and whether the answer counts each text's tokens."""

    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()  # instead of texts: each text's token ids, checked by the model
    query: str | None = None
    counts: bool = False


@dataclass(frozen=True)
class TextAnswer:
    """A text model's answer to a `TextAsk`, one row a text."""

    values: np.ndarray  # embed: FP32 [N, D] embeddings; classify: [N, C] scores; rerank: [N] scores
    tokens: np.ndarray  # INT64 [N]: the tokens each text ran as (empty unless the ask counts them)
    truncated: np.ndarray  # INT64 [N]: the tokens cut from each text (empty unless the ask counts them)
    labels: tuple[str, ...] = ()  # classify: each class's label


@runtime_checkable
class Tokenizes(Protocol):
    """A kind that reads texts with a tokenizer for a task (embed, classify, rerank): the text endpoints'. A
    task is one request through the data plane: `task_io` gives its inputs and the outputs it asks for,
    `task_answer` reads them."""

    def text_task(self) -> str: ...

    def tokenize(self, texts: list[str], special: bool = True) -> list[list[dict[str, Any]]]:
        """Each text's tokens: id, text, whether special, character span; an InvalidArgument naming `inputs`
        when there are more texts, or longer ones, than a request may hold."""
        ...

    def task_io(self, ask: TextAsk) -> tuple[dict[str, np.ndarray], list[str]]:
        """The inputs of a request that asks `ask`, and the outputs it asks for (an InvalidArgument when a
        text cannot be one)."""
        ...

    def task_answer(self, outputs: Mapping[str, np.ndarray]) -> TextAnswer:
        """The answer a request of `task_io` got."""
        ...


Cap = TypeVar("Cap")


@cache
def _offers(kind: type, cap: type) -> bool:
    return all(callable(getattr(kind, name, None)) for name in _members(cap))


@cache
def _members(cap: type) -> tuple[str, ...]:
    return tuple(n for n in vars(cap) if not n.startswith("_") and callable(getattr(cap, n)))


def capability(model: object, cap: Callable[..., Cap]) -> Cap | None:
    """`model` as capability `cap` (a Protocol above) when its class offers every method of `cap`, else None;
    decided once a class and capability."""
    return cast("Cap", model) if _offers(cast("Any", type(model)), cast("type", cap)) else None


class _Still:
    """The lifecycle of a kind without one: nothing to warm, start, close or release."""

    def warm_up(self) -> None:
        return None

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        return None

    async def close(self) -> None:
        return None

    def release(self) -> None:
        return None


_STILL = _Still()


def lifecycle(model: object) -> Lifecycle:
    """`model`'s warm-up, start, close and release: its kind's, or nothing to do."""
    return capability(model, Lifecycle) or _STILL


def input_limits(model: object, name: str) -> InputLimits:
    """What input `name` of `model` may hold: its kind's limits, or the limit of any tensor."""
    limited = capability(model, LimitsInputs)
    return InputLimits() if limited is None else limited.input_limits(name)


def _config_file(config: ModelConfig) -> Path:
    return config.directory.parent / ("config.pbtxt" if config.triton is not None else "config.json")


def find_kind(name: str, file: Path | str | None = None) -> Kind:
    """The kind config.json's `kind` names: built in, registered (entry point group qkv.kinds), or
    `module:attribute`; a ConfigError naming `file` and the key when there is none."""
    at = "" if file is None else f"{file}: "
    target = BUILT_IN.get(name)
    if target is None and ":" not in name:
        found = importlib.metadata.entry_points(group=ENTRY_POINTS, name=name)
        if not found:
            raise ConfigError(
                "kind",
                f"{at}kind {name!r}: no such kind (built in: {', '.join(BUILT_IN)}; or one an installed package "
                f"registers in the entry point group {ENTRY_POINTS}; or an import path, module:attribute)",
                file,
            )
        target = next(iter(found)).value
    module, _, attribute = (target or name).partition(":")
    try:
        found_object = getattr(importlib.import_module(module), attribute)
    except ImportError as e:
        raise ConfigError("kind", f"{at}kind {name!r}: cannot import {module!r}: {e}", file) from None
    except AttributeError:
        raise ConfigError("kind", f"{at}kind {name!r}: module {module!r} has no {attribute!r}", file) from None
    if isinstance(found_object, Kind):
        return found_object
    if isinstance(found_object, type) and callable(getattr(found_object, "infer", None)):
        return Kind(build=cast("KindFactory", found_object), sections=getattr(found_object, "sections", ()))
    raise ConfigError(
        "kind", f"{at}kind {name!r}: {target or name} is not a kind (a Kind, or a class with an infer method)", file
    )


def check(config: ModelConfig) -> Kind:
    """`config` against its kind's schema: the kind exists, and its limits and sections are its kind's; a
    ConfigError naming the file and the key."""
    config = recognised(config)
    file = _config_file(config)
    kind = find_kind(config.kind, file)
    unknown = sorted(set(config.limits) - set(kind.limits))
    if unknown:
        raise ConfigError(
            f"limits.{unknown[0]}",
            f"{file}: unknown limit(s) {unknown} for a {config.kind} model; known: {sorted(kind.limits)}",
            file,
        )
    for section, given in (("text", bool(config.text)), ("ensemble_scheduling", config.ensemble is not None)):
        if given and section not in kind.sections:
            owner = next((n for n in BUILT_IN if section in find_kind(n).sections), "another")
            raise ConfigError(
                section,
                f"{file}: {section} is a section of the {owner} kind's config, not of a {config.kind} model",
                file,
            )
    return kind


def recognised(config: ModelConfig) -> ModelConfig:
    """`config` with its kind: the one config.json names, else the first of RECOGNISING whose platforms or
    files the version folder matches, else FOLDER_KIND."""
    if config.kind:
        return config
    for name in RECOGNISING:
        kind = find_kind(name)
        if config.platform in kind.platforms or (kind.recognises is not None and kind.recognises(config.directory)):
            return replace(config, kind=name)
    return replace(config, kind=FOLDER_KIND)


def load_checked(directory: Path, raw: dict[str, Any] | None = None) -> list[ModelConfig]:
    """The configurations of the model in `directory` (layout.load_model), each checked against its kind."""
    configs = load_model(directory, raw, recognised)
    for config in configs:
        check(config)
    return configs


def build(config: ModelConfig, context: Context) -> ServedVersion:
    """A version of `config.kind`, sessions built, not yet warm (`check` refuses a config its kind cannot use)."""
    return check(config).build(config, context)
