"""Triton's model configuration (`config.pbtxt`, or its JSON form) read into qkv's.

A model directory may hold Triton's `config.pbtxt` (protobuf text format of Triton's whole `ModelConfig`,
proto/model_config.proto), or a `config.json` in Triton's JSON form (the form of Triton's HTTP config
endpoint and load API: `input`/`output`, `data_type`, `dims`, ...), or qkv's own `config.json`. Triton's
forms are parsed into the `ModelConfig` message, so that every field Triton accepts parses and a misspelt
one is refused by protobuf, then translated field by field into qkv's form:

    config.pbtxt  --text_format-->  ModelConfig  --translate-->  qkv's config.json form (+ extras)

Every field is honoured, refused (a RepositoryError naming the field and why) or, where ignoring it cannot
change an answer, logged once at load naming it; the table is docs/triton.md's. qkv's own settings that
Triton has no field for are written as `parameters` (see PARAMETERS).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.message import Message

from service import protocol
from service.scheduling.config import BatchingConfig
from service.scheduling.priorities import parse_priorities

__all__ = [
    "ORT_PARAMETERS",
    "PARAMETERS",
    "TRITON_ONLY",
    "TritonConfigError",
    "TritonTranslation",
    "is_triton_form",
    "parse_json",
    "parse_pbtxt",
    "translate",
]

log = logging.getLogger("qkv.repository")


class TritonConfigError(ValueError):
    """A Triton config that does not parse, or a field qkv refuses; the message names the field."""


# Triton's top-level fields that qkv's own config.json form does not have: a config.json holding one of them
# (and none of qkv's own keys) is in Triton's JSON form.
TRITON_ONLY = frozenset({
    "backend", "runtime", "input", "output", "batch_input", "batch_output", "dynamic_batching",
    "instance_group", "default_model_filename", "cc_model_filenames", "metric_tags", "parameters",
    "model_warmup", "model_operations", "model_transaction_policy", "model_repository_agents", "model_metrics",
})  # fmt: skip
# qkv's own config.json keys that Triton's form does not have.
QKV_ONLY = frozenset({
    "kind", "batching", "model_card", "inputs", "outputs", "instances", "intra_op_threads", "inter_op_threads",
    "lone_request_threads", "precision", "sequence_axis", "limits",
})  # fmt: skip

# qkv's settings written in a Triton config as `parameters { key: "..." value { string_value: "..." } }`: the
# value is JSON (a number, an object) or, when it does not parse as JSON, the string itself.
PARAMETERS = ("kind", "sequence_axis", "limits", "lone_request_threads", "precision", "model_card", "batching")
# ...and one setting of a section: "batching.<key>" and "sequence_batching.<key>" (qkv's bounds on sequences).
SECTION_PARAMETERS = {
    "batching": tuple(f.name for f in fields(BatchingConfig)),
    "sequence_batching": ("max_sequences", "max_state_bytes", "max_sequence_requests"),
}
# The onnxruntime backend's parameters (its README) that qkv honours -> qkv's setting.
ORT_PARAMETERS = {"intra_op_thread_count": "intra_op_threads", "inter_op_thread_count": "inter_op_threads"}
# ... those applied to the onnxruntime session (SessionOptions): execution_mode 0 sequential, 1 parallel.
SESSION_PARAMETERS = ("execution_mode", "enable_mem_arena", "enable_mem_pattern")
# ... and those that only place memory or tune GPU kernels: an answer is the same without them.
ORT_LOGGED = (
    "cudnn_conv_algo_search", "gpu_mem_limit", "arena_extend_strategy", "cudnn_conv_use_max_workspace",
    "do_copy_in_default_stream", "enable_cuda_graph", "use_ep_level_unified_stream",
    "memory.enable_memory_arena_shrinkage", "session.use_device_allocator_for_initializers",
    "session.use_global_thread_pool", "share_session_between_instances", "enable_dynamic_shapes",
)  # fmt: skip
ONNX_PLATFORMS = ("", "onnxruntime_onnx")
ONNX_BACKENDS = ("", "onnxruntime")
# Triton's onnxruntime backend: optimization.graph.level -> onnxruntime's level (0, the default: all).
GRAPH_LEVELS = {-1: "basic", 0: "all", 1: "extended", 2: "disable"}
# An execution accelerator -> the onnxruntime provider it runs on.
ACCELERATORS = {"openvino": "OpenVINOExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
CUDA = "CUDAExecutionProvider"
MAX_WARMUP_SAMPLES = 64


@dataclass
class TritonTranslation:
    """A Triton config as qkv's config.json form (`raw`), with what that form has no key for."""

    raw: dict[str, Any]
    triton: dict[str, Any]  # the file's config, in Triton's JSON form (what ModelConfig answers start from)
    extras: dict[str, Any] = field(default_factory=dict)  # further fields of qkv's ModelConfig
    logged: list[str] = field(default_factory=list)  # fields left aside: each logged once at load
    source: str = "config.pbtxt"  # the file it came from, as messages name it


