"""onnxruntime sessions: execution provider choice, model instances, graph input/output specs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.datatypes import ONNX_DATATYPES
from service.errors import InvalidArgument, quote
from service.priority import lone_cores, spread_threads
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.batching import LONE
from service.seq2seq.graphs import (
    graph_file,
    session_options,
)

__all__ = ["TensorRuntime", "TensorSpec", "choose_providers"]

log = logging.getLogger("qkv.runtime")

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def choose_providers(device: str) -> list[str]:
    """CUDA first when asked for and present, else CPU, saying so once."""
    if device == "cuda":
        if CUDA in ort.get_available_providers():
            return [CUDA, CPU]
        log.warning(
            "--device cuda: onnxruntime has no CUDAExecutionProvider here (install onnxruntime-gpu and "
            "use a GPU); falling back to CPUExecutionProvider"
        )
    return [CPU]


_HOW_TO_QUANTIZE = {"int8": " (precision int8: write it with `python -m export.quantize`)"}


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: `shape` holds -1 for a dynamic axis, `axes` the symbolic names."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]


_cpu_arena = "session"
_shared_arena = False  # registered with onnxruntime


def use_cpu_arena(arena: str) -> None:
    """onnxruntime's CPU memory arena in the sessions this process makes from now on (a model's Triton parameter
    enable_mem_arena decides for its own): each session's own ("session"), one for them all ("shared":
    onnxruntime's environment allocator, registered here), or none ("off"). A worker of `--workers N` takes
    --worker-cpu-arena (service/workers/worker.py); one server process keeps "session"."""
    global _cpu_arena, _shared_arena
    if arena == "shared" and not _shared_arena:
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, -1, -1, -1))  # onnxruntime's defaults
        _shared_arena = True
    _cpu_arena = arena


def _specs(args: list[ort.NodeArg]) -> list[TensorSpec]:
    out = []
    for a in args:
        dims = [d if isinstance(d, int) and d >= 0 else -1 for d in a.shape]
        names = [d if isinstance(d, str) else None for d in a.shape]
        out.append(TensorSpec(a.name, ONNX_DATATYPES.get(a.type, a.type), tuple(dims), tuple(names)))
    return out


def _session(path: Path, config: ModelConfig, providers: list[str], lone: bool = False) -> ort.InferenceSession:
    options = session_options(config.intra_op_threads, config.inter_op_threads, config.optimization)
    if lone:
        # Its threads spin while a run hands them work (sleeping between an op's parts cost zoo_medium's
        # seq 64 2.65 ms against 2.09) and stop when the run ends: spinning on would take the instances'
        # cores after a lone request (3.7 ms of CPU a 0.75 ms seq 16 run, one every 2 ms).
        options.add_session_config_entry("session.force_spinning_stop", "1")
    providers = triton_providers(config, options, providers)
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types for corrupt graphs
        raise RepositoryError(f"model '{config.name}': cannot load {path}: {e}") from e


def triton_providers(config: ModelConfig, options: ort.SessionOptions, providers: list[str]) -> list[str]:
    """What a Triton config asks of the session: the onnxruntime backend's parameters (execution_mode,
    enable_mem_arena, enable_mem_pattern) set on `options`, and the providers to use: an execution
    accelerator's first, CUDA for instance_group KIND_GPU (the repository refused both where missing)."""
    session = config.session
    if "enable_mem_arena" not in session:  # (use_cpu_arena)
        options.enable_cpu_mem_arena = _cpu_arena != "off"
        if _cpu_arena == "shared":
            options.add_session_config_entry("session.use_env_allocators", "1")
    if "execution_mode" in session:
        options.execution_mode = (
            ort.ExecutionMode.ORT_PARALLEL if session["execution_mode"] else ort.ExecutionMode.ORT_SEQUENTIAL
        )
    if "enable_mem_arena" in session:
        options.enable_cpu_mem_arena = session["enable_mem_arena"]
    if "enable_mem_pattern" in session:
        options.enable_mem_pattern = session["enable_mem_pattern"]
    chosen = [CUDA, CPU] if config.device == "cuda" else list(providers)
    return [*config.accelerators, *(p for p in chosen if p not in config.accelerators)]


def _check_declared(
    config: ModelConfig, what: str, declared: tuple[dict[str, Any], ...], graph: list[TensorSpec], path: Path
) -> None:
    """Refuse a graph whose inputs or outputs are not those config.json declares (when it declares them)."""
    if not declared:
        return
    found = {s.name: (s.datatype, list(s.shape)) for s in graph}
    # with a `reshape`, the graph has the reshaped shape; clients see the declared one
    wanted = {d["name"]: (d["datatype"], list(d.get("reshape", d["shape"]))) for d in declared}
    if found != wanted:
        raise RepositoryError(
            f"model '{config.name}' version {config.version}: {path} has {what} {_listing(found)}; "
            f"config.json declares {_listing(wanted)}"
        )


