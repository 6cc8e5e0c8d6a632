"""Tensors for the command-line tools, for any model: read from .npy files and JSON, checked against the
model's metadata before anything is sent, and the answer's outputs turned back into arrays.

    qkv infer --model g2p_encoder --input input_ids=ids.npy --input attention_mask=@mask.json
    qkv infer --model scores --input x='[[0.5, 1.0]]' --datatype x=FP32 --shape x=1,2

A value is a .npy file (numpy's own format, no pickles), `@FILE` (JSON), or inline JSON: nested lists of
numbers, booleans or strings (BYTES). Its datatype is the model's (`--datatype` may say it too, and must
agree); its shape is the value's own, or `--shape`. A value one axis short of the model's rank gains a
batch axis of 1 in front when the model's first axis is variable. Every refusal names the input.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service import protocol
from service.datatypes import NUMPY_DTYPES, decode_bytes, encode_bytes

__all__ = ["Given", "TensorError", "checked", "given_inputs", "outputs_json", "outputs_of", "outputs_text", "request"]


class TensorError(ValueError):
    """An input the model cannot take, said in one line that names it."""


@dataclass
class Given:
    """One `--input NAME=VALUE`, with its `--datatype` and `--shape` when given."""

    name: str
    value: np.ndarray
    datatype: str | None = None
    shape: tuple[int, ...] | None = None


def _pairs(flag: str, items: Iterable[str]) -> dict[str, str]:
    """NAME=TEXT items (a flag given several times) by name; each name once."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or not name:
            raise TensorError(f"{flag} {item}: must be NAME=VALUE")
        if name in out:
            raise TensorError(f"{flag} {name}: given twice")
        out[name] = text
    return out


def _value(name: str, text: str) -> np.ndarray:
    """An input's value from a .npy file, @FILE of JSON, or JSON written out."""
    if text.endswith(".npy") and not text.lstrip().startswith(("[", "@")):
        path = Path(text)
        if not path.is_file():
            raise TensorError(f"input '{name}': file not found: {path}")
        try:
            return np.asarray(np.load(path, allow_pickle=False))
        except ValueError as e:  # a pickled (object) array, or not a .npy file at all
            raise TensorError(f"input '{name}': {path} is not a .npy array of numbers: {e}") from None
    where = "JSON"
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise TensorError(f"input '{name}': file not found: {path}")
        text, where = path.read_text(), f"JSON in {path}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TensorError(f"input '{name}': not a .npy file, @FILE or JSON ({where}: {e})") from None
    if isinstance(data, dict) and "data" in data:  # the v2 JSON form: {"data": [...], "shape": ..., "datatype": ...}
        data = data["data"]
    try:
        array = np.array(data)
    except ValueError:
        raise TensorError(f"input '{name}': the lists of its {where} are ragged (rows of different lengths)") from None
    if array.dtype.kind in "US":
        array = np.array([s.encode() if isinstance(s, str) else s for s in array.ravel()], dtype=np.object_).reshape(
            array.shape
        )
    elif array.dtype == np.object_:
        raise TensorError(f"input '{name}': its {where} mixes strings and numbers, or lists and scalars")
    return array


