"""g2p's graphs as a stateful tensor model: one decoder step per request, the key/value cache as implicit
state (docs/sequences.md, "Incremental decoding: g2p's decoder as a stateful model").

    python -m export.stateful_decoder OUT_DIR [--g2p models/g2p/2]

writes OUT_DIR/config.json and OUT_DIR/<version>/model.onnx: the g2p version's encoder.onnx and decoder.onnx
wrapped in one graph (their nodes and weights copied, nothing retrained), served by the sequence batcher.
Shapes (B batch, L layers, H heads, T tokens decoded so far, S graphemes, K head width, V phonemes):

    inputs      input_ids (B, S) INT64     the word's grapheme ids, read on a sequence's first request only
                token (B, 1) INT64         the previous output token: <s> (1) on the first request
    control     START (B, 1) INT32         1 on a sequence's first request (the server fills it)
    state       past_keys, past_values (B, L, H, T, K)       the self-attention cache: a masked slot at the
                                                              start (T = 1), then one slot per token
                past_cross_keys, past_cross_values (B, L, H, S, K), past_memory_mask (B, S)
                                                              the encoded word, computed by the start request
    outputs     log_probs (B, V), and present_* (the state after this step: T + 1 positions)

The server batches only rows whose tensors have equal shapes, and a start row's state is empty, so a batch
is all starts or none: the encoder runs (an `If` on START) only for a batch of starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.seq2seq.graphs import DECODER_FILE, ENCODER_FILE, GRAPH_POSITIONS, PER_LAYER_INPUTS, STEP_INPUTS

__all__ = ["MODEL_NAME", "build_graph", "main", "model_config", "write_model"]

MODEL_NAME = "g2p_decoder"
MAX_WORD_LENGTH = 32  # graphemes, as models/g2p's limits
MAX_SEQUENCE_IDLE_US = 5_000_000  # a client between two steps of a word; more than Triton's 1 s default


def _absorbed(
    graph: onnx.GraphProto, prefix: str, feeds: dict[str, str], initializers: list[onnx.TensorProto]
) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """`graph`'s nodes with every value renamed `prefix + name`, but its inputs, which read `feeds`; its
    weights appended to `initializers`. Returns the nodes and the new names of its outputs."""

    def renamed(name: str) -> str:
        return "" if name == "" else feeds.get(name, prefix + name)  # "": an optional input left out

    for weight in graph.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(weight)
        copy.name = prefix + weight.name
        initializers.append(copy)
    nodes = []
    for i, node in enumerate(graph.node):
        copied = onnx.NodeProto()
        copied.CopyFrom(node)
        copied.name = f"{prefix}{node.name or node.op_type}_{i}"
        del copied.input[:], copied.output[:]
        copied.input.extend(map(renamed, node.input))
        copied.output.extend(map(renamed, node.output))
        nodes.append(copied)
    return nodes, {o.name: renamed(o.name) for o in graph.output}


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]


def build_graph(encoder: onnx.ModelProto, decoder: onnx.ModelProto) -> onnx.ModelProto:
    """The one-step stateful graph of the module's docstring, from g2p's encoder and decoder graphs."""
    step_inputs = {v.name: v for v in decoder.graph.input}
    layers = (len(step_inputs) - len(STEP_INPUTS)) // len(PER_LAYER_INPUTS)
    _, heads, _, d_k = _dims(step_inputs["cache_keys_0"])
    vocab = _dims(decoder.graph.output[0])[1]
    node = helper.make_node
    weights: list[onnx.TensorProto] = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([3], np.int64), "cache_axis"),
        numpy_helper.from_array(np.array([-1], np.int64), "flat"),
        *(numpy_helper.from_array(np.array(i, np.int64), f"layer_{i}") for i in range(layers)),
    ]
    batch_first = [1, 0, 2, 3, 4]  # (L, B, H, ., K) -> (B, L, H, ., K): the state's rows are the batch

    # 1. On a start, encode the word; otherwise keep what the start encoded.
    encode, encoded = _absorbed(
        encoder.graph, "encoder/", {"input_ids": "input_ids", "attention_mask": "word_mask"}, weights
    )
    encode = [
        node("Equal", ["input_ids", "zero"], ["is_pad"]),
        node("Not", ["is_pad"], ["is_grapheme"]),
        node("Cast", ["is_grapheme"], ["word_mask"], to=TensorProto.INT64),
        *encode,
        node("Transpose", [encoded["cross_keys"]], ["encoded_keys"], perm=batch_first),
        node("Transpose", [encoded["cross_values"]], ["encoded_values"], perm=batch_first),
    ]
    keep = [node("Identity", [f"past_{n}"], [f"kept_{n}"]) for n in ("cross_keys", "cross_values", "memory_mask")]

    def floats(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)

    def ints(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.INT64, None)

    nodes = [
        node("ReduceMax", ["START"], ["any_start"], keepdims=0),
        node("Cast", ["any_start"], ["starting"], to=TensorProto.BOOL),
        node(
            "If",
            ["starting"],
            ["cross_keys", "cross_values", "memory_mask"],
            then_branch=helper.make_graph(
                encode, "encode", [], [floats("encoded_keys"), floats("encoded_values"), ints("word_mask")]
            ),
            else_branch=helper.make_graph(
                keep, "keep", [], [floats("kept_cross_keys"), floats("kept_cross_values"), ints("kept_memory_mask")]
            ),
        ),
    ]
    # 2. One decoder step: the token at position T - 1 over the T cached slots. Slot 0 is a masked
    # placeholder (onnxruntime cannot attend over a cache of no slot), every later one a real token.
    nodes += [
        node("Reshape", ["token", "flat"], ["tokens"]),  # (B, 1) -> (B,)
        node("Shape", ["past_keys"], ["slots"], start=3, end=4),  # (1,): T
        node("Sub", ["slots", "one"], ["position"]),
        node("Shape", ["token"], ["rows"], start=0, end=1),  # (1,): B
        node("Expand", ["position", "rows"], ["positions"]),  # (B,)
        node("Squeeze", ["slots"], ["slot_count"]),
        node("Range", ["zero", "slot_count", "one"], ["slot"]),  # (T,)
        node("Greater", ["slot", "zero"], ["is_token"]),
        node("Cast", ["is_token"], ["token_slot"], to=TensorProto.INT64),
        node("Concat", ["rows", "slots"], ["cache_shape"], axis=0),
        node("Expand", ["token_slot", "cache_shape"], ["cache_mask"]),  # (B, T): 0, then ones
    ]
    feeds = {name: name for name in STEP_INPUTS}
    sources = ("past_keys", "past_values", "cross_keys", "cross_values")  # PER_LAYER_INPUTS's, layer by layer
    for i in range(layers):
        for name, source in zip(PER_LAYER_INPUTS, sources, strict=True):
            nodes.append(node("Gather", [source, f"layer_{i}"], [f"{name}_{i}"], axis=1))  # (B, H, ., K)
            feeds[f"{name}_{i}"] = f"{name}_{i}"
    step, stepped = _absorbed(decoder.graph, "decoder/", feeds, weights)
    nodes += step
    # 3. The state after the step: the cache one position longer, the encoded word as it was.
    for kind in ("keys", "values"):
        nodes += [
            node("Unsqueeze", [stepped[f"new_{kind}"], "cache_axis"], [f"step_{kind}"]),  # (L, B, H, 1, K)
            node("Transpose", [f"step_{kind}"], [f"new_{kind}_by_row"], perm=batch_first),
            node("Concat", [f"past_{kind}", f"new_{kind}_by_row"], [f"present_{kind}"], axis=3),
            node("Identity", [f"cross_{kind}"], [f"present_cross_{kind}"]),
        ]
    nodes += [
        node("Identity", ["memory_mask"], ["present_memory_mask"]),
        node("Identity", [stepped["log_probs"]], ["log_probs"]),
    ]

    def tensor(name: str, kind: int, dims: list[int | str]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, kind, ["batch", *dims])

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        tensor("input_ids", i64, ["source"]),
        tensor("token", i64, [1]),
        tensor("START", TensorProto.INT32, [1]),
        tensor("past_keys", f32, [layers, heads, "cache", d_k]),
        tensor("past_values", f32, [layers, heads, "cache", d_k]),
        tensor("past_cross_keys", f32, [layers, heads, "past_source", d_k]),
        tensor("past_cross_values", f32, [layers, heads, "past_source", d_k]),
        tensor("past_memory_mask", i64, ["past_source"]),
    ]
    outputs = [
        tensor("log_probs", f32, [vocab]),
        tensor("present_keys", f32, [layers, heads, "cache_after", d_k]),
        tensor("present_values", f32, [layers, heads, "cache_after", d_k]),
        tensor("present_cross_keys", f32, [layers, heads, "present_source", d_k]),
        tensor("present_cross_values", f32, [layers, heads, "present_source", d_k]),
        tensor("present_memory_mask", i64, ["present_source"]),
    ]
    graph = helper.make_graph(nodes, MODEL_NAME, inputs, outputs, weights)
    model = helper.make_model(graph, opset_imports=decoder.opset_import, ir_version=decoder.ir_version)
    onnx.checker.check_model(model, full_check=True)
    return model


def model_config(model: onnx.ModelProto, source: Path, hashes: dict[str, str]) -> dict[str, Any]:
    """config.json: a tensor model with Triton's sequence_batching; at the start the cache holds one masked
    slot, the encoded word nothing (the start request encodes it)."""
    dims = {v.name: _dims(v)[1:] for v in model.graph.input}
    vocab = {"input_ids": 0, "token": int(_dims(model.graph.output[0])[1])}
    graphemes = json.loads((source / "graphemes.json").read_text())
    vocab["input_ids"] = len(graphemes)

    def state(name: str, datatype: str) -> dict[str, Any]:
        variable = [-1 if isinstance(d, str) else d for d in dims[f"past_{name}"]]
        empty = [(1 if name in ("keys", "values") else 0) if d < 0 else d for d in variable]  # the cache's placeholder
        return {
            "input_name": f"past_{name}",
            "output_name": f"present_{name}",
            "data_type": datatype,
            "dims": variable,
            "initial_state": [{"data_type": datatype, "dims": empty, "zero_data": True, "name": "start"}],
        }

    return {
        "name": MODEL_NAME,
        "kind": "tensor",
        "max_batch_size": 64,
        "sequence_axis": 1,
        "limits": {"max_sequence_length": MAX_WORD_LENGTH, "vocab_size": vocab},
        "sequence_batching": {
            "max_sequence_idle_microseconds": MAX_SEQUENCE_IDLE_US,
            # request n runs with n cache slots: past the graphs' positions it would fail inside onnxruntime
            "max_sequence_requests": GRAPH_POSITIONS,
            "oldest": {"max_candidate_sequences": 64, "max_queue_delay_microseconds": 0},
            "control_input": [
                {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]}
            ],
            "state": [
                state("keys", "TYPE_FP32"),
                state("values", "TYPE_FP32"),
                state("cross_keys", "TYPE_FP32"),
                state("cross_values", "TYPE_FP32"),
                state("memory_mask", "TYPE_INT64"),
            ],
        },
        "model_card": {
            "description": "g2p's encoder and one-step decoder as a stateful model: one request per output "
            "token, the key/value cache kept by the server as implicit state (docs/sequences.md)",
            "built_from": f"{source.parent.name}/{source.name}",
            "vocabularies": "graphemes.json and phonemes.json of the g2p version it was built from",
            "sha256": hashes,
        },
    }


def write_model(g2p_version: Path, out: Path) -> Path:
    """OUT/config.json and OUT/<the g2p version>/model.onnx from a g2p version directory; returns OUT."""
    encoder, decoder = (onnx.load(str(g2p_version / f)) for f in (ENCODER_FILE, DECODER_FILE))
    model = build_graph(encoder, decoder)
    hashes = {f: hashlib.sha256((g2p_version / f).read_bytes()).hexdigest() for f in (ENCODER_FILE, DECODER_FILE)}
    (out / g2p_version.name).mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / g2p_version.name / "model.onnx"))
    config = model_config(model, g2p_version, hashes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.stateful_decoder", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the model's directory to write, e.g. /tmp/models/g2p_decoder")
    parser.add_argument("--g2p", type=Path, default=Path("models/g2p/2"), help="the g2p version to wrap")
    args = parser.parse_args(argv)
    for f in (ENCODER_FILE, DECODER_FILE, "graphemes.json"):
        if not (args.g2p / f).is_file():
            parser.error(f"{args.g2p} has no {f}: give a g2p version directory, such as models/g2p/2")
    write_model(args.g2p, args.out)
    print(f"wrote {args.out}/config.json and {args.out}/{args.g2p.name}/model.onnx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