def _config_message() -> Message:
    return protocol.message_class("ModelConfig")()


def parse_pbtxt(text: str, where: str) -> Message:
    """config.pbtxt's text -> Triton's ModelConfig message; TritonConfigError with protobuf's message (it
    names the line, the column and the field)."""
    message = _config_message()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        raise TritonConfigError(f"{where}: config.pbtxt does not parse as Triton's ModelConfig: {e}") from None
    return message


def parse_json(raw: dict[str, Any], where: str) -> Message:
    """A config in Triton's JSON form -> Triton's ModelConfig message; TritonConfigError naming the field."""
    message = _config_message()
    try:
        json_format.ParseDict(raw, message)
    except json_format.ParseError as e:
        raise TritonConfigError(f"{where}: not Triton's ModelConfig in JSON: {e}") from None
    return message


def is_triton_form(raw: dict[str, Any]) -> bool:
    """Whether a parsed config.json is in Triton's JSON form: it holds a field only Triton's form has, and
    none of qkv's own. (One with only the fields both forms share reads the same either way; `optimization`
    is both forms': qkv's is a string, Triton's an object.)"""
    triton = set(raw) & TRITON_ONLY or isinstance(raw.get("optimization"), dict)
    return bool(triton) and not set(raw) & QKV_ONLY


