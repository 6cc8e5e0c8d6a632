"""A model zoo for `qkv bench --zoo`: models qkv did not train, made by the bench itself.

The shipped models are the ones qkv was tuned on; the zoo asks how well the server serves anything else:
Transformer encoders small to large, a decoder-only model (causal attention), and an MLP with no sequence
axis. The weights are random (seeded, scaled by 1/sqrt(fan_in) so activations stay finite): the bench
measures speed, not accuracy. `write_zoo` writes them as a qkv model repository, NAME/1/model.onnx beside
NAME/config.json, with no batching settings so that the server chooses its own; `feeds` makes a request.

The graphs are built with onnx.helper, imported where used: the serving install has no onnx.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ZOO", "ZooModel", "feeds", "write_zoo"]

OPSET = 17  # LayerNormalization is an ONNX op from 17
IR_VERSION = 8
MAX_POSITIONS = 1024  # the learned position table's length, and so the served max_sequence_length
MASKED = -1e9  # added to the scores of keys a query must not see: softmax gives them exactly 0


@dataclass(frozen=True)
class ZooModel:
    name: str  # directory name in the repository
    description: str  # e.g. "encoder, 2 layers, d 128"
    vocab: int  # token ids are drawn from [0, vocab); 0 for a model with float input
    sequence: bool  # True: inputs input_ids / attention_mask INT64 [batch, seq]; False: x FP32 [batch, width]
    width: int = 0  # the MLP's input width
    # The architecture: Transformers use all four; the MLP has `layers` hidden layers of `d_ff`.
    layers: int = 0
    d_model: int = 0
    heads: int = 0
    d_ff: int = 0
    causal: bool = False  # decoder-only: a query sees only itself and earlier positions

    @property
    def output_width(self) -> int:
        """The width of the output's last axis: `pooled` [batch, d_model], or the MLP's `y` [batch, width]."""
        return self.d_model if self.sequence else self.width


ZOO: tuple[ZooModel, ...] = (
    ZooModel("zoo_small", "encoder, 2 layers, d 128", 1000, True, layers=2, d_model=128, heads=4, d_ff=512),
    ZooModel("zoo_medium", "encoder, 4 layers, d 256", 1000, True, layers=4, d_model=256, heads=4, d_ff=1024),
    ZooModel("zoo_large", "encoder, 6 layers, d 384", 1000, True, layers=6, d_model=384, heads=6, d_ff=1536),
    ZooModel(
        "zoo_decoder",
        "decoder-only, 4 layers, d 256",
        1000,
        True,
        layers=4,
        d_model=256,
        heads=4,
        d_ff=1024,
        causal=True,
    ),
    ZooModel("zoo_mlp", "MLP, 512 -> 2048 -> 2048 -> 512", 0, False, width=512, layers=2, d_ff=2048),
)


def write_zoo(repository: Path, models: Sequence[ZooModel] = ZOO, seed: int = 0) -> Path:
    """Write each model as repository/NAME/1/model.onnx with repository/NAME/config.json; return repository."""
    import onnx

    repository = Path(repository)
    for model in models:
        # A generator per model: a model's weights do not depend on which others are written with it.
        rng = np.random.default_rng(seed)
        graph = _transformer(model, rng) if model.sequence else _mlp(model, rng)
        version = repository / model.name / "1"
        version.mkdir(parents=True, exist_ok=True)
        onnx.save(graph, str(version / "model.onnx"))
        (repository / model.name / "config.json").write_text(json.dumps(_config(model), indent=2) + "\n")
    return repository


def feeds(model: ZooModel, batch: int, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs for one request of `batch` rows (length ignored for the MLP)."""
    if not model.sequence:
        return {"x": rng.standard_normal((batch, model.width)).astype(np.float32)}
    ids = rng.integers(0, model.vocab, size=(batch, length), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def _config(model: ZooModel) -> dict[str, Any]:
    if not model.sequence:
        return {"kind": "tensor"}
    return {
        "kind": "tensor",
        "sequence_axis": 1,
        "limits": {"max_sequence_length": MAX_POSITIONS, "vocab_size": {"input_ids": model.vocab}},
    }


class _Graph:
    """Nodes and initializers gathered while a graph is built; names made unique by a counter."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, **attributes: Any) -> str:
        from onnx import helper

        output = self.name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=output, **attributes))
        return output

    def constant(self, hint: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def ints(self, hint: str, *values: int) -> str:
        return self.constant(hint, np.array(values, dtype=np.int64))

    def int_scalar(self, hint: str, value: int) -> str:
        return self.constant(hint, np.array(value, dtype=np.int64))

    def scalar(self, hint: str, value: float) -> str:
        return self.constant(hint, np.array(value, dtype=np.float32))

    def weight(self, hint: str, fan_in: int, fan_out: int) -> str:
        # 1/sqrt(fan_in): each output keeps its input's scale, so 6 layers of random weights stay finite.
        w = self.rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)
        return self.constant(hint, w.astype(np.float32))

    def bias(self, hint: str, width: int) -> str:
        return self.constant(hint, (0.02 * self.rng.standard_normal(width)).astype(np.float32))

    def linear(self, x: str, fan_in: int, fan_out: int, hint: str) -> str:
        return self.op(
            "Add",
            [self.op("MatMul", [x, self.weight(f"{hint}_w", fan_in, fan_out)]), self.bias(f"{hint}_b", fan_out)],
            hint,
        )

    def layer_norm(self, x: str, width: int, hint: str) -> str:
        scale = self.constant(f"{hint}_scale", np.ones(width, dtype=np.float32))
        shift = self.constant(f"{hint}_shift", np.zeros(width, dtype=np.float32))
        return self.op("LayerNormalization", [x, scale, shift], hint, axis=-1, epsilon=1e-5)


def _model(graph: _Graph, name: str, inputs: list[Any], outputs: list[Any]) -> Any:
    from onnx import helper

    model = helper.make_model(
        helper.make_graph(graph.nodes, name, inputs, outputs, graph.initializers),
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="qkv bench zoo",
    )
    model.ir_version = IR_VERSION
    return model


def _mlp(model: ZooModel, rng: np.random.Generator) -> Any:
    from onnx import TensorProto, helper

    g = _Graph(rng)
    h, width = "x", model.width
    for i in range(model.layers):
        h = g.op("Relu", [g.op("MatMul", [h, g.weight(f"hidden{i}_w", width, model.d_ff)])])
        width = model.d_ff
    g.nodes.append(helper.make_node("MatMul", [h, g.weight("out_w", width, model.width)], ["y"], name="y"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", model.width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", model.width])
    return _model(g, model.name, [x], [y])


def _transformer(model: ZooModel, rng: np.random.Generator) -> Any:
    from onnx import TensorProto, helper

    g = _Graph(rng)
    d, heads = model.d_model, model.heads
    d_k = d // heads

    # Embeddings: token + learned position over Range(0, seq), seq read from the input's shape.
    tokens = g.op("Gather", [g.constant("token_embedding", _embedding(rng, model.vocab, d)), "input_ids"])
    seq = g.op("Gather", [g.op("Shape", ["input_ids"]), g.int_scalar("axis1", 1)], "seq")
    positions = g.op("Range", [g.int_scalar("zero", 0), seq, g.int_scalar("one", 1)], "positions")
    position_table = g.constant("position_embedding", _embedding(rng, MAX_POSITIONS, d))
    h = g.op("Add", [tokens, g.op("Gather", [position_table, positions])], "embedded")

    # Scores bias [batch, 1, 1|seq, seq]: padded keys get MASKED, and for the decoder so do later positions.
    mask = g.op("Cast", ["attention_mask"], "mask", to=TensorProto.FLOAT)
    masked = g.scalar("masked", MASKED)
    padded = g.op("Sub", [g.scalar("ones", 1.0), mask])
    score_bias = g.op("Unsqueeze", [g.op("Mul", [padded, masked]), g.ints("axes12", 1, 2)])
    if model.causal:
        seq_1d = g.op("Unsqueeze", [seq, g.ints("axes0", 0)])
        square = g.op(
            "ConstantOfShape",
            [g.op("Concat", [seq_1d, seq_1d], axis=0)],
            "square",
            value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]),
        )
        above = g.op("Trilu", [square, g.int_scalar("k1", 1)], "above_diagonal", upper=1)
        score_bias = g.op("Add", [score_bias, g.op("Mul", [above, masked])], "score_bias")

    split_heads = g.ints("split_heads", 0, 0, heads, d_k)  # 0: keep that dim of the input (batch, seq)
    merge_heads = g.ints("merge_heads", 0, 0, d)
    scale = g.scalar("scale", 1.0 / math.sqrt(d_k))
    for i in range(model.layers):
        x = g.layer_norm(h, d, f"l{i}_ln_attention")
        q = g.op("Transpose", [g.op("Reshape", [g.linear(x, d, d, f"l{i}_q"), split_heads])], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [g.linear(x, d, d, f"l{i}_k"), split_heads])], perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [g.linear(x, d, d, f"l{i}_v"), split_heads])], perm=[0, 2, 1, 3])
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), score_bias], f"l{i}_scores")
        attended = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])  # [batch, heads, seq, d_k]
        merged = g.op("Reshape", [g.op("Transpose", [attended], perm=[0, 2, 1, 3]), merge_heads])
        h = g.op("Add", [h, g.linear(merged, d, d, f"l{i}_out")], f"l{i}_attention_residual")
        x = g.layer_norm(h, d, f"l{i}_ln_ff")
        hidden = g.op("Relu", [g.linear(x, d, model.d_ff, f"l{i}_ff1")])
        h = g.op("Add", [h, g.linear(hidden, model.d_ff, d, f"l{i}_ff2")], f"l{i}_ff_residual")
    h = g.layer_norm(h, d, "ln_final")

    # Masked mean over seq; the count is held at >= 1 so that a row of padding alone gives 0, not NaN.
    seq_axis = g.ints("seq_axis", 1)
    kept = g.op("Mul", [h, g.op("Unsqueeze", [mask, g.ints("axis2", 2)])], "kept")
    summed = g.op("ReduceSum", [kept, seq_axis], keepdims=0)
    count = g.op("Max", [g.op("ReduceSum", [mask, seq_axis], keepdims=1), g.scalar("min_count", 1.0)])
    g.nodes.append(helper.make_node("Div", [summed, count], ["pooled"], name="pooled"))

    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ("input_ids", "attention_mask")
    ]
    pooled = helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", d])
    return _model(g, model.name, inputs, [pooled])


def _embedding(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    # Unit scale: the first LayerNormalization rescales whatever it gets.
    return rng.standard_normal((rows, width)).astype(np.float32)
