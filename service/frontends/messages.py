"""The data plane's answers about models as the protocol's messages: server and model metadata, model
configuration, statistics and the repository index. gRPC sends them as they are; REST writes them as
Triton's REST API does, as JSON of the same messages (`message_json`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from service import protocol
from service.callers import Caller
from service.models.catalog import BATCHING_SHOWN, ServedVersion, ShowsParameters, TunesBatching, capability
from service.models.response_cache import ResponseCache
from service.models.runtime import TensorSpec
from service.serving.dataplane import ServerInfo
from service.serving.registry import VersionState

__all__ = [
    "config_message",
    "index_message",
    "message_json",
    "metadata_message",
    "server_metadata_message",
    "statistics_message",
]

_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def server_metadata_message(info: ServerInfo, more: Iterable[str] = ()) -> protocol.ServerMetadataResponse:
    """The server's name, version and extensions (`more`: those of the front ends, e.g. shared memory)."""
    extensions = [*info.extensions, *more]
    return protocol.ServerMetadataResponse(name=info.name, version=info.version, extensions=extensions)


def metadata_message(model: ServedVersion, versions: Iterable[ServedVersion]) -> protocol.ModelMetadataResponse:
    tensor = protocol.ModelMetadataResponse.TensorMetadata
    return protocol.ModelMetadataResponse(
        name=model.name,
        versions=[v.version for v in versions],
        platform=f"{model.metadata.platform}:{model.metadata.provider}",
        inputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in model.metadata.inputs],
        outputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in model.metadata.outputs],
    )


def _triton_dims(shape: Sequence[int], batched: bool) -> list[int]:
    """A shape as Triton's ModelConfig writes it: without the batch axis when there is one."""
    return list(shape[1:]) or [1] if batched else list(shape)


def _model_input(spec: TensorSpec, data_type: int, batched: bool, declared: dict[str, Any]) -> protocol.ModelInput:
    """An input as Triton's ModelConfig shows it, with config.json's format and reshape."""
    i = protocol.ModelInput(name=spec.name, data_type=data_type, dims=_triton_dims(spec.shape, batched))
    if "format" in declared:
        i.format = protocol.ModelInput.Format.Value(declared["format"])
    if "reshape" in declared:
        i.reshape.shape[:] = _triton_dims(declared["reshape"], batched)
    i.optional = bool(declared.get("optional", False))
    return i


def _model_output(spec: TensorSpec, data_type: int, batched: bool, declared: dict[str, Any]) -> protocol.ModelOutput:
    """An output as Triton's ModelConfig shows it, with config.json's reshape and labels file."""
    o = protocol.ModelOutput(name=spec.name, data_type=data_type, dims=_triton_dims(spec.shape, batched))
    if "reshape" in declared:
        o.reshape.shape[:] = _triton_dims(declared["reshape"], batched)
    if "labels" in declared:
        o.label_filename = declared["label_filename"]
    return o


def config_message(m: ServedVersion) -> protocol.ModelConfigResponse:
    """Triton's ModelConfig of a version: its tensors, instances and batching, and qkv's own parameters."""
    if m.config.triton is not None:
        return protocol.ModelConfigResponse(config=triton_config_message(m))
    batched = m.metadata.max_batch_size > 0
    declared = {d["name"]: d for d in (*m.config.inputs, *m.config.outputs)}
    types = {d.name.removeprefix("TYPE_"): int(d) for d in protocol.DataType}
    types["BYTES"] = int(protocol.DataType.TYPE_STRING)
    tunes = capability(m, TunesBatching)
    b = tunes.batching() if tunes is not None else None
    group = protocol.ModelInstanceGroup
    config = protocol.ModelConfig(
        name=m.name,
        platform=m.metadata.platform if m.config.ensemble is not None else "onnxruntime_onnx",
        max_batch_size=m.metadata.max_batch_size,
        input=[_model_input(s, types[s.datatype], batched, declared.get(s.name, {})) for s in m.metadata.inputs],
        output=[_model_output(s, types[s.datatype], batched, declared.get(s.name, {})) for s in m.metadata.outputs],
    )
    if m.config.ensemble is not None:  # its steps; it has no instances or backend of its own
        config.parameters["kind"].string_value = m.metadata.kind
        for step in sorted(m.config.ensemble.steps, key=lambda s: s.position):  # as config.json lists them
            config.ensemble_scheduling.step.add(
                model_name=step.model_name,
                model_version=int(step.model_version or -1),
                input_map=dict(step.input_map),
                output_map=dict(step.output_map),
            )
        return protocol.ModelConfigResponse(config=config)
    config.backend = "onnxruntime"
    config.instance_group.add(
        name=m.name,
        count=max(1, m.config.instances),
        kind=group.KIND_GPU if "CUDA" in m.metadata.provider else group.KIND_CPU,
    )
    if batched and b is not None and b.enabled:
        config.dynamic_batching.max_queue_delay_microseconds = int(b.max_queue_delay_ms * 1000)
    config.parameters["provider"].string_value = m.metadata.provider
    config.parameters["kind"].string_value = m.metadata.kind
    if (shows := capability(m, ShowsParameters)) is not None:  # what the kind adds (the version of its rules...)
        for key, value in shows.config_parameters().items():
            config.parameters[key].string_value = value
    sources = tunes.batching_sources() if tunes is not None else None
    if (
        b is not None and sources is not None
    ):  # a kind that tunes its batching: what is in force, and where each value came from
        for key in BATCHING_SHOWN:
            config.parameters[f"batching.{key}"].string_value = f"{getattr(b, key):g}"
            if key in sources:
                config.parameters[f"batching.{key}.source"].string_value = sources[key]
    return protocol.ModelConfigResponse(config=config)


