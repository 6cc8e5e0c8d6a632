"""The model repository: one directory per model, numbered versions, an optional config.json.

    models/NAME/config.json      kind, batching, instances, limits, model card (all optional)
    models/NAME/1/model.onnx     a tensor model (inputs and outputs read from the graph)
    models/NAME/1/encoder.onnx   ... or the g2p kind's graphs and vocabularies
    models/NAME/2/...            another version

Which versions are served is the model's version policy (config.json "version_policy", Triton's
names): the newest one by default, the N newest, all, or specific ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from service.metrics import UNKNOWN_MODEL

__all__ = [
    "BatchingConfig",
    "ModelConfig",
    "RepositoryError",
    "VersionPolicy",
    "fingerprint",
    "load_model",
    "load_model_config",
    "load_repository",
    "model_cards",
    "model_directories",
    "parse_config",
]

KINDS = ("tensor", "g2p")
# A config.json (a file, or a load request's 'config' parameter): bounded before anything walks it. Real
# ones are a few KiB, four levels deep.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32


class RepositoryError(Exception):
    """A model that cannot be served: the server refuses to start."""


PRECISIONS = ("fp32", "int8")  # int8: the same graphs with int8 weights (export/quantize.py), beside them


@dataclass(frozen=True)
class BatchingConfig:
    """How requests of one model are gathered into batches (config.json "batching")."""

    enabled: bool = True
    max_batch_size: int = 64  # rows per batch (words, for g2p)
    max_queue_delay_ms: float = 2.0  # how long a partial batch may wait for company
    token_budget: int = 8192  # rows x padded length of one batch
    length_aware: bool = True  # group requests of similar length (False: plain FIFO, pad to longest)
    max_padding: float = 0.1  # length-aware: the padded share a batch may reach
    max_queue_requests: int = 1024  # beyond this, RESOURCE_EXHAUSTED at once
    max_queue_tokens: int = 32768  # queued tokens beyond which new work is refused
    max_queue_wait_ms: float = 1000.0  # refuse work whose predicted wait (queued tokens / measured rate) is longer
    inline_max_tokens: int = 32  # a request this small on an idle server skips the hand-off to an instance thread
    continuous: bool = True  # g2p: words join a running decode at the next step
    min_join_rows: int = 8  # g2p: words that join together (fewer once max_queue_delay_ms has passed)


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
            raise RepositoryError(f"{where}: version_policy must be one of latest, all or specific, got {raw!r}")
        [(kind, body)] = raw.items()
        body = body or {}
        if kind == "latest" and isinstance(body, dict):
            n = body.get("num_versions", 1)
            if _integer(n) and n >= 1:
                return cls("latest", num_versions=n)
            raise RepositoryError(
                f"{where}: version_policy.latest.num_versions must be an integer >= 1, got {json.dumps(n)[:64]}"
            )
        elif kind == "all" and isinstance(body, dict) and not body:
            return cls("all")
        elif kind == "specific" and isinstance(body, dict):
            versions = body.get("versions")
            if isinstance(versions, list) and versions and all(_integer(v) and v >= 0 for v in versions):
                return cls("specific", versions=tuple(sorted(set(versions))))
            raise RepositoryError(
                f"{where}: version_policy.specific.versions must be a list of version numbers (integers >= 0), "
                f"got {json.dumps(versions)[:64]}"
            )
        raise RepositoryError(
            f"{where}: version_policy {raw!r} is not {{'latest': {{'num_versions': N >= 1}}}}, {{'all': {{}}}} "
            "or {'specific': {'versions': [numbers]}}"
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
    kind: str
    version: str
    directory: Path  # the version directory
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    instances: int = 2  # onnxruntime sessions running batches concurrently (2 x 1 thread beats 1 x 2 here)
    intra_op_threads: int = 1
    inter_op_threads: int = 1
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


def _integer(value: Any) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


# A setting's declared type -> whether a JSON value is of it, and how a message names it.
_TYPES: dict[str, tuple[Any, str]] = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (_integer, "an integer"),
    "float": (lambda v: _integer(v) or isinstance(v, float), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "int | None": (lambda v: v is None or _integer(v), "an integer or null"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "a JSON object"),
}


def _typed(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` for the fields of `cls`, each of its field's type (a bool is no number), or a RepositoryError
    naming the key."""
    known = {f.name: str(f.type) for f in fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise RepositoryError(f"{where}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    for key, value in values.items():
        check, wanted = _TYPES.get(known[key], (lambda v: True, ""))
        if not check(value):
            raise RepositoryError(f"{where}: {key} must be {wanted}, got {json.dumps(value)[:64]}")
    return values


def _limits(raw: Any, where: str) -> None:
    """limits: each an integer, vocab_size an object of integers (the models read them with int())."""
    if not isinstance(raw, dict):
        raise RepositoryError(f"{where}: limits must be a JSON object")
    for key, value in raw.items():
        if key == "vocab_size" and isinstance(value, dict):
            bad = [k for k, v in value.items() if not _integer(v)]
            if bad:
                raise RepositoryError(f"{where}: limits.vocab_size.{bad[0]} must be an integer")
        elif not _integer(value):
            raise RepositoryError(f"{where}: limits.{key} must be an integer, got {json.dumps(value)[:64]}")


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
    config_path = model_dir / "config.json"
    where = f"model '{name}'"
    if raw is None:
        raw = read_config(config_path, where)
    elif not isinstance(raw, dict):
        raise RepositoryError(f"{where}: the configuration must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("kind", "tensor")
    if kind not in KINDS:
        raise RepositoryError(f"{where}: unknown kind '{kind}' (one of {', '.join(KINDS)})")
    if not isinstance(raw.get("batching", {}), dict):
        raise RepositoryError(f"{where}: {config_path}: batching must be a JSON object")
    batching = dict(raw.get("batching", {}))
    if "max_batch_size" in raw:
        batching.setdefault("max_batch_size", raw["max_batch_size"])
    settings: dict[str, Any] = {
        k: raw[k]
        for k in ("instances", "intra_op_threads", "inter_op_threads", "optimization", "precision", "sequence_axis",
                  "limits")
        if k in raw
    }  # fmt: skip
    _typed(ModelConfig, settings, where)
    if "limits" in settings:
        _limits(settings["limits"], where)
    if not isinstance(raw.get("model_card", {}), dict):
        raise RepositoryError(f"{where}: model_card must be a JSON object")
    if settings.get("precision", "fp32") not in PRECISIONS:
        raise RepositoryError(f"{where}: unknown precision '{settings['precision']}' (one of {', '.join(PRECISIONS)})")
    inputs = tuple(_tensor_declarations(raw["inputs"], f"{where} inputs")) if "inputs" in raw else ()
    outputs = tuple(_tensor_declarations(raw["outputs"], f"{where} outputs")) if "outputs" in raw else ()
    policy = VersionPolicy()
    if "version_policy" in raw:
        policy = VersionPolicy.parse(raw["version_policy"], where)
    try:
        return ModelConfig(
            name=name,
            kind=kind,
            version=chosen,
            directory=model_dir / chosen,
            batching=BatchingConfig(**_typed(BatchingConfig, batching, f"{where} batching")),
            card=raw.get("model_card", {}),
            batching_given=frozenset(batching),
            version_policy=policy,
            inputs=inputs,
            outputs=outputs,
            **settings,
        )
    except TypeError as e:  # a setting of the wrong type, e.g. "batching": [] or "limits": 3
        raise RepositoryError(f"{where}: {config_path}: {e}") from None


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


def _tensor_declarations(raw: Any, where: str) -> list[dict[str, Any]]:
    ok = isinstance(raw, list) and all(
        isinstance(d, dict)
        and isinstance(d.get("name"), str)
        and isinstance(d.get("datatype"), str)
        and isinstance(d.get("shape"), list)
        and all(isinstance(n, int) for n in d["shape"])
        for d in raw
    )
    if not ok:
        raise RepositoryError(f'{where}: expected a list of {{"name": ..., "datatype": ..., "shape": [...]}}')
    return list(raw)


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


def load_model(model_dir: Path, raw: dict[str, Any] | None = None) -> list[ModelConfig]:
    """The configurations of the versions the model's version policy serves, oldest first."""
    newest = load_model_config(model_dir, raw=raw)
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


def load_repository(root: Path) -> list[ModelConfig]:
    """Every served version of every model of the repository."""
    models = [config for d in model_directories(root).values() for config in load_model(d)]
    if not models:
        raise RepositoryError(f"model repository {root} holds no models")
    return models
