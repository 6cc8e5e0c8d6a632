"""How large a model's outputs can be, known before it runs: what an ensemble checks before each step.

An output's shape is read from its declaration: a fixed dimension is its own bound; a dynamic one (-1)
is bounded by the request, or by a declared limit:
- a dimension with an axis name that an input also has takes that input's size there (ONNX: dimensions
  of one name are one size), so `Y ["batch", "n", "n"]` from `X ["batch", "n"]` of [1, 65536] is
  [1, 65536, 65536] at most;
- the batch axis (dimension 0 of a model with a batch axis) takes the request's rows;
- an axis name the kind itself bounds (`axis_limits`: g2p's words, phonemes and letters);
- else the model's `limits.max_output_elements` (config.json) bounds the whole output.
An output none of these bounds is refused at load (`unbounded`), so that every step's output has a
size known from its inputs before the step runs (`predicted`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

import numpy as np

from service.models.runtime import TensorSpec

__all__ = ["Bound", "Declared", "predicted", "unbounded"]


@dataclass(frozen=True)
class Declared:
    """What bounds a model's outputs: its tensors, its batch axis and the limits it declares."""

    inputs: tuple[TensorSpec, ...]
    batched: bool  # dimension 0 of every tensor is the batch axis
    axis_limits: Mapping[str, int]  # an axis name -> its largest size (the kind's)
    max_output_elements: int | None  # config.json limits: an output of one request, at most


@dataclass(frozen=True)
class Bound:
    """An output's largest shape (None where only its elements are bounded) and its elements, at most."""

    shape: tuple[int, ...] | None
    elements: int


def _named(declared: Declared) -> set[str]:
    return {a for s in declared.inputs for a in s.axes if a} | set(declared.axis_limits)


def unbounded(declared: Declared, output: TensorSpec) -> str:
    """Why `output`'s size cannot be known before the model runs ("" when it can)."""
    if declared.max_output_elements is not None:
        return ""
    named = _named(declared)
    for i, (dim, axis) in enumerate(zip(output.shape, output.axes, strict=True)):
        if dim >= 0 or (axis and axis in named) or (i == 0 and declared.batched):
            continue
        what = f"axis '{axis}'" if axis else "an unnamed axis"
        return f"dimension {i} ({what}) is dynamic and no input's dimension or declared limit bounds it"
    return ""


def _sizes(declared: Declared, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, int], int]:
    """Each axis name's size in `feeds` (the largest, where inputs disagree), and the rows."""
    sizes, rows = dict(declared.axis_limits), 0
    for spec in declared.inputs:
        array = feeds.get(spec.name)
        if array is None:
            continue
        shape = array.shape
        rows = max(rows, shape[0] if shape else 1)
        for i, axis in enumerate(spec.axes):
            if axis:
                # a tensor whose rank is not its declaration's (g2p's TEXT of any shape): the axis may hold all
                # of it (the product of its dimensions but zeros, so that an empty tensor bounds nothing away)
                size = shape[i] if len(shape) == len(spec.axes) else prod(d for d in shape if d)
                sizes[axis] = max(sizes.get(axis, 0), size)
    return sizes, rows


def predicted(declared: Declared, output: TensorSpec, feeds: Mapping[str, np.ndarray]) -> Bound | None:
    """The largest `output` the model can answer for `feeds` (its own tensor names); None when nothing bounds
    it (a model that `unbounded` refuses)."""
    sizes, rows = _sizes(declared, feeds)
    dims: list[int] = []
    for i, (dim, axis) in enumerate(zip(output.shape, output.axes, strict=True)):
        if dim >= 0:
            dims.append(dim)
        elif axis and axis in sizes:
            dims.append(sizes[axis])
        elif i == 0 and declared.batched:
            dims.append(rows)
        elif declared.max_output_elements is not None:  # unbounded by its shape: the declared limit
            return Bound(None, declared.max_output_elements)
        else:
            return None
    elements = prod(dims)
    if declared.max_output_elements is not None:
        elements = min(elements, declared.max_output_elements)
    return Bound(tuple(dims), elements)
