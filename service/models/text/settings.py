"""What a text model is, read from the files of the folder as exported (docs/text-models.md, "Detection").

A Hugging Face folder says it in its own files: the task from `config.json` (its architecture, labels and
problem type), pooling and normalization from sentence-transformers' `modules.json`, `1_Pooling/config.json`
and `sentence_bert_config.json`, its prompts from `config_sentence_transformers.json`, the longest input from
sentence-transformers' `max_seq_length` or the tokenizer's `model_max_length`. qkv's own config.json may
override any of it in its `text` section; every value is checked here, a wrong one named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from service.repository.layout import RepositoryError, folder_json

__all__ = [
    "LONG_INPUTS",
    "POOLINGS",
    "SIDES",
    "TASKS",
    "TOKENIZER_FILE",
    "TextSettings",
    "is_text_folder",
    "read_settings",
]

TOKENIZER_FILE = "tokenizer.json"
TASKS = ("embed", "classify", "rerank")
POOLINGS = ("mean", "cls", "last", "max")
LONG_INPUTS = ("truncate", "refuse", "chunk")
SIDES = ("right", "left")
MAX_FILE_BYTES = 4 << 20  # a JSON file of the folder (tokenizer.json aside) is read whole at load
# Without any file that says it, the longest input: BERT's 512 positions.
DEFAULT_MAX_LENGTH = 512
# A tokenizer_config.json with no real bound writes a huge model_max_length (int(1e30)).
NO_BOUND = 1 << 20


@dataclass(frozen=True)
class TextSettings:
    """How a text model reads its inputs and what it answers (docs/text-models.md, "Settings")."""

    task: str = "embed"  # embed, classify or rerank
    pooling: str = "mean"  # embed: mean, cls, last (the last real token) or max over the tokens
    normalize: bool = False  # embed: L2-normalized (sentence-transformers' Normalize module)
    max_length: int = DEFAULT_MAX_LENGTH  # tokens one input may hold, special tokens included
    long_inputs: str = "truncate"  # over max_length: truncate, refuse (400) or chunk (embed)
    truncation_side: str = "right"  # which end truncate cuts
    chunk_overlap: int = 32  # chunk: tokens each window shares with the one before
    max_chunks: int = 64  # chunk: windows one input may make
    max_texts: int = 256  # inputs one request may hold
    max_element_bytes: int = 1 << 16  # bytes of one input's text
    strip: bool = True  # leading and trailing whitespace dropped, as sentence-transformers does
    prompts: dict[str, str] = field(default_factory=dict)  # name -> prefix
    default_prompt: str = ""  # the prompt's name used when a request names none ("": none)
    labels: tuple[str, ...] = ()  # classify: each class's label (config.json's id2label)
    activation: str = "softmax"  # classify: softmax, sigmoid (multi-label) or none (regression)
    output: str = ""  # the graph's output read ("": token_embeddings, last_hidden_state, or logits)

    def check(self, where: str) -> TextSettings:
        """The settings, or a RepositoryError naming the first value out of its range."""
        choices = {
            "task": TASKS,
            "pooling": POOLINGS,
            "long_inputs": LONG_INPUTS,
            "truncation_side": SIDES,
            "activation": ("softmax", "sigmoid", "none"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                got = getattr(self, key)
                raise RepositoryError(f"{where}: text.{key} must be one of {', '.join(allowed)}, got {got!r}")
        for key, low in (("max_length", 2), ("max_chunks", 1), ("max_texts", 1), ("max_element_bytes", 1)):
            if getattr(self, key) < low:
                raise RepositoryError(f"{where}: text.{key} must be >= {low}, got {getattr(self, key)}")
        if not 0 <= self.chunk_overlap <= self.max_length // 2:
            raise RepositoryError(
                f"{where}: text.chunk_overlap must be in [0, max_length / 2], got {self.chunk_overlap}"
            )
        if self.default_prompt and self.default_prompt not in self.prompts:
            raise RepositoryError(f"{where}: text.default_prompt {self.default_prompt!r} is not one of text.prompts")
        if self.long_inputs == "chunk" and self.task != "embed":
            raise RepositoryError(f"{where}: text.long_inputs chunk is for embeddings, not a {self.task} model")
        return self


def is_text_folder(directory: Path) -> bool:
    """Whether a version directory holds a text model as exported: a graph and its tokenizer."""
    return (directory / "model.onnx").is_file() and (directory / TOKENIZER_FILE).is_file()


def _task(hf: dict[str, Any]) -> tuple[str, tuple[str, ...], str]:
    """(task, labels, activation) from the HF config.json: a sequence classifier with one label is a
    cross-encoder (a score a pair), with more a classifier; any other architecture an encoder to embed."""
    architectures = hf.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures):
        return "embed", (), "softmax"
    id2label = hf.get("id2label") or {}
    count = int(hf.get("num_labels", len(id2label) or 2))
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    if count == 1:
        return "rerank", labels, "sigmoid"
    problem = hf.get("problem_type")
    activations = {"multi_label_classification": "sigmoid", "regression": "none"}
    return "classify", labels, activations.get(str(problem), "softmax")


def _pooling(directory: Path, where: str) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' modules.json and its Pooling module's config."""
    modules = _json_list(directory / "modules.json", where)
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    pooling_dir = next((m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Pooling")), "1_Pooling")
    config = folder_json(directory / str(pooling_dir) / "config.json", where, MAX_FILE_BYTES)
    for key, mode in (
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_lasttoken", "last"),
        ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_tokens", "mean"),
    ):
        if config.get(key):
            return mode, normalize
    return "mean", normalize


def _json_list(path: Path, where: str) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RepositoryError(f"{where}: cannot read {path.name}: {e}") from None
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def _max_length(directory: Path, hf: dict[str, Any], where: str) -> int:
    """sentence-transformers' max_seq_length (the reference's rule), else the tokenizer's model_max_length,
    else the model's positions."""
    for value in (
        folder_json(directory / "sentence_bert_config.json", where, MAX_FILE_BYTES).get("max_seq_length"),
        folder_json(directory / "tokenizer_config.json", where, MAX_FILE_BYTES).get("model_max_length"),
        hf.get("max_position_embeddings"),
    ):
        if isinstance(value, int | float) and 2 <= value < NO_BOUND:
            return int(value)
    return DEFAULT_MAX_LENGTH


def read_settings(directory: Path, overrides: dict[str, Any], where: str) -> TextSettings:
    """The settings of the folder `directory`, with config.json's `text` section (`overrides`) over them."""
    hf = folder_json(directory / "config.json", where, MAX_FILE_BYTES)
    task, labels, activation = _task(hf)
    pooling, normalize = _pooling(directory, where)
    st = folder_json(directory / "config_sentence_transformers.json", where, MAX_FILE_BYTES)
    prompts = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
    found = TextSettings(
        task=task,
        pooling=pooling,
        normalize=normalize,
        max_length=_max_length(directory, hf, where),
        prompts=prompts,
        default_prompt=str(st.get("default_prompt_name") or ""),
        labels=labels,
        activation=activation,
    )
    return replace(found, **_typed_overrides(overrides, where)).check(where)


def _typed_overrides(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """config.json's `text` section, each value of its setting's type."""
    types = {f.name: str(f.type) for f in fields(TextSettings)}
    unknown = sorted(set(raw) - set(types))
    if unknown:
        raise RepositoryError(f"{where}: unknown setting(s) {unknown} in text; known: {sorted(types)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        declared = types[key]
        ok = {
            "str": isinstance(value, str),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "dict[str, str]": isinstance(value, dict) and all(isinstance(v, str) for v in value.values()),
            "tuple[str, ...]": isinstance(value, list) and all(isinstance(v, str) for v in value),
        }[declared]
        if not ok:
            raise RepositoryError(f"{where}: text.{key} must be of type {declared}, got {json.dumps(value)[:64]}")
        out[key] = tuple(value) if declared == "tuple[str, ...]" else value
    return out
