# Over 500 lines: config.json's schema, every key in one place, as docs/configuration.md lists them.
"""The model repository: one directory per model, numbered versions, an optional config.json.

    models/NAME/config.json      kind, batching, instances, limits, model card (all optional)
    models/NAME/1/model.onnx     a tensor model (inputs and outputs read from the graph)
    models/NAME/1/encoder.onnx   ... or the g2p kind's graphs and vocabularies
    models/NAME/2/...            another version
    models/NAME/1/               an ensemble's version: empty (its config.json names the steps' models)

Which versions are served is the model's version policy (config.json "version_policy", Triton's
names): the newest one by default, the N newest, all, or specific ones.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from service.observability.metrics import UNKNOWN_MODEL
from service.priority import default_instances
from service.repository.ensemble_config import MAX_STEPS, EnsembleConfig, EnsembleConfigError, parse_ensemble_scheduling
from service.repository.triton_config import (
    TritonConfigError,
    TritonTranslation,
    gives_max_batch_size,
    is_triton_form,
    log_left_aside,
    parse_json,
    read_pbtxt,
    translate,
)
from service.scheduling.config import PADDING, BatchingConfig
from service.scheduling.priorities import Priorities
from service.scheduling.sequence_config import SequenceConfig, SequenceConfigError, parse_sequence_batching

__all__ = [
    "ModelConfig",
    "RepositoryError",
    "VersionPolicy",
    "as_integer",
    "config_fingerprint",
    "dependencies",
    "fingerprint",
    "folder_json",
    "load_model",
    "load_model_config",
    "load_repository",
    "model_cards",
    "model_directories",
    "parse_config",
]

log = logging.getLogger("qkv.repository")

# A config.json (a file, or a load request's 'config' parameter): bounded before anything walks it. Real
# ones are a few KiB, four levels deep.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32


class RepositoryError(Exception):
    """A model that cannot be served: the server refuses to start."""


def folder_json(path: Path, where: str, limit: int) -> dict[str, Any]:
    """A JSON object from an exported folder ({} when the file is absent), refused over `limit` bytes before
    it is read."""
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > limit:
            raise RepositoryError(f"{where}: {path.name} is over {limit:,} bytes")
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RepositoryError(f"{where}: cannot read {path.name}: {e}") from None
    if not isinstance(value, dict):
        raise RepositoryError(f"{where}: {path.name} must hold a JSON object")
    return value


PRECISIONS = ("fp32", "int8")  # int8: the same graphs with int8 weights (export/quantize.py), beside them


@dataclass(frozen=True)
class VersionPolicy:
    """Which numbered versions of a model are served (config.json "version_policy", as Triton writes it):
    {"latest": {"num_versions": N}}, {"all": {}} or {"specific": {"versions": [1, 3]}}."""

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    @classmethod
    def parse(cls, raw: Any, where: str) -> VersionPolicy:
        if not isinstance(raw, dict) or len(raw) != 1:
            raise RepositoryError(f"{where}: version_policy must be one of latest, all or specific, got {_shown(raw)}")
        [(kind, body)] = raw.items()
        body = body or {}
        keys = {"latest": {"num_versions"}, "all": set(), "specific": {"versions"}}.get(kind)
        if keys is not None and isinstance(body, dict) and set(body) - keys:
            raise RepositoryError(
                f"{where}: unknown setting(s) {sorted(set(body) - keys)} in version_policy.{kind}; "
                f"known: {sorted(keys)}"
            )
        if kind == "latest" and isinstance(body, dict):
            n = body.get("num_versions", 1)
            number = as_integer(n)
            if number is not None and number >= 1:
                return cls("latest", num_versions=number)
            raise RepositoryError(
                f"{where}: version_policy.latest.num_versions must be an integer >= 1, got {_shown(n)}"
            )
        elif kind == "all" and isinstance(body, dict):
            return cls("all")
        elif kind == "specific" and isinstance(body, dict):
            versions = body.get("versions")
            numbers = [as_integer(v) for v in versions] if isinstance(versions, list) else []
            chosen = sorted({v for v in numbers if v is not None and v >= 0})
            if chosen and len(chosen) == len(set(numbers)):
                return cls("specific", versions=tuple(chosen))
            raise RepositoryError(
                f"{where}: version_policy.specific.versions must be a list of version numbers (integers >= 0), "
                f"got {_shown(versions)}"
            )
        raise RepositoryError(
            f'{where}: version_policy {_shown(raw)} is not {{"latest": {{"num_versions": N >= 1}}}}, '
            '{"all": {}} or {"specific": {"versions": [numbers]}}'
        )

    def choose(self, available: list[int], where: str) -> list[int]:
        """The versions to serve, oldest first, from the numbered directories `available`."""
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "latest":
            return ordered[-self.num_versions :]
        missing = sorted(set(self.versions) - set(ordered))
        if missing:
            raise RepositoryError(
                f"{where}: version_policy names version(s) {missing} that have no directory (present: {ordered})"
            )
        return list(self.versions)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    kind: str  # "" until the kinds recognise the folder (models/catalog.py `recognised`), when config.json names none
    version: str
    directory: Path  # the version directory
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # onnxruntime sessions running batches concurrently; unset in config.json: priority.default_instances
    instances: int = 2
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    # Tensor models on CPU: the intra-op threads of one more session, which a batch running alone on an idle
    # server uses (None: every core the process may use; 0, or no more than intra_op_threads: none).
    lone_request_threads: int | None = None
    optimization: str = "all"  # onnxruntime graph optimisation level: disable, basic, extended, all
    precision: str = "fp32"  # fp32, or int8: the graphs' int8 copies beside them (model.int8.onnx, ...)
    sequence_axis: int | None = None  # tensor models: the axis padded when batching different lengths
    limits: dict[str, Any] = field(default_factory=dict)  # per kind: lengths, sizes, vocab_size per input
    card: dict[str, Any] = field(default_factory=dict)
    batching_given: frozenset[str] = frozenset()  # the batching keys config.json set: tuning leaves them
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    # Tensor models: what the graph's inputs and outputs must be ({"name", "datatype", "shape"}, -1 for a
    # dynamic dimension); a version whose graph differs is refused.
    inputs: tuple[dict[str, Any], ...] = ()
    outputs: tuple[dict[str, Any], ...] = ()
    response_cache: bool = False  # config.json {"response_cache": {"enable": true}}: answers kept (--cache-size)
    # Tensor models: Triton's "sequence_batching" (a stateful model, service/scheduling/sequence.py); None: stateless.
    sequence_batching: SequenceConfig | None = None
    # Ensembles: Triton's "ensemble_scheduling", the steps' models and how tensors flow between them.
    ensemble: EnsembleConfig | None = None
    # Read from a Triton config (config.pbtxt, or config.json in Triton's JSON form): the file's config in
    # Triton's JSON form, which the ModelConfig answer starts from; None for qkv's own config.json.
    triton: dict[str, Any] | None = None
    device: str = ""  # "cuda": instance_group KIND_GPU; "": the server's --device
    accelerators: tuple[str, ...] = ()  # onnxruntime providers tried first (optimization.execution_accelerators)
    session: dict[str, bool] = field(default_factory=dict)  # onnxruntime backend parameters: execution_mode, ...
    warmup: tuple[dict[str, Any], ...] = ()  # model_warmup's samples, in Triton's JSON form
    priorities: Priorities | None = None  # dynamic_batching's priority levels and queue policies
    preferred_batch_sizes: tuple[int, ...] = ()  # dynamic_batching.preferred_batch_size: batches cut to them
    # Text models: config.json's "text" section, read by the kind (service/models/text/settings.py).
    text: dict[str, Any] = field(default_factory=dict)
    platform: str = ""  # Triton's platform, where the config gives one ("ensemble": the ensemble kind's)


def _integer(value: Any) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


INT64 = (-(1 << 63), (1 << 63) - 1)
# Protobuf's JSON form writes a 64-bit integer as a decimal string, and so do Triton's JSON model configs.
_DECIMAL = re.compile(r"-?[0-9]{1,19}")


def as_integer(value: Any) -> int | None:
    """`value` as a 64-bit integer: a JSON integer, or a decimal string ("8", "-1"); None for anything else
    (a bool, a float, "8.5", "abc", a value past 64 bits)."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        value = int(value)
    if _integer(value) and INT64[0] <= value <= INT64[1]:
        return int(value)
    return None