def triton_config_message(m: ServedVersion) -> protocol.ModelConfig:
    """A version read from a Triton config: the file's config as it is, plus the fields Triton's own
    auto-complete fills where the file left them out (inputs and outputs from the graph, max_batch_size,
    platform and backend, one instance group, the default model file name)."""
    config = protocol.ModelConfig()
    json_format.ParseDict(m.config.triton or {}, config)
    config.name = m.name
    batched = m.metadata.max_batch_size > 0
    if "max_batch_size" not in (m.config.triton or {}):
        config.max_batch_size = m.metadata.max_batch_size
    if m.config.ensemble is not None:
        config.platform = "ensemble"
        return config
    if not config.platform and not config.backend:
        config.platform = "onnxruntime_onnx"
    if not config.backend:
        config.backend = "onnxruntime"
    if not config.default_model_filename:
        config.default_model_filename = "model.onnx"
    types = {d.name.removeprefix("TYPE_"): int(d) for d in protocol.DataType}
    types["BYTES"] = int(protocol.DataType.TYPE_STRING)
    if not config.input:
        config.input.extend(_model_input(s, types[s.datatype], batched, {}) for s in m.metadata.inputs)
    if not config.output:
        config.output.extend(_model_output(s, types[s.datatype], batched, {}) for s in m.metadata.outputs)
    if not config.instance_group:
        kind = (
            protocol.ModelInstanceGroup.KIND_GPU
            if "CUDA" in m.metadata.provider
            else protocol.ModelInstanceGroup.KIND_CPU
        )
        config.instance_group.add(name=m.name, count=max(1, m.config.instances), kind=kind)
    return config


def _duration(count: int, ns: int) -> protocol.StatisticDuration:
    return protocol.StatisticDuration(count=count, ns=ns)


def statistics_message(
    models: Iterable[ServedVersion], cache: ResponseCache[Any] | None = None, caller: Caller | None = None
) -> protocol.ModelStatisticsResponse:
    """Triton's ModelStatistics of `models`, with the response cache's hits and misses for those that use it:
    with isolated tokens, those of the `caller`'s own requests alone."""
    response = protocol.ModelStatisticsResponse()
    for m in models:
        s = m.stats.snapshot()
        stats = response.model_stats.add(
            name=m.name,
            version=m.version,
            last_inference=s.last_inference_ms,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
        )
        i = stats.inference_stats
        i.success.CopyFrom(_duration(s.success_count, s.success_ns))
        i.fail.CopyFrom(_duration(s.fail_count, s.fail_ns))
        i.queue.CopyFrom(_duration(s.success_count, s.queue_ns))
        # Per request, as Triton counts them (perf_analyzer needs the three compute counts equal).
        i.compute_input.CopyFrom(_duration(s.success_count, 0))
        i.compute_infer.CopyFrom(_duration(s.success_count, s.request_compute_ns))
        i.compute_output.CopyFrom(_duration(s.success_count, 0))
        if cache is not None and m.config.response_cache:
            c = cache.counts(m.name, m.version, caller)
            i.cache_hit.CopyFrom(_duration(c.hits, 0))
            i.cache_miss.CopyFrom(_duration(c.misses, 0))
        for size, (count, ns) in sorted(s.batches.items()):
            stats.batch_stats.add(batch_size=size, compute_infer=_duration(count, ns))
    return response


def index_message(rows: Iterable[VersionState]) -> protocol.RepositoryIndexResponse:
    response = protocol.RepositoryIndexResponse()
    for row in rows:
        response.models.add(name=row.name, version=row.version, state=row.state, reason=row.reason)
    return response


def _numbers(message: protocol.Message, doc: Any) -> Any:
    """Undo proto3 JSON's strings for 64-bit integers: Triton's REST answers carry numbers, and
    perf_analyzer and tritonclient read them as numbers."""
    if not isinstance(doc, dict):
        return doc
    for f in message.DESCRIPTOR.fields:
        if f.name not in doc:
            continue
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            entry = f.message_type.fields_by_name["value"]
            if entry.message_type is not None:
                for key, sub in value.items():
                    _numbers(sub, doc[f.name][str(key)])
        elif f.message_type is not None:
            subs = list(value) if f.label == FieldDescriptor.LABEL_REPEATED else [value]
            targets = doc[f.name] if f.label == FieldDescriptor.LABEL_REPEATED else [doc[f.name]]
            for sub, target in zip(subs, targets, strict=True):
                _numbers(sub, target)
        elif f.type in _INT64_TYPES:
            doc[f.name] = [int(v) for v in doc[f.name]] if isinstance(doc[f.name], list) else int(doc[f.name])
    return doc


def message_json(message: protocol.Message) -> Any:
    """A protocol message as Triton's REST API writes it: field names as in the .proto, every field
    present (zeros too), enums by name, 64-bit integers as numbers."""
    doc = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message, doc)
