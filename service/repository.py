"""The model repository: one directory per model, numbered versions, an optional config.json.

    models/NAME/config.json      kind, batching, instances, limits, model card (all optional)
    models/NAME/1/model.onnx     a tensor model (inputs and outputs read from the graph)
    models/NAME/1/encoder.onnx   ... or the g2p kind's graphs and vocabularies

The newest (highest numbered) version is served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from service.metrics import UNKNOWN_MODEL

__all__ = ["BatchingConfig", "ModelConfig", "RepositoryError", "load_model_config", "load_repository"]

KINDS = ("tensor", "g2p")


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


def _typed(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise RepositoryError(f"{where}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    return values


def load_model_config(model_dir: Path) -> ModelConfig:
    name = model_dir.name
    if name == UNKNOWN_MODEL:
        raise RepositoryError(
            f"model '{name}': the name is reserved (the metrics count requests for models the server does "
            "not have under it); rename the directory"
        )
    versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    if not versions:
        raise RepositoryError(f"model '{name}': no numbered version directory in {model_dir}")
    version = max(versions, key=lambda p: int(p.name))
    raw: dict[str, Any] = {}
    config_path = model_dir / "config.json"
    if config_path.exists():
        try:
            raw = json.loads(config_path.read_text())
        except ValueError as e:
            raise RepositoryError(f"model '{name}': {config_path} is not valid JSON: {e}") from e
    kind = raw.get("kind", "tensor")
    if kind not in KINDS:
        raise RepositoryError(f"model '{name}': unknown kind '{kind}' (one of {', '.join(KINDS)})")
    batching = dict(raw.get("batching", {}))
    if "max_batch_size" in raw:
        batching.setdefault("max_batch_size", raw["max_batch_size"])
    settings = {
        k: raw[k]
        for k in ("instances", "intra_op_threads", "inter_op_threads", "optimization", "precision", "sequence_axis",
                  "limits")
        if k in raw
    }  # fmt: skip
    if settings.get("precision", "fp32") not in PRECISIONS:
        raise RepositoryError(
            f"model '{name}': unknown precision '{settings['precision']}' (one of {', '.join(PRECISIONS)})"
        )
    return ModelConfig(
        name=name,
        kind=kind,
        version=version.name,
        directory=version,
        batching=BatchingConfig(**_typed(BatchingConfig, batching, f"model '{name}' batching")),
        card=raw.get("model_card", {}),
        batching_given=frozenset(batching),
        **settings,
    )


def load_repository(root: Path) -> list[ModelConfig]:
    root = Path(root)
    if not root.is_dir():
        raise RepositoryError(f"model repository {root} is not a directory")
    models = [load_model_config(d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]
    if not models:
        raise RepositoryError(f"model repository {root} holds no models")
    return models