def _shown(value: Any) -> str:
    """A config value as a message quotes it: its JSON, cut short."""
    try:
        text = json.dumps(value)
    except ValueError:  # only values json.loads gives reach here; kept total for safety
        text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _finite(value: Any) -> bool:
    # json.loads accepts NaN and Infinity, which no setting means
    return (_integer(value) or isinstance(value, float)) and math.isfinite(value)


# A setting's declared type -> (the value as that type, or None when it is not; how a message names it).
_TYPES: dict[str, tuple[Any, str]] = {
    "bool": (lambda v: v if isinstance(v, bool) else None, "true or false"),
    "int": (as_integer, "an integer"),
    "float": (lambda v: v if _finite(v) else None, "a number"),  # NaN and Infinity are none
    "str": (lambda v: v if isinstance(v, str) else None, "a string"),
    "dict[str, Any]": (lambda v: v if isinstance(v, dict) else None, "a JSON object"),
}


def _typed_value(declared: str, value: Any, key: str, where: str) -> Any:
    """`value` as the type `declared` (an integer may be a decimal string), or a RepositoryError naming the
    key (its dotted path), the value and the type."""
    optional = declared.endswith(" | None")
    if optional:
        if value is None:
            return None
        declared = declared.removesuffix(" | None")
    convert, wanted = _TYPES[declared]
    converted = convert(value)
    if converted is None:
        raise RepositoryError(f"{where}: {key} must be {wanted}{' or null' * optional}, got {_shown(value)}")
    return converted


