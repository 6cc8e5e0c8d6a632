"""Models for the ensemble tests: an image pipeline in plain ONNX, and small arithmetic steps.

The pipeline is Triton's image-classification ensemble in a form onnxruntime runs alone: a pre-processing
model that decodes an image file sent as one BYTES element (plain PPM, "P3 W H MAX r g b ...", numbers
separated by single spaces), and a classifier with a labels file. `write_ppm` writes such a file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

__all__ = [
    "LABELS",
    "classify_pixels",
    "image_pipeline",
    "outer_product",
    "ppm_bytes",
    "save",
    "scale_add",
    "unbounded_repeat",
]

LABELS = [f"class_{i}" for i in range(10)]
HEADER = 4  # P3, width, height, max value


def save(graph: onnx.GraphProto, directory: Path, config: dict[str, Any] | None = None, opset: int = 17) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))


def ppm_bytes(pixels: np.ndarray) -> bytes:
    """An [H, W, 3] uint8 image as plain PPM text."""
    h, w, _ = pixels.shape
    return " ".join(["P3", str(w), str(h), "255", *map(str, pixels.reshape(-1).tolist())]).encode()


def _decode_ppm(directory: Path, size: int) -> None:
    """IMAGE BYTES [batch, 1] (plain PPM of size x size) -> PIXELS FP32 [batch, 3, size, size] in [0, 1]."""
    count = 3 * size * size
    const = helper.make_tensor
    inits = [
        const("start", TensorProto.INT64, [1], [HEADER]),
        const("end", TensorProto.INT64, [1], [HEADER + count]),
        const("max_at", TensorProto.INT64, [1], [HEADER - 1]),
        const("axis", TensorProto.INT64, [1], [2]),
        const("hwc", TensorProto.INT64, [4], [-1, size, size, 3]),
        const("per_image", TensorProto.INT64, [4], [-1, 1, 1, 1]),
    ]
    # Tokens padded with "0"s: a short file (the server's warm-up sends "1") decodes as zeros, not an error.
    pad = helper.make_tensor("pad", TensorProto.STRING, [1, 1, HEADER + count], [b"0"] * (HEADER + count))
    inits += [pad, const("two", TensorProto.INT64, [1], [2]), const("zero", TensorProto.INT64, [1], [0])]
    nodes = [
        helper.make_node("StringSplit", ["IMAGE"], ["split", "counts"], delimiter=" "),
        helper.make_node("Shape", ["split"], ["split_shape"]),
        helper.make_node("Slice", ["split_shape", "zero", "two"], ["rows"]),
        helper.make_node("Concat", ["rows", "end"], ["padded_shape"], axis=0),
        helper.make_node("Expand", ["pad", "padded_shape"], ["zeros"]),
        helper.make_node("Concat", ["split", "zeros"], ["tokens"], axis=2),
        helper.make_node("Slice", ["tokens", "start", "end", "axis"], ["pixel_text"]),
        helper.make_node("Cast", ["pixel_text"], ["values"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["values", "hwc"], ["image"]),
        helper.make_node("Transpose", ["image"], ["chw"], perm=[0, 3, 1, 2]),
        helper.make_node("Gather", ["tokens", "max_at"], ["max_text"], axis=2),
        helper.make_node("Cast", ["max_text"], ["max_value"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["max_value", "per_image"], ["scale"]),
        helper.make_node("Div", ["chw", "scale"], ["PIXELS"]),
    ]
    x = helper.make_tensor_value_info("IMAGE", TensorProto.STRING, ["batch", 1])
    y = helper.make_tensor_value_info("PIXELS", TensorProto.FLOAT, ["batch", 3, size, size])
    save(helper.make_graph(nodes, "decode_ppm", [x], [y], inits), directory, {"max_batch_size": 8}, opset=20)


CLASSIFIER_WEIGHTS = np.random.default_rng(5).standard_normal((3, len(LABELS))).astype(np.float32)


def classify_pixels(pixels: np.ndarray) -> np.ndarray:
    """What the classifier computes for FP32 [batch, 3, H, W]: each channel's mean times a fixed matrix."""
    return pixels.mean(axis=(2, 3)) @ CLASSIFIER_WEIGHTS


def _classifier(directory: Path, size: int) -> None:
    """PIXELS FP32 [batch, 3, size, size] -> SCORES FP32 [batch, 10]."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])
    y = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", len(LABELS)])
    w = helper.make_tensor("w", TensorProto.FLOAT, CLASSIFIER_WEIGHTS.shape, CLASSIFIER_WEIGHTS.ravel().tolist())
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["means"], axes=[2, 3], keepdims=0),
        helper.make_node("MatMul", ["means", "w"], ["scores"]),
    ]
    save(helper.make_graph(nodes, "classifier", [x], [y], [w]), directory, {"max_batch_size": 8})


def image_pipeline(root: Path, size: int, name: str = "image_ensemble", prefix: str = "") -> None:
    """`{prefix}decode_ppm`, `{prefix}classifier`, and the ensemble `name` of the two: IMAGE BYTES [batch, 1]
    -> SCORES FP32 [batch, 10], with class labels (Triton's classification)."""
    _decode_ppm(root / f"{prefix}decode_ppm", size)
    _classifier(root / f"{prefix}classifier", size)
    ensemble = root / name
    (ensemble / "1").mkdir(parents=True)
    (ensemble / "labels.txt").write_text("\n".join(LABELS) + "\n")
    config = {
        "platform": "ensemble",
        "max_batch_size": 8,
        "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1, 1]}],
        "outputs": [{"name": "SCORES", "datatype": "FP32", "shape": [-1, len(LABELS)], "label_filename": "labels.txt"}],
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": f"{prefix}decode_ppm",
                    "model_version": -1,
                    "input_map": {"IMAGE": "IMAGE"},
                    "output_map": {"PIXELS": "pixels"},
                },
                {
                    "model_name": f"{prefix}classifier",
                    "model_version": -1,
                    "input_map": {"input": "pixels"},
                    "output_map": {"scores": "SCORES"},
                },
            ]
        },
    }
    (ensemble / "config.json").write_text(json.dumps(config))