def _optional_inputs(config: ModelConfig, session: ort.InferenceSession) -> list[TensorSpec]:
    """The inputs a config declares `optional` that the graph gives a default (an initializer it lets a run
    override, which onnxruntime does not list among its inputs): as the config declares them."""
    defaults = {a.name for a in session.get_overridable_initializers()}
    return [
        TensorSpec(d["name"], d["datatype"], tuple(d.get("reshape", d["shape"])), (None,) * len(d["shape"]))
        for d in config.inputs
        if d.get("optional") and d["name"] in defaults
    ]


def _server_filled(config: ModelConfig) -> set[str]:
    """The tensors of a stateful model that the sequence batcher fills and reads: controls and states."""
    sequence = config.sequence_batching
    if sequence is None:
        return set()
    return {c.input_name for c in sequence.controls} | {
        name for state in sequence.states for name in (state.input_name, state.output_name)
    }


def _listing(specs: dict[str, tuple[str, list[int]]]) -> str:
    return ", ".join(f"{name} {datatype} {shape}" for name, (datatype, shape) in sorted(specs.items()))


def _client_specs(graph: list[TensorSpec], declared: tuple[dict[str, Any], ...]) -> list[TensorSpec]:
    """The specs clients see: the graph's, but with a declared shape where config.json reshapes."""
    shapes = {d["name"]: tuple(d["shape"]) for d in declared if "reshape" in d}
    return [
        TensorSpec(s.name, s.datatype, shapes[s.name], (None,) * len(shapes[s.name])) if s.name in shapes else s
        for s in graph
    ]


def _reshaped(array: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    """`array` in `shape` (Triton's reshape): a leading -1 (a batch axis) keeps the request's rows, and the
    rest of each row takes the shape after it."""
    target = (array.shape[0], *shape[1:]) if shape and shape[0] == -1 and array.ndim else shape
    try:
        return array.reshape(target)
    except ValueError:
        raise InvalidArgument(
            f"input {quote(name)}: shape {list(array.shape)} cannot be reshaped to {list(shape)} (config.json reshape)"
        ) from None


def lone_threads(config: ModelConfig) -> int:
    """The intra-op threads of a tensor model's lone session (0: it has none): config.json's
    lone_request_threads, or every core this process may use (a pinned worker's: those of the machine,
    priority.lone_cores); none when that is no more than an instance's."""
    wanted = config.lone_request_threads
    if wanted is None:
        wanted = len(lone_cores())
    return wanted if wanted > max(1, config.intra_op_threads) else 0


class TensorRuntime:
    """A plain ONNX graph, `config.instances` sessions of it. Where config.json declares a `reshape`, clients
    send and get the declared shape and the graph sees its own."""

    def __init__(self, config: ModelConfig, providers: list[str]) -> None:
        path = config.directory / graph_file("model.onnx", config.precision)
        if not path.exists():
            raise RepositoryError(f"model '{config.name}': missing {path}{_HOW_TO_QUANTIZE.get(config.precision, '')}")
        self.config = config
        self.sessions = [_session(path, config, providers) for _ in range(max(1, config.instances))]
        self.provider = self.sessions[0].get_providers()[0]
        # (a stateful model's batches are the sequence batcher's, which runs none alone)
        alone = self.provider == "CPUExecutionProvider" and config.sequence_batching is None
        threads = lone_threads(config) if alone else 0
        # One more session, for a batch that runs alone on an idle server: every core on one request.
        self.lone = None
        if threads:
            with spread_threads():  # its pool's threads may use every core, a pinned worker's too
                self.lone = _session(path, replace(config, intra_op_threads=threads), providers, lone=True)
        graph_inputs, graph_outputs = _specs(self.sessions[0].get_inputs()), _specs(self.sessions[0].get_outputs())
        graph_inputs += _optional_inputs(config, self.sessions[0])
        # a stateful model's control and state tensors are the server's: a config declares the others
        filled = _server_filled(config)
        _check_declared(config, "inputs", config.inputs, [s for s in graph_inputs if s.name not in filled], path)
        _check_declared(config, "outputs", config.outputs, [s for s in graph_outputs if s.name not in filled], path)
        self.inputs = _client_specs(graph_inputs, config.inputs)
        self.outputs = _client_specs(graph_outputs, config.outputs)
        # name -> (the graph's shape, the client's) of each reshaped tensor
        self._reshape_in = {d["name"]: tuple(d["reshape"]) for d in config.inputs if "reshape" in d}
        self._reshape_out = {d["name"]: tuple(d["shape"]) for d in config.outputs if "reshape" in d}

    def run(self, instance: int, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> list[np.ndarray]:
        """`instance`'s session on `feeds` (instance LONE: the lone session, when there is one)."""
        names = outputs or [o.name for o in self.outputs]
        session = self.lone if instance == LONE and self.lone is not None else self.sessions[instance]
        if self._reshape_in:
            feeds = {k: _reshaped(v, self._reshape_in[k], k) if k in self._reshape_in else v for k, v in feeds.items()}
        results: list[np.ndarray] = session.run(names, feeds)
        if self._reshape_out:
            results = [
                _reshaped(r, self._reshape_out[n], n) if n in self._reshape_out else r
                for n, r in zip(names, results, strict=True)
            ]
        return results