def _typed(cls: type, values: dict[str, Any], where: str, section: str = "") -> dict[str, Any]:
    """`values` for the fields of `cls`, each converted to its field's type (a bool is no number), or a
    RepositoryError naming the key; `section`: the keys' dotted prefix ("batching.")."""
    known = {f.name: str(f.type) for f in fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise RepositoryError(
            f"{where}: unknown setting(s) {sorted(unknown)} in {section.rstrip('.') or 'the top level'}; "
            f"known: {sorted(known)}"
        )
    return {key: _typed_value(known[key], value, section + key, where) for key, value in values.items()}


# What config.json may hold at the top level: the keys load_model_config reads (a test holds them equal).
_TOP_LEVEL = ("name", "kind", "batching", "max_batch_size", "model_card", "version_policy", "inputs", "outputs",
              "instances", "intra_op_threads", "inter_op_threads", "lone_request_threads", "optimization",
              "precision", "sequence_axis", "limits", "response_cache", "sequence_batching", "ensemble_scheduling",
              "platform", "text")  # fmt: skip
# Triton's model configuration fields that qkv does not read: a config written for Triton loads, and the
# server says what it leaves aside. ("name", "max_batch_size" and "version_policy" are read.)
TRITON_FIELDS = frozenset({
    "platform", "backend", "runtime", "input", "output", "batch_input", "batch_output", "dynamic_batching",
    "instance_group", "default_model_filename", "cc_model_filenames",
    "metric_tags", "parameters", "model_warmup", "model_operations", "model_transaction_policy",
    "model_repository_agents",
})  # fmt: skip
OPTIMIZATIONS = ("disable", "basic", "extended", "all")
ENSEMBLE_PLATFORM = "ensemble"  # Triton's platform of an ensemble, the one platform qkv reads
_DECLARATION_KEYS = ("name", "datatype", "shape")
# Triton's optional fields of a declaration: an input's image layout, a shape the graph sees instead of the
# client's, and an output's class labels (one a line, in the model's directory) for classification.
_OPTIONAL_KEYS = {"inputs": ("format", "reshape", "optional"), "outputs": ("reshape", "label_filename")}
FORMATS = ("FORMAT_NONE", "FORMAT_NCHW", "FORMAT_NHWC")
MAX_LABELS_BYTES = 16 << 20  # a labels file is read whole at load


def _top_level(raw: dict[str, Any], where: str) -> None:
    """Refuse a key config.json has no use for (a misspelt one would be silently ignored); log Triton's."""
    unknown = sorted(k for k in raw if k not in _TOP_LEVEL and k not in TRITON_FIELDS)
    if unknown:
        close = {k: get_close_matches(k, _TOP_LEVEL, 1) for k in unknown}
        hints = [f"{k!r} (did you mean {near[0]!r}?)" for k, near in close.items() if near]
        raise RepositoryError(
            f"{where}: unknown setting(s) {unknown}{': ' + ', '.join(hints) if hints else ''}; "
            f"known: {sorted(_TOP_LEVEL)} (and Triton's fields, which qkv does not read)"
        )
    # platform is read for "ensemble" alone; any other says nothing qkv uses
    triton = sorted(k for k in raw if k in TRITON_FIELDS and not (k == "platform" and raw[k] == ENSEMBLE_PLATFORM))
    if triton:
        log.warning("%s: Triton's setting(s) %s are not read by qkv (docs/configuration.md)", where, triton)


def _limits(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """limits: each an integer, vocab_size an object of integers, value_range one of ranges (which keys a
    model may set is its kind's: service/models/catalog.py `check`)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "vocab_size":
            if not isinstance(value, dict):
                raise RepositoryError(
                    f"{where}: limits.vocab_size must be a JSON object of input name -> size, got {_shown(value)}"
                )
            out[key] = {k: _typed_value("int", v, f"limits.vocab_size.{k}", where) for k, v in value.items()}
        elif key == "value_range":
            out[key] = _value_ranges(value, where)
        else:
            out[key] = _typed_value("int", value, f"limits.{key}", where)
    return out


def _value_ranges(raw: Any, where: str) -> dict[str, tuple[float, float]]:
    """limits.value_range: input name -> [lowest, highest], two numbers in order."""
    if not isinstance(raw, dict):
        raise RepositoryError(f"{where}: limits.value_range must be a JSON object of input name -> [lowest, highest], "
                              f"got {_shown(raw)}")  # fmt: skip
    out = {}
    for name, bounds in raw.items():
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(map(_finite, bounds)) and bounds[0] <= bounds[1]):
            raise RepositoryError(
                f"{where}: limits.value_range.{name} must be [lowest, highest], two numbers in order, "
                f"got {_shown(bounds)}"
            )
        out[name] = (float(bounds[0]), float(bounds[1]))
    return out


def parse_config(text: str | bytes) -> Any:
    """A config.json's text -> its value, within MAX_CONFIG_BYTES and MAX_CONFIG_DEPTH; or ValueError saying what
    is wrong (json.loads itself recurses: its RecursionError is caught, and what parsed is walked without
    recursion, before anything else walks it)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"{len(text):,} bytes, the limit is {MAX_CONFIG_BYTES:,}")
    deep = ValueError(f"nested deeper than {MAX_CONFIG_DEPTH} levels, the limit")
    try:
        raw = json.loads(text)
    except RecursionError:
        raise deep from None
    stack: list[tuple[Any, int]] = [(raw, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        if children and depth >= MAX_CONFIG_DEPTH:
            raise deep
        stack.extend((child, depth + 1) for child in children)
    return raw


def load_model_config(model_dir: Path, version: str | None = None, raw: dict[str, Any] | None = None) -> ModelConfig:
    """The configuration of one version of the model in `model_dir` (the newest when `version` is None).

    `raw`: a parsed config.json to use instead of the file (a load request may carry one)."""
    name = model_dir.name
    if name == UNKNOWN_MODEL:
        raise RepositoryError(
            f"model '{name}': the name is reserved (the metrics count requests for models the server does "
            "not have under it); rename the directory"
        )
    numbered = available_versions(model_dir)
    if not numbered:
        raise RepositoryError(f"model '{name}': no numbered version directory in {model_dir}")
    chosen = version if version is not None else str(max(numbered))
    where = f"model '{name}'"
    if raw is not None and not isinstance(raw, dict):
        raise RepositoryError(f"{where}: the configuration must be a JSON object, got {type(raw).__name__}")
    triton = triton_config(model_dir, where, raw)
    if triton is not None:
        raw = triton.raw
    elif raw is None:
        raw = read_config(model_dir / "config.json", where)
    at = f"{where}: {'config.json' if triton is None else triton.source}"
    _top_level(raw, at)  # every value is checked against its type before anything reads it
    platform = _typed_value("str", raw.get("platform", ""), "platform", at)  # Triton's: only "ensemble" says anything
    # "": the kind the version folder's files say, which the kinds themselves recognise (models/catalog.py)
    kind = _typed_value("str", raw.get("kind", ""), "kind", at)
    _typed_value("str", raw.get("name", ""), "name", at)  # Triton's; the directory names the model
    if not isinstance(raw.get("batching", {}), dict):
        raise RepositoryError(f"{at}: batching must be a JSON object, got {_shown(raw['batching'])}")
    batching = _typed(BatchingConfig, raw.get("batching", {}), at, "batching.")
    if batching.get("padding", PADDING[0]) not in PADDING:
        raise RepositoryError(
            f"{at}: batching.padding must be one of {', '.join(PADDING)}, got {_shown(batching['padding'])}"
        )
    if "max_batch_size" in raw:
        batching.setdefault("max_batch_size", _typed_value("int", raw["max_batch_size"], "max_batch_size", at))
    settings: dict[str, Any] = {
        k: raw[k]
        for k in ("instances", "intra_op_threads", "inter_op_threads", "lone_request_threads", "optimization",
                  "precision", "sequence_axis", "limits")
        if k in raw
    }  # fmt: skip
    settings = _typed(ModelConfig, settings, at)
    if "instances" not in settings:
        settings["instances"] = default_instances(settings.get("intra_op_threads", ModelConfig.intra_op_threads))
    if "limits" in settings:
        settings["limits"] = _limits(settings["limits"], at)
    card = raw.get("model_card", {})
    if not isinstance(card, dict):
        raise RepositoryError(f"{at}: model_card must be a JSON object, got {_shown(card)}")
    if settings.get("precision", "fp32") not in PRECISIONS:
        raise RepositoryError(f"{at}: unknown precision '{settings['precision']}' (one of {', '.join(PRECISIONS)})")
    if settings.get("optimization", "all") not in OPTIMIZATIONS:
        raise RepositoryError(
            f"{at}: unknown optimization '{settings['optimization']}' (one of {', '.join(OPTIMIZATIONS)})"
        )
    inputs = _tensor_declarations(raw["inputs"], "inputs", at, model_dir) if "inputs" in raw else ()
    outputs = _tensor_declarations(raw["outputs"], "outputs", at, model_dir) if "outputs" in raw else ()
    cached = raw.get("response_cache", {})
    if not isinstance(cached, dict) or set(cached) - {"enable"}:
        raise RepositoryError(f'{at}: response_cache must be {{"enable": true or false}}, got {_shown(cached)}')
    response_cache = _typed_value("bool", cached.get("enable", False), "response_cache.enable", at)
    sequence = None
    if "sequence_batching" in raw:
        try:
            sequence = parse_sequence_batching(raw["sequence_batching"])
        except SequenceConfigError as e:
            raise RepositoryError(f"{at}: {e}") from None
    ensemble = _ensemble(raw.get("ensemble_scheduling"), name, inputs, outputs, at)
    text = raw.get("text", {})
    if not isinstance(text, dict):  # read by the kind that has the section (models/catalog.py `check`)
        raise RepositoryError(f"{at}: text must be a JSON object, got {_shown(text)}")
    policy = VersionPolicy()
    if "version_policy" in raw:
        policy = VersionPolicy.parse(raw["version_policy"], at)
    extras: dict[str, Any] = {}
    if triton is not None:
        log_left_aside(at, triton.logged)
        extras = {"triton": triton.triton, **triton.extras}
    return ModelConfig(
        name=name,
        kind=kind,
        platform=platform,
        version=chosen,
        directory=model_dir / chosen,
        batching=BatchingConfig(**batching),
        card=card,
        batching_given=frozenset(batching),
        version_policy=policy,
        inputs=inputs,
        outputs=outputs,
        response_cache=response_cache,
        sequence_batching=sequence,
        ensemble=ensemble,
        text=text,
        **settings,
        **extras,
    )


def triton_config(model_dir: Path, where: str, raw: dict[str, Any] | None = None) -> TritonTranslation | None:
    """The model's Triton config translated (from `raw`, a load request's, when given; else config.pbtxt,
    or a config.json in Triton's JSON form); None when the config is qkv's own form. A directory holding
    both config.pbtxt and config.json is refused: which one wins would be a guess."""
    pbtxt, json_path = model_dir / "config.pbtxt", model_dir / "config.json"
    try:
        if raw is None:
            if pbtxt.exists() and json_path.exists():
                raise RepositoryError(
                    f"{where}: {model_dir} holds both config.pbtxt (Triton's) and config.json; keep one: qkv "
                    "reads either, and would have to guess which one you meant"
                )
            if pbtxt.exists():
                at = f"{where}: config.pbtxt"
                message, text = read_pbtxt(pbtxt, at, MAX_CONFIG_BYTES)
                unbatched = gives_max_batch_size(text) and message.max_batch_size == 0
                return translate(message, at, _providers(), "config.pbtxt", unbatched)
            raw = read_config(json_path, where)
        if not is_triton_form(raw):
            return None
        at = f"{where}: config.json"
        unbatched = as_integer(raw.get("max_batch_size")) == 0
        return translate(parse_json(raw, at), at, _providers(), "config.json", unbatched)
    except TritonConfigError as e:
        raise RepositoryError(str(e)) from None


def _providers() -> list[str]:
    """onnxruntime's execution providers in this installation."""
    import onnxruntime as ort  # imported when a Triton config needs it

    return list(ort.get_available_providers())


def _ensemble(
    raw: Any,
    name: str,
    inputs: tuple[dict[str, Any], ...],
    outputs: tuple[dict[str, Any], ...],
    at: str,
) -> EnsembleConfig | None:
    """An ensemble's steps, where config.json gives them (a kind without the section refuses them: catalog.check)."""
    if raw is None:
        return None
    try:
        return parse_ensemble_scheduling(raw, name, [d["name"] for d in inputs], [d["name"] for d in outputs])
    except EnsembleConfigError as e:
        raise RepositoryError(f"{at}: {e}") from None


def dependencies(model_dir: Path, raw: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The models the model in `model_dir` runs as steps (an ensemble's), read from its config.json (or
    `raw`, a load request's) without checking the rest: a config that does not parse has none here, and its
    load says why."""
    try:
        triton = triton_config(model_dir, model_dir.name, raw)
        if triton is not None:
            raw = triton.raw
        elif raw is None:
            raw = read_config(model_dir / "config.json", model_dir.name)
        config = raw.get("ensemble_scheduling")
        steps = config.get("step") if isinstance(config, dict) else None
        if not isinstance(steps, list):
            return ()
        names = [s.get("model_name") for s in steps[:MAX_STEPS] if isinstance(s, dict)]
        return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))
    except RepositoryError:
        return ()


def read_config(path: Path, where: str) -> dict[str, Any]:
    """config.json parsed ({} when there is none), or a RepositoryError naming the file and the problem."""
    if not path.exists():
        return {}
    try:
        raw = parse_config(path.read_bytes())
    except (ValueError, OSError) as e:
        raise RepositoryError(f"{where}: {path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise RepositoryError(f"{where}: {path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def _dims(raw: Any, at: str, where: str) -> list[int]:
    """A shape: a list of integers, -1 for a dynamic dimension (decimal strings accepted)."""
    if not isinstance(raw, list):
        raise RepositoryError(f"{where}: {at} must be a list of integers, got {_shown(raw)}")
    dims = [_typed_value("int", n, f"{at}[{j}]", where) for j, n in enumerate(raw)]
    bad = [n for n in dims if n < -1]
    if bad:
        raise RepositoryError(f"{where}: {at}[{dims.index(bad[0])}] must be -1 (dynamic) or >= 0, got {bad[0]}")
    return dims


def read_labels(path: Path, at: str, where: str) -> tuple[str, ...]:
    """An output's class labels, one a line; the file is bounded before it is read."""
    try:
        size = path.stat().st_size
        if size > MAX_LABELS_BYTES:
            raise RepositoryError(f"{where}: {at}: {path.name} is {size:,} bytes, the limit is {MAX_LABELS_BYTES:,}")
        return tuple(path.read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError) as e:
        raise RepositoryError(f"{where}: {at}: cannot read {path.name}: {e}") from None


def _tensor_declarations(raw: Any, section: str, where: str, model_dir: Path) -> tuple[dict[str, Any], ...]:
    """inputs / outputs: [{"name": str, "datatype": str, "shape": [int, ...]}], dims -1 for dynamic (a dim
    may be a decimal string, as protobuf's JSON writes 64-bit integers); optionally Triton's `format`
    (inputs), `reshape` ({"shape": [...]}) and `label_filename` (outputs: read here, kept as `labels`)."""
    form = '[{"name": ..., "datatype": ..., "shape": [...]}]'
    if not isinstance(raw, list):
        raise RepositoryError(f"{where}: {section} must be a list {form}, got {_shown(raw)}")
    known = (*_DECLARATION_KEYS, *_OPTIONAL_KEYS[section])
    out = []
    for i, d in enumerate(raw):
        at = f"{section}[{i}]"
        if not isinstance(d, dict):
            raise RepositoryError(f"{where}: {at} must be a JSON object {form[1:-1]}, got {_shown(d)}")
        missing, unknown = sorted(set(_DECLARATION_KEYS) - set(d)), sorted(set(d) - set(known))
        if missing or unknown:
            said = [f"missing {missing}"] * bool(missing) + [f"unknown setting(s) {unknown}"] * bool(unknown)
            raise RepositoryError(f"{where}: {at}: {'; '.join(said)}; known: {list(known)}")
        declared: dict[str, Any] = {
            "name": _typed_value("str", d["name"], f"{at}.name", where),
            "datatype": _typed_value("str", d["datatype"], f"{at}.datatype", where),
            "shape": _dims(d["shape"], f"{at}.shape", where),
        }
        if "format" in d:
            layout = _typed_value("str", d["format"], f"{at}.format", where)
            if layout not in FORMATS:
                raise RepositoryError(f"{where}: {at}.format must be one of {', '.join(FORMATS)}, got {_shown(layout)}")
            declared["format"] = layout
        if "reshape" in d:
            reshape = d["reshape"]
            if not isinstance(reshape, dict) or set(reshape) != {"shape"}:
                raise RepositoryError(f'{where}: {at}.reshape must be {{"shape": [...]}}, got {_shown(reshape)}')
            declared["reshape"] = _dims(reshape["shape"], f"{at}.reshape.shape", where)
        if "optional" in d:
            declared["optional"] = _typed_value("bool", d["optional"], f"{at}.optional", where)
        if "label_filename" in d:
            file = _typed_value("str", d["label_filename"], f"{at}.label_filename", where)
            path = (model_dir / file).resolve()
            if path.parent != model_dir.resolve():
                raise RepositoryError(f"{where}: {at}.label_filename must name a file in the model's directory")
            declared["labels"] = read_labels(path, f"{at}.label_filename", where)
            declared["label_filename"] = file
        out.append(declared)
    return tuple(out)


def available_versions(model_dir: Path) -> list[int]:
    """The numbered version directories of a model."""
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def model_cards(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Each version's model card, by version: config.json's own card is the newest version's, and those
    of the others are kept under its "versions" (as `qkv export --version` writes them)."""
    path = model_dir / "config.json"
    if not path.exists():
        return {}
    card = json.loads(path.read_text()).get("model_card", {})
    cards: dict[str, dict[str, Any]] = dict(card.pop("versions", {}))
    versions = available_versions(model_dir)
    if versions:
        cards[str(versions[-1])] = card
    return cards


def load_model(
    model_dir: Path,
    raw: dict[str, Any] | None = None,
    kind_of: Callable[[ModelConfig], ModelConfig] = lambda config: config,
) -> list[ModelConfig]:
    """The configurations of the versions the model's version policy serves, oldest first. `kind_of` gives the
    newest version's configuration its kind (models/catalog.py `recognised`), which every version shares."""
    newest = kind_of(load_model_config(model_dir, raw=raw))
    chosen = newest.version_policy.choose(available_versions(model_dir), f"model '{newest.name}'")
    return [replace(newest, version=str(v), directory=model_dir / str(v)) for v in chosen]


def model_directories(root: Path) -> dict[str, Path]:
    """Model name -> its directory, for every model of the repository."""
    root = Path(root)
    if not root.is_dir():
        raise RepositoryError(f"model repository {root} is not a directory")
    return {d.name: d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")}


def fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when a file under `path` (or `path` itself) is written, added or removed."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:  # removed while being read: the next poll sees the change
            continue
        out.append((str(f.relative_to(path.parent)), st.st_mtime_ns, st.st_size))
    return tuple(out)


def config_fingerprint(model_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when a model's configuration changes: its files outside the numbered version directories
    (config.json or config.pbtxt, a labels file, warmup/ and initial_state/ data)."""
    return tuple(
        entry
        for path in sorted(model_dir.iterdir())
        if not (path.is_dir() and path.name.isdigit())
        for entry in fingerprint(path)
    )


def load_repository(root: Path) -> list[ModelConfig]:
    """Every served version of every model of the repository."""
    models = [config for d in model_directories(root).values() for config in load_model(d)]
    if not models:
        raise RepositoryError(f"model repository {root} holds no models")
    return models