def _binary(directory: Path, op: str, constant: float | None = None) -> None:
    """a (and b, or a constant) FP32 [batch, 4] -> c = a OP b."""
    names = ["a"] if constant is not None else ["a", "b"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in names]
    inits = [helper.make_tensor("b", TensorProto.FLOAT, [1], [constant])] if constant is not None else []
    out = helper.make_tensor_value_info("c", TensorProto.FLOAT, ["batch", 4])
    save(helper.make_graph([helper.make_node(op, ["a", "b"], ["c"])], op, inputs, [out], inits), directory)


def scale_add(root: Path) -> None:
    """Three arithmetic models (double, negate, add) and the ensemble `fan` of them, a diamond: X is doubled
    and negated by two independent steps, and their results added: SUM = 2X + (-X) = X, with DOUBLE and
    NEGATED also outputs of the ensemble."""
    _binary(root / "double", "Mul", 2.0)
    _binary(root / "negate", "Mul", -1.0)
    _binary(root / "add", "Add")
    (root / "fan" / "1").mkdir(parents=True)
    spec = {"datatype": "FP32", "shape": [-1, 4]}
    config = {
        "kind": "ensemble",
        "inputs": [{"name": "X", **spec}],
        "outputs": [{"name": n, **spec} for n in ("SUM", "DOUBLE", "NEGATED")],
        "ensemble_scheduling": {
            "step": [  # listed out of order: the add step reads what the others write
                {"model_name": "add", "input_map": {"a": "DOUBLE", "b": "NEGATED"}, "output_map": {"c": "SUM"}},
                {"model_name": "double", "input_map": {"a": "X"}, "output_map": {"c": "DOUBLE"}},
                {"model_name": "negate", "input_map": {"a": "X"}, "output_map": {"c": "NEGATED"}},
            ]
        },
    }
    (root / "fan" / "config.json").write_text(json.dumps(config))


def outer_product(root: Path, name: str = "outer_sum") -> None:
    """`outer` (A FP32 [batch, n], B FP32 [batch, m] -> P FP32 [batch, n, m], the outer product of each row),
    `total` (P -> S FP32 [batch], the sum of each), and the ensemble `name` of the two: A, B -> S. A request
    of [1, 65536] and [1, 8192] (288 KiB) would make P 2 GiB."""
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, ["batch", "n"])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, ["batch", "m"])
    p = helper.make_tensor_value_info("P", TensorProto.FLOAT, ["batch", "n", "m"])
    inits = [
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("middle", TensorProto.INT64, [1], [1]),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["A", "last"], ["column"]),  # [batch, n, 1]
        helper.make_node("Unsqueeze", ["B", "middle"], ["row"]),  # [batch, 1, m]
        helper.make_node("Mul", ["column", "row"], ["P"]),  # [batch, n, m]
    ]
    save(helper.make_graph(nodes, "outer", [a, b], [p], inits), root / "outer", {"max_batch_size": 8})
    s = helper.make_tensor_value_info("S", TensorProto.FLOAT, ["batch"])
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])
    total = helper.make_node("ReduceSum", ["P", "axes"], ["S"], keepdims=0)
    save(helper.make_graph([total], "total", [p], [s], [axes]), root / "total", {"max_batch_size": 8})
    (root / name / "1").mkdir(parents=True)
    config = {
        "kind": "ensemble",
        "max_batch_size": 8,
        "inputs": [
            {"name": "A", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "B", "datatype": "FP32", "shape": [-1, -1]},
        ],
        "outputs": [{"name": "S", "datatype": "FP32", "shape": [-1]}],
        "ensemble_scheduling": {
            "step": [
                {"model_name": "outer", "input_map": {"A": "A", "B": "B"}, "output_map": {"P": "product"}},
                {"model_name": "total", "input_map": {"P": "product"}, "output_map": {"S": "S"}},
            ]
        },
    }
    (root / name / "config.json").write_text(json.dumps(config))


def unbounded_repeat(root: Path, name: str, limit: int | None) -> None:
    """`{name}_step` (X FP32 [batch, 4], R INT64 [2] -> Y FP32 [batch, ?]: X tiled R times, an output dimension
    that no input's bounds) and the ensemble `name` of it; with `limit`, the step model's config.json declares
    limits.max_output_elements."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])
    r = helper.make_tensor_value_info("R", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", None])
    tile = helper.make_node("Tile", ["X", "R"], ["Y"])
    step_config: dict[str, Any] = {} if limit is None else {"limits": {"max_output_elements": limit}}
    save(helper.make_graph([tile], "tile", [x, r], [y]), root / f"{name}_step", step_config)
    (root / name / "1").mkdir(parents=True)
    config = {
        "kind": "ensemble",
        "inputs": [
            {"name": "X", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "R", "datatype": "INT64", "shape": [2]},
        ],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, -1]}],
        "ensemble_scheduling": {
            "step": [{"model_name": f"{name}_step", "input_map": {"X": "X", "R": "R"}, "output_map": {"Y": "Y"}}]
        },
    }
    (root / name / "config.json").write_text(json.dumps(config))
