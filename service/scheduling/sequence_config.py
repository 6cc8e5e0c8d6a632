"""config.json's "sequence_batching" section, as Triton's model configuration writes it in JSON, parsed
into typed values for the sequence batcher (service/scheduling/sequence.py).

    "sequence_batching": {
      "max_sequence_idle_microseconds": "5000000",
      "oldest": {"max_candidate_sequences": 4, "max_queue_delay_microseconds": 0},   (or "direct": {})
      "control_input": [{"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START",
                                                        "int32_false_true": [0, 1]}]}, ...],
      "state": [{"input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "TYPE_INT32",
                 "dims": [1], "initial_state": [{"data_type": "TYPE_INT32", "dims": [1],
                                                 "zero_data": true, "name": "zeros"}]}],
      "max_sequences": 1024, "max_state_bytes": 67108864,                            (qkv's own bounds)
      "max_sequence_requests": 512
    }

64-bit integers may be decimal strings (protobuf's JSON form). A wrong value raises `SequenceConfigError`
naming its dotted key; the repository turns it into its own error naming the model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONTROL_KINDS",
    "DEFAULT_MAX_SEQUENCES",
    "DEFAULT_MAX_SEQUENCE_IDLE_US",
    "DEFAULT_MAX_STATE_BYTES",
    "Control",
    "InitialState",
    "SequenceConfig",
    "SequenceConfigError",
    "StateSpec",
    "parse_sequence_batching",
    "triton_datatype",
]

# Triton's default idle time: a sequence with no request for this long is freed.
DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000
# qkv's bounds on what sequences hold (Triton has none: its backlog grows): beyond them a new sequence is
# refused RESOURCE_EXHAUSTED, and a state output that would pass max_state_bytes fails its request.
DEFAULT_MAX_SEQUENCES = 1024
DEFAULT_MAX_STATE_BYTES = 64 << 20

CONTROL_KINDS = {
    "CONTROL_SEQUENCE_START": "START",
    "CONTROL_SEQUENCE_END": "END",
    "CONTROL_SEQUENCE_READY": "READY",
    "CONTROL_SEQUENCE_CORRID": "CORRID",
}
# Triton's TYPE_* names -> the v2 protocol's datatypes (TYPE_STRING is BYTES on the wire).
_TRITON_TYPES = {
    "TYPE_BOOL": "BOOL", "TYPE_UINT8": "UINT8", "TYPE_UINT16": "UINT16", "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64", "TYPE_INT8": "INT8", "TYPE_INT16": "INT16", "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64", "TYPE_FP16": "FP16", "TYPE_FP32": "FP32", "TYPE_FP64": "FP64", "TYPE_STRING": "BYTES",
}  # fmt: skip
_CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")
_FLAG_FIELDS = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}
_DECIMAL = re.compile(r"-?[0-9]{1,19}")


class SequenceConfigError(ValueError):
    """A sequence_batching value that is wrong; the message names its dotted key."""


@dataclass(frozen=True)
class Control:
    """One control input the server fills per batch row: START, END, READY (a flag, `false_true` its two
    values) or CORRID (the sequence's correlation id)."""

    kind: str  # START, END, READY or CORRID
    input_name: str
    datatype: str  # v2: INT32, FP32 or BOOL for a flag; UINT64, INT64, UINT32, INT32 or BYTES for CORRID
    false_true: tuple[Any, Any] = (0, 1)


@dataclass(frozen=True)
class InitialState:
    """What a state input holds on a sequence's first request: zeros, or a file's raw row-major values
    (the model's directory's initial_state/<data_file>)."""

    datatype: str
    dims: tuple[int, ...]
    data_file: str | None = None  # None: zeros
    name: str = ""


@dataclass(frozen=True)
class StateSpec:
    """Implicit state: the model's output `output_name` after one request is its input `input_name` on the
    next request of the same sequence; clients never send it."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]  # -1: variable (the stored output's shape is used)
    initial: InitialState | None = None  # None: zeros of `dims`, a variable dimension as 1 (as Triton)

    @property
    def initial_dims(self) -> tuple[int, ...]:
        return self.initial.dims if self.initial is not None else tuple(max(d, 1) for d in self.dims)


@dataclass(frozen=True)
class SequenceConfig:
    strategy: str = "direct"  # Triton's default when neither direct nor oldest is given
    max_sequence_idle_us: int = DEFAULT_MAX_SEQUENCE_IDLE_US
    max_queue_delay_us: int = 0  # a partial batch waits this long for company while an instance computes
    max_candidate_sequences: int = 0  # oldest: read and checked; qkv does not bind sequences to instances
    preferred_batch_size: tuple[int, ...] = ()  # oldest: read and checked, not used
    minimum_slot_utilization: float = 0.0  # direct: read and checked, not used
    controls: tuple[Control, ...] = ()
    states: tuple[StateSpec, ...] = ()
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES
    max_sequence_requests: int = 0  # requests from a start on, at most (0: no bound): what a growing state can hold

    def control(self, kind: str) -> Control | None:
        return next((c for c in self.controls if c.kind == kind), None)

    @property
    def hidden_inputs(self) -> frozenset[str]:
        """The inputs the server fills: controls and state inputs (a client sending one is refused)."""
        return frozenset([c.input_name for c in self.controls] + [s.input_name for s in self.states])


def triton_datatype(value: Any, key: str) -> str:
    """TYPE_INT32 (Triton's) or INT32 (the v2 protocol's) -> INT32."""
    if isinstance(value, str) and value in _TRITON_TYPES:
        return _TRITON_TYPES[value]
    if isinstance(value, str) and value in _TRITON_TYPES.values():
        return value
    raise SequenceConfigError(f"{key} must be a datatype such as TYPE_INT32 or TYPE_FP32, got {_shown(value)}")


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text if len(text) <= 64 else text[:61] + "..."


def _int(value: Any, key: str, low: int = 0) -> int:
    """A JSON integer or a decimal string (protobuf's JSON for 64-bit integers), at least `low`."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value >= 1 << 64:
        raise SequenceConfigError(f"{key} must be an integer >= {low}, got {_shown(value)}")
    return value


def _object(value: Any, key: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SequenceConfigError(f"{key} must be a JSON object, got {_shown(value)}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise SequenceConfigError(f"unknown setting(s) {unknown} in {key}; known: {sorted(known)}")
    return value


def _list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise SequenceConfigError(f"{key} must be a list, got {_shown(value)}")
    return value


def _name(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise SequenceConfigError(f"{key} must be a non-empty string, got {_shown(value)}")
    return value


def _dims(value: Any, key: str) -> tuple[int, ...]:
    return tuple(_int(d, f"{key}[{i}]", low=-1) for i, d in enumerate(_list(value, key)))


def _control(raw: Any, key: str, name: str) -> Control:
    c = _object(raw, f"{key}.control[0]", {"kind", "int32_false_true", "fp32_false_true", "bool_false_true",
                                            "data_type"})  # fmt: skip
    where = f"{key}.control[0]"
    kind = CONTROL_KINDS.get(c.get("kind", "CONTROL_SEQUENCE_START"))  # protobuf's JSON leaves out enum 0
    if kind is None:
        raise SequenceConfigError(f"{where}.kind must be one of {sorted(CONTROL_KINDS)}, got {_shown(c.get('kind'))}")
    flags = [f for f in _FLAG_FIELDS if f in c]
    if kind == "CORRID":
        if flags:
            raise SequenceConfigError(f"{where}: CONTROL_SEQUENCE_CORRID takes data_type, not {flags[0]}")
        datatype = triton_datatype(c.get("data_type"), f"{where}.data_type")
        if datatype not in _CORRID_TYPES:
            raise SequenceConfigError(
                f"{where}.data_type: a correlation id is TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or "
                f"TYPE_STRING, got {_shown(c.get('data_type'))}"
            )
        return Control(kind, name, datatype, ("", ""))
    if len(flags) != 1 or "data_type" in c:
        raise SequenceConfigError(
            f"{where}: CONTROL_SEQUENCE_{kind} takes exactly one of {sorted(_FLAG_FIELDS)} (its false and true "
            f"values), got {sorted(set(c) - {'kind'})}"
        )
    field = flags[0]
    pair = _list(c[field], f"{where}.{field}")
    if len(pair) != 2:
        raise SequenceConfigError(f"{where}.{field} must hold two values, false then true, got {_shown(pair)}")
    datatype = _FLAG_FIELDS[field]
    for i, v in enumerate(pair):
        ok = (
            isinstance(v, bool)
            if datatype == "BOOL"
            else (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
            if datatype == "FP32"
            else (isinstance(v, int) and not isinstance(v, bool) and -(1 << 31) <= v < 1 << 31)
        )
        if not ok:
            raise SequenceConfigError(f"{where}.{field}[{i}] must be a {datatype} value, got {_shown(v)}")
    return Control(kind, name, datatype, (pair[0], pair[1]))


def _state(raw: Any, key: str) -> StateSpec:
    s = _object(raw, key, {"input_name", "output_name", "data_type", "dims", "initial_state",
                           "use_same_buffer_for_input_output", "use_growable_memory"})  # fmt: skip
    for missing in ("input_name", "output_name", "data_type", "dims"):
        if missing not in s:
            raise SequenceConfigError(f"{key}: missing {missing}")
    datatype = triton_datatype(s["data_type"], f"{key}.data_type")
    dims = _dims(s["dims"], f"{key}.dims")
    initial = None
    inits = _list(s.get("initial_state", []), f"{key}.initial_state")
    if len(inits) > 1:
        raise SequenceConfigError(f"{key}.initial_state: at most one, got {len(inits)}")
    if inits:
        at = f"{key}.initial_state[0]"
        i = _object(inits[0], at, {"data_type", "dims", "zero_data", "data_file", "name"})
        if ("zero_data" in i) == ("data_file" in i):
            raise SequenceConfigError(f"{at}: give one of zero_data or data_file")
        if "zero_data" in i and i["zero_data"] is not True:
            raise SequenceConfigError(f"{at}.zero_data must be true, got {_shown(i['zero_data'])}")
        init_type = triton_datatype(i.get("data_type"), f"{at}.data_type")
        if init_type != datatype:
            raise SequenceConfigError(f"{at}.data_type {init_type} differs from the state's {datatype}")
        init_dims = _dims(i.get("dims"), f"{at}.dims")
        if any(d < 0 for d in init_dims):
            raise SequenceConfigError(f"{at}.dims must be fixed (>= 0), got {list(init_dims)}")
        if len(init_dims) != len(dims) or any(d >= 0 and d != n for d, n in zip(dims, init_dims, strict=True)):
            raise SequenceConfigError(f"{at}.dims {list(init_dims)} do not fit the state's dims {list(dims)}")
        data_file = None
        if "data_file" in i:
            data_file = _name(i["data_file"], f"{at}.data_file")
            if "/" in data_file or "\\" in data_file or data_file.startswith("."):
                raise SequenceConfigError(f"{at}.data_file must name a file in initial_state/, got {_shown(data_file)}")
        initial = InitialState(datatype, init_dims, data_file, str(i.get("name", "")))
    elif datatype == "BYTES":
        raise SequenceConfigError(f"{key}: a TYPE_STRING state needs an initial_state")
    return StateSpec(
        _name(s["input_name"], f"{key}.input_name"),
        _name(s["output_name"], f"{key}.output_name"),
        datatype,
        dims,
        initial,
    )


def parse_sequence_batching(raw: Any) -> SequenceConfig:
    """config.json's "sequence_batching" -> SequenceConfig; SequenceConfigError naming the key when wrong."""
    key = "sequence_batching"
    s = _object(raw, key, {"max_sequence_idle_microseconds", "direct", "oldest", "control_input", "state",
                           "iterative_sequence", "max_sequences", "max_state_bytes",
                           "max_sequence_requests"})  # fmt: skip
    if "direct" in s and "oldest" in s:
        raise SequenceConfigError(f"{key}: give one strategy, direct or oldest, not both")
    out: dict[str, Any] = {}
    if "oldest" in s:
        known = {"max_candidate_sequences", "preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering"}
        o = _object(s["oldest"] or {}, f"{key}.oldest", known)
        out["strategy"] = "oldest"
        if "max_candidate_sequences" in o:
            out["max_candidate_sequences"] = _int(
                o["max_candidate_sequences"], f"{key}.oldest.max_candidate_sequences", 1
            )
        if "preferred_batch_size" in o:
            sizes = _list(o["preferred_batch_size"], f"{key}.oldest.preferred_batch_size")
            out["preferred_batch_size"] = tuple(
                _int(n, f"{key}.oldest.preferred_batch_size[{i}]", 1) for i, n in enumerate(sizes)
            )
        if "max_queue_delay_microseconds" in o:
            out["max_queue_delay_us"] = _int(
                o["max_queue_delay_microseconds"], f"{key}.oldest.max_queue_delay_microseconds"
            )
        if not isinstance(o.get("preserve_ordering", False), bool):
            raise SequenceConfigError(f"{key}.oldest.preserve_ordering must be true or false")
    elif "direct" in s:
        d = _object(s["direct"] or {}, f"{key}.direct", {"max_queue_delay_microseconds", "minimum_slot_utilization"})
        if "max_queue_delay_microseconds" in d:
            out["max_queue_delay_us"] = _int(
                d["max_queue_delay_microseconds"], f"{key}.direct.max_queue_delay_microseconds"
            )
        if "minimum_slot_utilization" in d:
            u = d["minimum_slot_utilization"]
            if isinstance(u, bool) or not isinstance(u, int | float) or not 0 <= u <= 1:
                raise SequenceConfigError(
                    f"{key}.direct.minimum_slot_utilization must be a number in [0, 1], got {_shown(u)}"
                )
            out["minimum_slot_utilization"] = float(u)
    if "max_sequence_idle_microseconds" in s:
        out["max_sequence_idle_us"] = _int(
            s["max_sequence_idle_microseconds"], f"{key}.max_sequence_idle_microseconds", 1
        )
    if s.get("iterative_sequence", False) is not False:
        raise SequenceConfigError(f"{key}.iterative_sequence: qkv does not serve iterative sequences")
    for bound in ("max_sequences", "max_state_bytes", "max_sequence_requests"):
        if bound in s:
            out[bound] = _int(s[bound], f"{key}.{bound}", 1)
    controls = []
    for i, entry in enumerate(_list(s.get("control_input", []), f"{key}.control_input")):
        at = f"{key}.control_input[{i}]"
        c = _object(entry, at, {"name", "control"})
        name = _name(c.get("name"), f"{at}.name")
        kinds = _list(c.get("control"), f"{at}.control")
        if len(kinds) != 1:
            raise SequenceConfigError(f"{at}.control must hold exactly one control, got {len(kinds)}")
        controls.append(_control(kinds[0], at, name))
    states = [_state(entry, f"{key}.state[{i}]") for i, entry in enumerate(_list(s.get("state", []), f"{key}.state"))]
    names = [c.input_name for c in controls] + [x.input_name for x in states]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SequenceConfigError(f"{key}: input {twice[0]!r} is named by more than one control or state")
    kinds_given = [c.kind for c in controls]
    again = sorted({k for k in kinds_given if kinds_given.count(k) > 1})
    if again:
        raise SequenceConfigError(f"{key}: more than one CONTROL_SEQUENCE_{again[0]} input")
    outputs = [x.output_name for x in states]
    if len(set(outputs)) != len(outputs):
        raise SequenceConfigError(f"{key}: two states share an output_name")
    return SequenceConfig(controls=tuple(controls), states=tuple(states), **out)