def as_json(message: Message) -> dict[str, Any]:
    """The message in Triton's JSON form (its field names; 64-bit integers as strings, enums by name)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[no-any-return]


def _datatype(name: str) -> str:
    """TYPE_FP32 -> FP32 (TYPE_STRING -> BYTES), the protocol's spelling qkv's config.json uses."""
    return "BYTES" if name == "TYPE_STRING" else name.removeprefix("TYPE_")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class _Reader:
    """Translates one config; `refuse` and `leave` record the fields it does not honour."""

    def __init__(self, t: dict[str, Any], where: str, available: list[str]) -> None:
        self.t, self.where, self.available = t, where, available
        self.raw: dict[str, Any] = {}
        self.extras: dict[str, Any] = {}
        self.logged: list[str] = []

    def refuse(self, key: str, why: str) -> None:
        raise TritonConfigError(f"{self.where}: {key}: {why}")

    def leave(self, key: str, why: str) -> None:
        self.logged.append(f"{key} ({why})")

    def batched(self) -> bool:
        return int(self.t.get("max_batch_size", 0)) > 0

    def dims(self, dims: list[Any]) -> list[int]:
        """Triton's dims (without the batch axis) -> qkv's shape (with it, -1, when the model batches)."""
        return [-1] * self.batched() + [int(d) for d in dims]

    def platform(self) -> str:
        platform, backend, runtime = (self.t.get(k, "") for k in ("platform", "backend", "runtime"))
        if runtime:
            self.refuse("runtime", f"'{runtime}' names a backend library; qkv runs ONNX graphs on onnxruntime")
        if platform == "ensemble":
            if backend:
                self.refuse("backend", "an ensemble (platform 'ensemble') has no backend")
            return "ensemble"
        if platform not in ONNX_PLATFORMS or backend not in ONNX_BACKENDS:
            given = " and ".join(f"{k} '{v}'" for k, v in (("platform", platform), ("backend", backend)) if v)
            self.refuse(
                "platform" if platform not in ONNX_PLATFORMS else "backend",
                f"{given}: qkv serves ONNX graphs (platform onnxruntime_onnx, backend onnxruntime) and ensembles "
                "(platform ensemble)",
            )
        return platform or "onnxruntime_onnx"

    def tensor(self, d: dict[str, Any], section: str, i: int) -> dict[str, Any]:
        at = f"{section}[{i}]"
        out: dict[str, Any] = {
            "name": d.get("name", ""),
            "datatype": _datatype(d.get("data_type", "TYPE_INVALID")),
            "shape": self.dims(d.get("dims", [])),
        }
        if out["datatype"] == "INVALID":
            self.refuse(f"{at}.data_type", f"'{out['name']}' needs a data_type")
        for flag in ("is_shape_tensor", "is_non_linear_format_io"):
            if d.get(flag):
                self.refuse(f"{at}.{flag}", "a TensorRT notion; onnxruntime has no shape tensors or non-linear I/O")
        if "format" in d:
            out["format"] = d["format"]
        if "reshape" in d:
            out["reshape"] = {"shape": self.dims(d["reshape"].get("shape", []))}
        if "label_filename" in d:
            out["label_filename"] = d["label_filename"]
        if d.get("optional"):
            out["optional"] = True
        if d.get("allow_ragged_batch"):
            self.leave(
                f"{at}.allow_ragged_batch",
                "qkv stacks only requests of one shape (or pads along sequence_axis), so it never needs a ragged batch",
            )
        return out

    def instances(self) -> None:
        groups = self.t.get("instance_group", [])
        count = 0
        for i, g in enumerate(groups):
            at = f"instance_group[{i}]"
            kind = g.get("kind", "KIND_AUTO")
            if kind == "KIND_GPU":
                if CUDA not in self.available:
                    self.refuse(
                        f"{at}.kind",
                        f"KIND_GPU needs onnxruntime's {CUDA}, which this installation lacks (it has "
                        f"{', '.join(self.available)}); use KIND_CPU, or install onnxruntime-gpu on a machine with "
                        "a GPU",
                    )
                self.extras["device"] = "cuda"
            elif kind == "KIND_MODEL":
                self.leave(f"{at}.kind", "KIND_MODEL: the model places itself; onnxruntime's session runs on CPU")
            for key in ("gpus", "secondary_devices", "profile", "host_policy", "rate_limiter"):
                if key in g:
                    self.leave(f"{at}.{key}", "placement and rate limiting within one process; qkv has one device")
            if g.get("passive"):
                self.refuse(f"{at}.passive", "a passive instance receives no requests; qkv has no such instances")
            count += int(g.get("count", 1))
        if groups:
            self.raw["instances"] = count

    def parameters(self) -> None:
        for key, p in self.t.get("parameters", {}).items():
            text = p.get("string_value", "")
            if key in PARAMETERS:
                self.raw[key] = _value(text)
            elif key in ORT_PARAMETERS:
                self.raw[ORT_PARAMETERS[key]] = _value(text)
            elif key in SESSION_PARAMETERS:
                if text not in ("0", "1"):
                    self.refuse(f"parameters.{key}", f"must be '0' or '1', got {text!r}")
                self.extras.setdefault("session", {})[key] = text == "1"
            elif "." in key and key.split(".", 1)[0] in SECTION_PARAMETERS:
                section, setting = key.split(".", 1)
                if setting not in SECTION_PARAMETERS[section]:
                    self.refuse(f"parameters.{key}", f"unknown; known: {', '.join(SECTION_PARAMETERS[section])}")
                if section == "sequence_batching" and "sequence_batching" not in self.t:
                    self.refuse(f"parameters.{key}", "the model has no sequence_batching")
                self.raw.setdefault(section, {})[setting] = _value(text)
            elif key in ORT_LOGGED:
                self.leave(f"parameters.{key}", "an onnxruntime memory or GPU setting; answers are the same")
            else:
                self.leave(f"parameters.{key}", "not a key of the onnxruntime backend or of qkv")

    def optimization(self) -> None:
        o = self.t.get("optimization", {})
        if "graph" in o:
            level = int(o["graph"].get("level", 0))
            if level not in GRAPH_LEVELS:
                self.refuse("optimization.graph.level", f"{level} is not one of {sorted(GRAPH_LEVELS)}")
            self.raw["optimization"] = GRAPH_LEVELS[level]
        providers = []
        for side in ("cpu_execution_accelerator", "gpu_execution_accelerator"):
            for i, a in enumerate(o.get("execution_accelerators", {}).get(side, [])):
                name = a.get("name", "")
                provider = ACCELERATORS.get(name)
                at = f"optimization.execution_accelerators.{side}[{i}]"
                if provider is None:
                    self.refuse(f"{at}.name", f"'{name}' is none of {', '.join(ACCELERATORS)}")
                elif provider not in self.available:
                    self.refuse(
                        f"{at}.name",
                        f"'{name}' runs on onnxruntime's {provider}, which this installation lacks (it has "
                        f"{', '.join(self.available)})",
                    )
                if a.get("parameters"):
                    self.leave(f"{at}.parameters", f"{provider}'s tuning options; qkv passes none")
                providers.append(provider)
        if providers:
            self.extras["accelerators"] = tuple(providers)
        for key in ("priority", "cuda", "input_pinned_memory", "output_pinned_memory",
                    "gather_kernel_buffer_threshold", "eager_batching"):  # fmt: skip
            if key in o:
                self.leave(f"optimization.{key}", "GPU memory placement and scheduling hints; answers are the same")

    def dynamic_batching(self) -> None:
        if "dynamic_batching" not in self.t:
            # Triton runs each request alone without it (a sequence model has its own batcher)
            if self.batched() and "sequence_batching" not in self.t:
                self.raw.setdefault("batching", {})["enabled"] = False
            return
        d = self.t["dynamic_batching"]
        batching = self.raw.setdefault("batching", {})
        if "max_queue_delay_microseconds" in d:
            batching["max_queue_delay_ms"] = int(d["max_queue_delay_microseconds"]) / 1000
        sizes = [int(n) for n in d.get("preferred_batch_size", [])]
        largest = int(self.t.get("max_batch_size", 0)) or max(sizes, default=1)  # not given: the graph decides
        wrong = [n for n in sizes if not 1 <= n <= largest]
        if wrong:
            self.refuse("dynamic_batching.preferred_batch_size", f"{wrong[0]} is not within 1..max_batch_size")
        if sizes:
            self.extras["preferred_batch_sizes"] = tuple(sorted(set(sizes)))
        if d.get("preserve_ordering"):
            self.leave(
                "dynamic_batching.preserve_ordering",
                "each request has its own answer; a stream's answers are sent in the order of its requests",
            )
        try:
            priorities = parse_priorities(d)
        except ValueError as e:
            raise TritonConfigError(f"{self.where}: {e}") from None
        if priorities is not None:
            self.extras["priorities"] = priorities

    def warmup(self) -> None:
        samples = self.t.get("model_warmup", [])
        if len(samples) > MAX_WARMUP_SAMPLES:
            self.refuse("model_warmup", f"{len(samples)} samples, the limit is {MAX_WARMUP_SAMPLES}")
        if not samples:
            return
        if "sequence_batching" in self.t or self.t.get("platform") == "ensemble":
            self.leave("model_warmup", "run for a stateless tensor model; this one is warmed up from its graph")
        else:
            self.extras["warmup"] = tuple(samples)

    def sequence(self) -> None:
        """What the sequence batcher reads and checks but does not use: said, not dropped in silence."""
        s = self.t.get("sequence_batching", {})
        for key, why in (
            ("oldest.max_candidate_sequences", "qkv batches any ready sequences, not a fixed set of candidates"),
            ("oldest.preferred_batch_size", "qkv batches what is ready, up to max_batch_size"),
            ("oldest.preserve_ordering", "each request has its own answer, a stream's in its order"),
            ("direct.minimum_slot_utilization", "qkv runs a batch as soon as an instance is free"),
        ):
            section, setting = key.split(".")
            if setting in s.get(section, {}):
                self.leave(f"sequence_batching.{key}", why)
        for i, state in enumerate(s.get("state", [])):
            for flag in ("use_same_buffer_for_input_output", "use_growable_memory"):
                if state.get(flag):
                    self.leave(f"sequence_batching.state[{i}].{flag}", "a GPU buffer placement; answers are the same")

    def read(self) -> None:
        t = self.t
        platform = self.platform()
        if platform == "ensemble":  # Triton's platform, which the ensemble kind claims (models/catalog.py)
            self.raw["platform"] = platform
        for key in ("name", "max_batch_size", "version_policy", "sequence_batching", "ensemble_scheduling",
                    "response_cache"):  # fmt: skip
            if key in t:
                self.raw[key] = t[key]
        if "input" in t:
            self.raw["inputs"] = [self.tensor(d, "input", i) for i, d in enumerate(t["input"])]
        if "output" in t:
            self.raw["outputs"] = [self.tensor(d, "output", i) for i, d in enumerate(t["output"])]
        for key in ("batch_input", "batch_output"):
            if key in t:
                self.refuse(key, "batch inputs and outputs describe a ragged batch to a custom backend; qkv has none")
        filename = t.get("default_model_filename", "")
        if filename not in ("", "model.onnx"):
            self.refuse("default_model_filename", f"'{filename}': qkv reads each version's model.onnx")
        if t.get("model_operations", {}).get("op_library_filename"):
            self.refuse("model_operations.op_library_filename", "qkv loads no custom operator libraries")
        if t.get("model_transaction_policy", {}).get("decoupled"):
            self.refuse(
                "model_transaction_policy.decoupled", "qkv answers each request once; it has no decoupled models"
            )
        if t.get("model_repository_agents", {}).get("agents"):
            self.refuse("model_repository_agents", "qkv runs no repository agents; the files are served as they are")
        for key, why in (("cc_model_filenames", "per-GPU model files; qkv reads model.onnx"),
                         ("metric_tags", "labels of Triton's metrics; qkv's metrics carry the model and version"),
                         ("model_metrics", "histogram buckets of Triton's metrics; qkv's are fixed")):  # fmt: skip
            if key in t:
                self.leave(key, why)
        self.instances()
        self.sequence()
        self.optimization()
        self.dynamic_batching()
        self.warmup()
        self.parameters()  # last: a parameter may set a batching key the sections above set too


def translate(
    message: Message, where: str, available: list[str], source: str = "config.pbtxt", unbatched: bool = False
) -> TritonTranslation:
    """Triton's ModelConfig -> qkv's config.json form and the extras it has no key for; TritonConfigError
    naming a field qkv refuses. `available`: onnxruntime's execution providers here. `unbatched`: the file
    says max_batch_size 0 (proto3 cannot tell it from no max_batch_size, which lets the graph decide)."""
    t = as_json(message)
    if unbatched:
        t["max_batch_size"] = 0
    reader = _Reader(t, where, available)
    reader.read()
    return TritonTranslation(reader.raw, t, reader.extras, reader.logged, source)


_MAX_BATCH_SIZE = re.compile(r"^[^#\n]*(?<![\w.])max_batch_size\s*:", re.MULTILINE)  # outside a comment


def gives_max_batch_size(text: str) -> bool:
    """Whether config.pbtxt's text sets max_batch_size (only ModelConfig has a field of that name): the
    message reads 0 both when the file says 0 and when it says nothing."""
    return bool(_MAX_BATCH_SIZE.search(text))


def read_pbtxt(path: Path, where: str, limit: int) -> tuple[Message, str]:
    """A config.pbtxt file, bounded in size, parsed; and its text."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise TritonConfigError(f"{where}: {path} is {size:,} bytes, the limit is {limit:,}")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TritonConfigError(f"{where}: cannot read {path}: {e}") from None
    return parse_pbtxt(text, where), text


def log_left_aside(where: str, logged: list[str]) -> None:
    """The fields a config gave that qkv does not use, said once at load."""
    if logged:
        log.warning("%s: Triton's field(s) left aside, answers are the same without them: %s", where, "; ".join(logged))
