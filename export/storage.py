"""Weights stored as fp16, computed in fp32: the shipped graphs at half their size.

Each float32 weight of a graph is stored as float16 and cast back to float32 by a Cast node at the head of
the graph. onnxruntime folds those Casts into float32 weights when it builds a session (constant folding,
part of every optimization level but "disable"), so a request computes exactly as an fp32 graph does, at
its speed; only the weights' rounding to fp16 (a relative error of at most 2^-11) changes the results.
`export/onnx_export.py` checks what that rounding changes before it writes a repository.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeVar

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

__all__ = ["MIN_ELEMENTS", "main", "round_weights_fp16", "store_weights_fp16", "weights_fp32"]

MIN_ELEMENTS = 16  # smaller constants (a scale, a mask value) stay exact in fp32: they save nothing
_FP16_MAX = float(np.finfo(np.float16).max)
_SUFFIX = "__fp16"
M = TypeVar("M", bound=torch.nn.Module)


def _storable(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).all() and np.abs(values).max() <= _FP16_MAX)


def store_weights_fp16(path: Path) -> int:
    """Rewrite the ONNX file at `path` with its float32 weights stored as fp16; returns how many were."""
    model = onnx.load(str(path))
    graph = model.graph
    inputs = {i.name for i in graph.input}  # an initializer that is also an input can be overridden: keep it
    casts, kept = [], []
    for tensor in graph.initializer:
        exempt = tensor.data_type != TensorProto.FLOAT or np.prod(tensor.dims) < MIN_ELEMENTS
        values = None if exempt or tensor.name in inputs else numpy_helper.to_array(tensor)
        if values is None or not _storable(values):
            kept.append(tensor)
            continue
        half = numpy_helper.from_array(values.astype(np.float16), tensor.name + _SUFFIX)
        kept.append(half)
        casts.append(helper.make_node("Cast", [half.name], [tensor.name], to=TensorProto.FLOAT))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend([*casts, *nodes])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return len(casts)


def weights_fp32(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with the Casts of `store_weights_fp16` folded back into float32 weights (in place): tools
    that look for a MatMul's weights among the initializers (int8 quantization) find them there."""
    graph = model.graph
    halves = {t.name: t for t in graph.initializer if t.name.endswith(_SUFFIX)}
    casts = [n for n in graph.node if n.op_type == "Cast" and len(n.input) == 1 and n.input[0] in halves]
    for node in casts:
        half = halves.pop(node.input[0])
        graph.initializer.remove(half)
        weight = numpy_helper.to_array(half).astype(np.float32)
        graph.initializer.append(numpy_helper.from_array(weight, node.output[0]))
        graph.node.remove(node)
    return model


def round_weights_fp16(model: M) -> M:
    """`model`'s parameters rounded to fp16 (in place), as `store_weights_fp16` stores them: the PyTorch
    model the stored graphs compute."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.float32 and p.numel() >= MIN_ELEMENTS:
                p.copy_(p.half().float())
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.storage", description=__doc__)
    parser.add_argument("graphs", nargs="+", type=Path, help="ONNX files, rewritten in place")
    args = parser.parse_args(argv)
    for path in args.graphs:
        before = path.stat().st_size
        stored = store_weights_fp16(path)
        print(f"{path}: {stored} weights stored as fp16, {before / 1e6:.1f} MB -> {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
