"""Triton's example model repository, built from the files beside this script: the configs (Triton's
`config.pbtxt` as Triton ships them in docs/examples/model_repository, `simple_identity` switched to
`platform: "onnxruntime_onnx"`) and ONNX graphs equivalent to Triton's, made here with onnx.helper.

    .venv/bin/python -m tests.triton_examples.build OUT    # writes OUT/repository and OUT/mug.png

Triton's graphs for `simple`, `simple_int8`, `simple_string`, `simple_sequence` and `simple_dyna_sequence`
are small ONNX files; these compute the same: sum and difference of two [batch, 16] tensors (cast through
INT32 for the INT8 and string models), and the sequence models' sums of their control inputs. Triton's
`densenet_onnx` is a 32 MB download; its stand-in has the same inputs and outputs (an FP32 [1, 3, 224, 224]
image to [1, 1000, 1, 1] scores, labelled by Triton's densenet_labels.txt): a global average pool and fixed
weights. `simple_identity` (a Python model in Triton) is an ONNX Identity on strings, and
`simple_string_dyna_sequence` (Triton's clients' `-d` string-id model, not in the example repository) an
accumulator whose state the sequence batcher keeps.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE / "repository"
I32, I8, STR, U64, F32 = TensorProto.INT32, TensorProto.INT8, TensorProto.STRING, TensorProto.UINT64, TensorProto.FLOAT


def _io(name: str, elem: int, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _save(out: Path, name: str, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
          outputs: list[onnx.ValueInfoProto], initializers: list[onnx.TensorProto] | None = None) -> None:  # fmt: skip
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    (out / name / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / name / "1" / "model.onnx"))


def _sum_and_difference(out: Path, name: str, elem: int) -> None:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, [batch, 16], computed in INT32."""
    shape: list[int | str] = ["batch", 16]
    nodes = [helper.make_node("Cast", [f"INPUT{i}"], [f"A{i}"], to=I32) for i in (0, 1)]
    nodes += [helper.make_node("Add", ["A0", "A1"], ["S"]), helper.make_node("Sub", ["A0", "A1"], ["D"])]
    nodes += [
        helper.make_node("Cast", ["S"], ["OUTPUT0"], to=elem),
        helper.make_node("Cast", ["D"], ["OUTPUT1"], to=elem),
    ]
    _save(out, name, nodes, [_io("INPUT0", elem, shape), _io("INPUT1", elem, shape)],
          [_io("OUTPUT0", elem, shape), _io("OUTPUT1", elem, shape)])  # fmt: skip


def _sequence(out: Path) -> None:
    """simple_sequence: OUTPUT = READY * (INPUT + START), as Triton's graph."""
    shape: list[int | str] = ["batch", 1]
    nodes = [helper.make_node("Add", ["INPUT", "START"], ["A"]), helper.make_node("Mul", ["READY", "A"], ["OUTPUT"])]
    _save(out, "simple_sequence", nodes, [_io(n, I32, shape) for n in ("INPUT", "START", "READY")],
          [_io("OUTPUT", I32, shape)])  # fmt: skip


def _dyna_sequence(out: Path) -> None:
    """simple_dyna_sequence: OUTPUT = READY * (INPUT + START + END * CORRID), as Triton's graph."""
    shape: list[int | str] = ["batch", 1]
    nodes = [
        helper.make_node("Cast", ["CORRID"], ["C"], to=I32),
        helper.make_node("Add", ["INPUT", "START"], ["A"]),
        helper.make_node("Mul", ["END", "C"], ["E"]),
        helper.make_node("Add", ["A", "E"], ["S"]),
        helper.make_node("Mul", ["READY", "S"], ["OUTPUT"]),
    ]
    inputs = [_io(n, I32, shape) for n in ("INPUT", "START", "END", "READY")] + [_io("CORRID", U64, shape)]
    _save(out, "simple_dyna_sequence", nodes, inputs, [_io("OUTPUT", I32, shape)])