def _dims(name: str, text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise TensorError(f"--shape {name}={text}: must be whole numbers separated by commas") from None
    if any(d < 0 for d in dims):
        raise TensorError(f"--shape {name}={text}: a dimension below 0")
    return dims


def given_inputs(inputs: Iterable[str], datatypes: Iterable[str] = (), shapes: Iterable[str] = ()) -> list[Given]:
    """The `--input`, `--datatype` and `--shape` flags as inputs; a TensorError for what cannot be read."""
    values, types, dims = _pairs("--input", inputs), _pairs("--datatype", datatypes), _pairs("--shape", shapes)
    for flag, named in (("--datatype", types), ("--shape", dims)):
        stray = sorted(set(named) - set(values))
        if stray:
            raise TensorError(f"{flag} {stray[0]}: no --input of that name")
    for name, datatype in types.items():
        if datatype.upper() not in NUMPY_DTYPES:
            raise TensorError(f"--datatype {name}={datatype}: not a v2 datatype ({', '.join(NUMPY_DTYPES)})")
    return [
        Given(
            name,
            _value(name, text),
            types[name].upper() if name in types else None,
            _dims(name, dims[name]) if name in dims else None,
        )
        for name, text in values.items()
    ]


def _as_datatype(g: Given, array: np.ndarray, datatype: str) -> np.ndarray:
    """`array` in `datatype`'s numpy type, or a TensorError when a value would change on the way."""
    target = np.dtype(NUMPY_DTYPES[datatype])
    if datatype == "BYTES":
        if array.dtype != np.object_:
            raise TensorError(f"input '{g.name}': the model takes BYTES (strings), the value holds {array.dtype}")
        return array
    if array.dtype == np.object_:
        raise TensorError(f"input '{g.name}': the model takes {datatype}, the value holds strings")
    if array.dtype == target:
        return array
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN or a value out of range: refused just below
        converted = array.astype(target)
    if target.kind in "iub" and not np.array_equal(converted, array):  # 1.0 fits INT64; 1.5, 300 in UINT8 do not
        raise TensorError(f"input '{g.name}': values of {array.dtype} do not fit the model's {datatype} unchanged")
    return converted


def _shaped(g: Given, array: np.ndarray, dims: list[int]) -> np.ndarray:
    """`array` in the model's rank: --shape applied, a batch axis of 1 added where one is missing."""
    if g.shape is not None:
        if math.prod(g.shape) != array.size:
            raise TensorError(f"input '{g.name}': --shape {list(g.shape)} holds {math.prod(g.shape)} elements, "
                              f"the value has {array.size}")  # fmt: skip
        array = array.reshape(g.shape)
    if array.ndim == len(dims) - 1 and dims and dims[0] == -1:
        array = array[np.newaxis]
    wanted = "[" + ", ".join(str(d) for d in dims) + "]"
    if array.ndim != len(dims) or any(d not in (-1, n) for d, n in zip(dims, array.shape, strict=True)):
        raise TensorError(
            f"input '{g.name}': shape {list(array.shape)} does not fit the model's {wanted} (-1: any length)"
        )
    return array


def checked(given: list[Given], metadata: Any) -> dict[str, tuple[str, np.ndarray]]:
    """Each input as the model's metadata (a ModelMetadataResponse) declares it: name -> (datatype, array).
    A TensorError names an input the model lacks, one it needs and was not given, a datatype that differs,
    or a shape that does not fit."""
    declared = {t.name: t for t in metadata.inputs}
    names = ", ".join(declared) or "none"
    out: dict[str, tuple[str, np.ndarray]] = {}
    for g in given:
        if g.name not in declared:
            raise TensorError(f"input '{g.name}': model '{metadata.name}' has no such input (inputs: {names})")
        spec = declared[g.name]
        if g.datatype is not None and g.datatype != spec.datatype:
            raise TensorError(f"input '{g.name}': --datatype {g.datatype}, the model takes {spec.datatype}")
        array = _shaped(g, _as_datatype(g, g.value, spec.datatype), list(spec.shape))
        out[g.name] = (spec.datatype, array)
    missing = [name for name in declared if name not in out]
    if missing:
        raise TensorError(f"model '{metadata.name}' needs input '{missing[0]}' too (--input {missing[0]}=VALUE)")
    return out


def request(model: str, version: str, inputs: Mapping[str, tuple[str, np.ndarray]], outputs: Iterable[str]) -> Any:
    """A ModelInferRequest of `inputs` (name -> (datatype, array)), raw little-endian contents."""
    req = protocol.ModelInferRequest(model_name=model, model_version=version)
    for name, (datatype, array) in inputs.items():
        req.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if datatype == "BYTES":
            req.raw_input_contents.append(encode_bytes(array.ravel()))
        else:
            req.raw_input_contents.append(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    for name in outputs:
        req.outputs.add(name=name)
    return req


def outputs_of(response: Any) -> dict[str, tuple[str, np.ndarray]]:
    """A ModelInferResponse's outputs: name -> (datatype, array); BYTES as an object array of bytes."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        shape = tuple(int(d) for d in tensor.shape)
        if tensor.datatype == "BYTES":
            array = np.array(decode_bytes(raw, math.prod(shape), tensor.name), dtype=np.object_).reshape(shape)
        else:
            array = np.frombuffer(raw, dtype=np.dtype(NUMPY_DTYPES[tensor.datatype]).newbyteorder("<")).reshape(shape)
        out[tensor.name] = (tensor.datatype, array)
    return out


def _plain(array: np.ndarray) -> list[Any]:
    """An array as JSON can hold it: flat, BYTES as text."""
    if array.dtype == np.object_:
        return [b.decode(errors="replace") if isinstance(b, bytes) else str(b) for b in array.ravel()]
    return list(array.ravel().tolist())


def outputs_json(response: Any) -> str:
    """The answer as the v2 REST protocol writes one: name, datatype, shape and the flat data of each output."""
    outputs = [
        {"name": name, "datatype": datatype, "shape": list(array.shape), "data": _plain(array)}
        for name, (datatype, array) in outputs_of(response).items()
    ]
    return json.dumps({"model_name": response.model_name, "model_version": response.model_version,
                       "outputs": outputs})  # fmt: skip


def outputs_text(response: Any) -> str:
    """Each output as `NAME DATATYPE [shape]` and its values, for a person to read."""
    blocks = []
    for name, (datatype, array) in outputs_of(response).items():
        shown = np.vectorize(lambda b: b.decode(errors="replace"), otypes=[object])(array) if array.size and (
            array.dtype == np.object_) else array  # fmt: skip
        values = np.array2string(np.asarray(shown), threshold=200, edgeitems=4, max_line_width=120)
        blocks.append(f"{name} {datatype} {list(array.shape)}\n{values}")
    return "\n".join(blocks)
