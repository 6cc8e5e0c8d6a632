"""Small ONNX graphs built with onnx.helper for the serving tests: encoders with and without an attention
mask, a lookup table without declared limits, and an output far larger than its input."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from tests.conftest import RunningServer, start_server, stop_server
from tests.service.ensemble_models import save as save_graph

VOCAB, WIDTH = 20, 4  # the encoders' vocabulary and hidden width


def save(nodes: list[Any], name: str, inputs: list[Any], outputs: list[Any], inits: list[Any], directory: Path,
         config: dict[str, Any] | None = None) -> None:  # fmt: skip
    """A graph of `nodes` saved by `save_graph`."""
    save_graph(helper.make_graph(nodes, name, inputs, outputs, inits), directory, config)


def serving(repo: Path, *args: str) -> Iterator[RunningServer]:
    """A module fixture's body: a server on `repo` (and `args`), stopped after, its log free of tracebacks."""
    s = start_server(["--model-repository", str(repo), *args], repo.parent / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


def _embedding() -> Any:
    table = np.random.default_rng(1).standard_normal((VOCAB, WIDTH)).astype(np.float32)
    return helper.make_tensor("table", TensorProto.FLOAT, table.shape, table.ravel().tolist())


def maskless_encoder(directory: Path, config: dict[str, Any] | None = None, output_axis: str = "seq") -> None:
    """ids INT64 [batch, seq] -> y FP32 [batch, `output_axis`, WIDTH]: each token's embedding plus the mean
    of the whole sequence's, padding included (no mask says which positions are real)."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", output_axis, WIDTH])
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["mean"], axes=[1], keepdims=1),
        helper.make_node("Add", ["h", "mean"], ["y"]),
    ]
    save(nodes, "maskless", [ids], [y], [_embedding()], directory, config)


def masked_encoder(directory: Path, config: dict[str, Any] | None = None) -> None:
    """ids and attention_mask INT64 [batch, seq] -> y FP32 [batch, seq, WIDTH]: each token's embedding plus the
    mean of the real positions' (the mask's ones)."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", WIDTH])
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["h"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "last"], ["m3"]),
        helper.make_node("Mul", ["h", "m3"], ["kept"]),
        helper.make_node("ReduceSum", ["kept", "seq_axis"], ["total"], keepdims=1),
        helper.make_node("ReduceSum", ["m3", "seq_axis"], ["count"], keepdims=1),
        helper.make_node("Div", ["total", "count"], ["mean"]),
        helper.make_node("Add", ["h", "mean"], ["y"]),
    ]
    inits = [
        _embedding(),
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("seq_axis", TensorProto.INT64, [1], [1]),
    ]
    save(nodes, "masked", [ids, mask], [y], inits, directory, config)


def lookup(directory: Path, config: dict[str, Any] | None = None) -> None:
    """ids INT64 [batch, seq] -> y FP32 [batch, seq, WIDTH], a table of VOCAB rows: an id out of the table is
    onnxruntime's Gather error (no limits.vocab_size declares the bound)."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", WIDTH])
    save([helper.make_node("Gather", ["table", "ids"], ["y"])], "lookup", [ids], [y], [_embedding()], directory,
         config)  # fmt: skip


def widener(directory: Path) -> None:
    """x FP32 [batch, 1] -> y FP32 [batch, n]: x repeated n times, n an INT64 [batch, 1] input (its first row's
    value): a few bytes in, as many out as asked."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])
    n = helper.make_tensor_value_info("n", TensorProto.INT64, ["batch", 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "wide"])
    nodes = [
        helper.make_node("Shape", ["x"], ["rows"], end=1),
        helper.make_node("Slice", ["n", "zero", "one"], ["first"]),  # [1, 1]
        helper.make_node("Reshape", ["first", "one"], ["count"]),  # [1]
        helper.make_node("Concat", ["rows", "count"], ["shape"], axis=0),
        helper.make_node("Expand", ["x", "shape"], ["y"]),
    ]
    inits = [
        helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
        helper.make_tensor("one", TensorProto.INT64, [1], [1]),
    ]
    save(nodes, "widener", [x, n], [y], inits, directory)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on a /metrics page whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total