def _string_dyna_sequence(out: Path) -> None:
    """simple_string_dyna_sequence: ACC = INPUT + (1 - START) * STATE_IN (the state kept between steps),
    OUTPUT = READY * (ACC + END * int(CORRID)); STATE_OUT = ACC."""
    shape: list[int | str] = ["batch", 1]
    one = helper.make_tensor("one", I32, [], [1])
    nodes = [
        helper.make_node("Sub", ["one", "START"], ["KEEP"]),
        helper.make_node("Mul", ["KEEP", "STATE_IN"], ["KEPT"]),
        helper.make_node("Add", ["INPUT", "KEPT"], ["STATE_OUT"]),
        helper.make_node("Cast", ["CORRID"], ["C"], to=I32),
        helper.make_node("Mul", ["END", "C"], ["E"]),
        helper.make_node("Add", ["STATE_OUT", "E"], ["S"]),
        helper.make_node("Mul", ["READY", "S"], ["OUTPUT"]),
    ]
    inputs = [_io(n, I32, shape) for n in ("INPUT", "START", "END", "READY", "STATE_IN")] + [_io("CORRID", STR, shape)]
    _save(out, "simple_string_dyna_sequence", nodes, inputs, [_io("OUTPUT", I32, shape), _io("STATE_OUT", I32, shape)],
          [one])  # fmt: skip


def _identity(out: Path) -> None:
    shape: list[int | str] = ["batch", "n"]
    _save(out, "simple_identity", [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
          [_io("INPUT0", STR, shape)], [_io("OUTPUT0", STR, shape)])  # fmt: skip


def _densenet(out: Path) -> None:
    """data_0 FP32 [1, 3, 224, 224] -> fc6_1 [1, 1000, 1, 1]: each class scores the image's mean colour
    with fixed weights."""
    k = np.arange(1000, dtype=np.float32)[:, None]
    weights = np.sin(k * np.array([1.0, 2.0, 3.0], dtype=np.float32)).reshape(1000, 3, 1, 1)
    w = helper.make_tensor("W", F32, weights.shape, weights.ravel().tolist())
    nodes = [helper.make_node("GlobalAveragePool", ["data_0"], ["P"]), helper.make_node("Conv", ["P", "W"], ["fc6_1"])]
    _save(
        out, "densenet_onnx", nodes, [_io("data_0", F32, [1, 3, 224, 224])], [_io("fc6_1", F32, [1, 1000, 1, 1])], [w]
    )


def _image(path: Path) -> None:
    """A 64 x 48 RGB picture for the image clients (Triton's use a photograph of a mug)."""
    from PIL import Image

    y, x = np.mgrid[0:48, 0:64]
    pixels = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    Image.fromarray(pixels, "RGB").save(path)


def as_triton_json(repository: Path) -> None:
    """Each model's config.pbtxt rewritten as config.json in Triton's JSON form (as Triton's HTTP config
    endpoint writes it: protobuf's JSON of the ModelConfig, Triton's field names)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    for pbtxt in sorted(repository.glob("*/config.pbtxt")):
        message = model_config_pb2.ModelConfig()
        text_format.Parse(pbtxt.read_text(), message)
        raw = json_format.MessageToDict(message, preserving_proto_field_name=True)
        if "max_batch_size" in pbtxt.read_text() and not message.max_batch_size:
            raw["max_batch_size"] = 0  # said in the file: proto3 drops a zero
        (pbtxt.parent / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        pbtxt.unlink()


def build(out: Path, form: str = "pbtxt") -> Path:
    """OUT/repository (configs copied, graphs built) and OUT/mug.png; returns the repository. `form`
    "json": the configs as config.json in Triton's JSON form instead."""
    repository = out / "repository"
    if repository.exists():
        shutil.rmtree(repository)
    shutil.copytree(REPOSITORY, repository)
    if form == "json":
        as_triton_json(repository)
    _sum_and_difference(repository, "simple", I32)
    _sum_and_difference(repository, "simple_int8", I8)
    _sum_and_difference(repository, "simple_string", STR)
    _sequence(repository)
    _dyna_sequence(repository)
    _string_dyna_sequence(repository)
    _identity(repository)
    _densenet(repository)
    _image(out / "mug.png")
    return repository


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "build/triton_examples")))
