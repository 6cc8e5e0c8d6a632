"""A self-attention mask for an encoder-decoder's decoder: its exported graph rewritten, in memory, before
its session is made, so that decoder rows of different cache lengths run in one call.

optimum's T5 decoder with past takes no self-attention mask, and biases attention by relative position. With
a row's cache left-padded by k, its query and its real keys both move by k, so their relative positions (and
the bias) are unchanged: only the k pad keys must be kept out of the softmax. The rewrite adds an input

    decoder_attention_mask (B, P+1) int64, 1 on a real key, 0 on a pad

turned once into an additive bias (0 real, the dtype's min on a pad) shaped (B, 1, 1, P+1), broadcast over
heads and query positions, and added to the scores of every self-attention softmax:

    Softmax( MatMul(q, k^T) + position_bias )  ->  Softmax( MatMul(q, k^T) + position_bias + mask_bias )

A self-attention softmax is recognised from the graph: a Softmax whose input is (through Casts) an Add one of
whose inputs is a MatMul whose keys come (through Transpose, Reshape, Concat) from a self-attention past key
input, `past_key_values.N.decoder.key`, and whose other input is made from a Gather of a (buckets, heads)
table, T5's relative position bias. A decoder with absolute positions (BART, Marian: taken from the cache's
length) would read a padded row's positions wrong, and is left as it is. A merged decoder's softmaxes sit in
its If's cache branch, which reads the new input from the outer graph. Every layer's self-attention must be
found, or the graph is left as it is (`Unmasked` says why).

The serving install has no onnx package: the graph is read and written with protobuf classes of the few ONNX
messages the rewrite touches, built here in a private descriptor pool (field numbers as onnx.proto gives
them). Fields they leave out are kept as protobuf's unknown fields and written back as they were read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["MASK", "Unmasked", "with_self_attention_mask"]

MASK = "decoder_attention_mask"
_SELF_KEY = re.compile(r"past_key_values\.(\d+)\.decoder\.key")
_KEY_PATH = frozenset({"Transpose", "Reshape", "Concat", "Identity", "Cast"})  # ops between a past key and k^T
_KEY_DEPTH = 6
_BIAS_DEPTH = 8  # nodes between a relative position bias table's Gather and the bias added to the scores
# ONNX TensorProto.DataType: the float types a mask's bias may take, and int64
_FLOATS: dict[int, type[np.floating[Any]]] = {1: np.float32, 10: np.float16, 11: np.float64}
_INT64 = 7
_INT, _TENSOR = 2, 4  # AttributeProto.AttributeType


class Unmasked(Exception):
    """Why a decoder graph cannot be given a self-attention mask."""


# --- the ONNX messages the rewrite reads and writes -----------------------------------------------------

_FIELDS: dict[str, list[tuple[str, int, str, str]]] = {  # message: (field, number, label, type)
    "ModelProto": [("graph", 7, "optional", "GraphProto"), ("opset_import", 8, "repeated", "OperatorSetIdProto")],
    "OperatorSetIdProto": [("domain", 1, "optional", "string"), ("version", 2, "optional", "int64")],
    "GraphProto": [
        ("node", 1, "repeated", "NodeProto"),
        ("initializer", 5, "repeated", "TensorProto"),
        ("input", 11, "repeated", "ValueInfoProto"),
        ("output", 12, "repeated", "ValueInfoProto"),
    ],
    "NodeProto": [
        ("input", 1, "repeated", "string"),
        ("output", 2, "repeated", "string"),
        ("name", 3, "optional", "string"),
        ("op_type", 4, "optional", "string"),
        ("attribute", 5, "repeated", "AttributeProto"),
        ("domain", 7, "optional", "string"),
    ],
    "AttributeProto": [
        ("name", 1, "optional", "string"),
        ("i", 3, "optional", "int64"),
        ("t", 5, "optional", "TensorProto"),
        ("g", 6, "optional", "GraphProto"),
        ("graphs", 11, "repeated", "GraphProto"),
        ("type", 20, "optional", "int32"),
    ],
    "TensorProto": [
        ("dims", 1, "repeated", "int64"),
        ("data_type", 2, "optional", "int32"),
        ("name", 8, "optional", "string"),
        ("raw_data", 9, "optional", "bytes"),
        ("data_location", 14, "optional", "int32"),
    ],
    "ValueInfoProto": [("name", 1, "optional", "string"), ("type", 2, "optional", "TypeProto")],
    "TypeProto": [("tensor_type", 1, "optional", "TensorType")],
    "TensorType": [("elem_type", 1, "optional", "int32"), ("shape", 2, "optional", "TensorShapeProto")],
    "TensorShapeProto": [("dim", 1, "repeated", "Dimension")],
    "Dimension": [("dim_value", 1, "optional", "int64"), ("dim_param", 2, "optional", "string")],
}
_SCALARS = {
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
}


@cache
def _messages() -> dict[str, Any]:
    """The message classes, by name, from a private pool (never onnx's own, should it be imported too)."""
    file = descriptor_pb2.FileDescriptorProto(name="qkv_onnx_subset.proto", package="qkv.onnx", syntax="proto2")
    for message, fields in _FIELDS.items():
        m = file.message_type.add(name=message)
        for name, number, label, kind in fields:
            f = m.field.add(name=name, number=number)
            f.label = (descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if label == "repeated"
                       else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)  # fmt: skip
            if kind in _SCALARS:
                f.type = _SCALARS[kind]
            else:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
                f.type_name = f".qkv.onnx.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"qkv.onnx.{name}")) for name in _FIELDS}


# --- the rewrite ----------------------------------------------------------------------------------------


def _graphs(graph: Any) -> Iterator[Any]:
    """A graph and every subgraph in it (an If's branches, a Loop's body), depth first."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                yield from _graphs(a.g)
            for g in a.graphs:
                yield from _graphs(g)


def _reads_past_key(name: str, producers: dict[str, Any], keys: set[str], depth: int = _KEY_DEPTH) -> bool:
    """Whether `name` is, or is made (through reshapes, transposes and concatenations) from, a past key."""
    if name in keys:
        return True
    node = producers.get(name)
    if node is None or depth == 0 or node.op_type not in _KEY_PATH:
        return False
    return any(_reads_past_key(i, producers, keys, depth - 1) for i in node.input)


def _relative_bias(name: str, producers: dict[str, Any], tables: set[str]) -> bool:
    """Whether `name` is made (within _BIAS_DEPTH nodes) from a Gather of one of `tables`: a position bias of
    (buckets, heads)."""
    seen, level = {name}, [name]
    for _ in range(_BIAS_DEPTH):
        nodes = [n for n in (producers.get(v) for v in level) if n is not None]
        if any(n.op_type == "Gather" and n.input[0] in tables for n in nodes):
            return True
        level = [i for n in nodes for i in n.input if i not in seen]
        seen.update(level)
    return False


def _self_attention_softmaxes(graph: Any, keys: set[str], tables: set[str]) -> list[tuple[Any, bool]]:
    """The Softmax nodes of `graph` (not its subgraphs) whose scores are q x k^T over a past key, plus a bias;
    with each, whether that bias is a relative position bias (a Gather from one of `tables`)."""
    producers = {o: n for n in graph.node for o in n.output}
    found = []
    for node in graph.node:
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        scores = producers.get(node.input[0])
        while scores is not None and scores.op_type in ("Cast", "Identity"):
            scores = producers.get(scores.input[0])
        if scores is None or scores.op_type != "Add":
            continue
        for j, term in enumerate(scores.input):
            matmul = producers.get(term)
            if matmul is not None and matmul.op_type == "MatMul" and _reads_past_key(matmul.input[1], producers, keys):
                found.append((node, _relative_bias(scores.input[1 - j], producers, tables)))
                break
    return found


def _softmax_type(softmax: Any, graph: Any, default: int) -> int:
    """The ONNX element type of a softmax's input: a Cast's `to` where a Cast makes it, else the cache's."""
    for node in graph.node:
        if softmax.input[0] in node.output and node.op_type == "Cast":
            return next((a.i for a in node.attribute if a.name == "to"), default)
    return default


def _constant(m: dict[str, Any], name: str, value: np.ndarray, onnx_type: int) -> Any:
    tensor = m["TensorProto"](dims=list(value.shape), data_type=onnx_type, raw_data=value.tobytes())
    attribute = m["AttributeProto"](name="value", type=_TENSOR, t=tensor)
    return m["NodeProto"](output=[name], name=name, op_type="Constant", attribute=[attribute])


def _bias_nodes(m: dict[str, Any], onnx_type: int, prefix: str) -> tuple[list[Any], str]:
    """Nodes turning MASK (B, L) into an additive bias (B, 1, 1, L): 0 where 1, the type's min where 0."""
    dtype = _FLOATS[onnx_type]
    node = m["NodeProto"]
    to = m["AttributeProto"](name="to", type=_INT, i=onnx_type)
    one, low, shape = f"{prefix}/one", f"{prefix}/min", f"{prefix}/shape"
    real, pad, flat, bias = f"{prefix}/real", f"{prefix}/pad", f"{prefix}/bias_2d", f"{prefix}/bias"
    nodes = [
        _constant(m, one, np.array(1, dtype=dtype), onnx_type),
        _constant(m, low, np.array(np.finfo(dtype).min, dtype=dtype), onnx_type),
        _constant(m, shape, np.array([0, 1, 1, -1], dtype=np.int64), _INT64),
        node(input=[MASK], output=[real], name=real, op_type="Cast", attribute=[to]),
        node(input=[one, real], output=[pad], name=pad, op_type="Sub"),  # (B, L): 1 on a pad
        node(input=[pad, low], output=[flat], name=flat, op_type="Mul"),
        node(input=[flat, shape], output=[bias], name=bias, op_type="Reshape"),  # (B, 1, 1, L)
    ]
    return nodes, bias


def with_self_attention_mask(data: bytes) -> tuple[bytes, bool]:
    """The decoder graph `data` (a serialized ONNX model) with the input MASK masking every self-attention
    softmax, and whether its weights lie in files beside it (external data); raises Unmasked, saying why,
    when its graph does not have the pattern."""
    m = _messages()
    model = m["ModelProto"].FromString(data)
    graph = model.graph
    inputs = {i.name: i for i in graph.input}
    if MASK in inputs:
        raise Unmasked(f"it already has an input named {MASK}")
    keys = {name for name in inputs if _SELF_KEY.fullmatch(name)}
    if not keys:
        raise Unmasked("it takes no self-attention past key (past_key_values.N.decoder.key)")
    cache_type = min(inputs[k].type.tensor_type.elem_type for k in keys)
    n_heads = inputs[min(keys)].type.tensor_type.shape.dim[1].dim_value
    tables = {t.name for g in _graphs(graph) for t in g.initializer if len(t.dims) == 2 and t.dims[1] == n_heads}
    found = [(g, s, relative) for g in _graphs(graph) for s, relative in _self_attention_softmaxes(g, keys, tables)]
    if len(found) < len(keys):
        raise Unmasked(
            f"{len(found)} softmax(es) found over q x k^T plus a bias whose keys come from the {len(keys)} "
            "self-attention past keys; every layer's is needed"
        )
    if not all(relative for _, _, relative in found):
        raise Unmasked(
            f"its self-attention bias is not a relative position bias (a Gather from a (buckets, {n_heads} heads) "
            "table): a left pad would move the positions the decoder reads from its cache's length"
        )
    biases: dict[tuple[int, int], str] = {}  # (graph, element type) -> its bias, made once
    heads: dict[int, list[Any]] = {}  # graph -> the nodes making its biases, put first
    adds: dict[int, Any] = {}  # softmax -> the Add of the bias to its scores, put just before it
    for g, softmax, _ in found:
        onnx_type = _softmax_type(softmax, g, cache_type)
        if onnx_type not in _FLOATS:
            raise Unmasked(f"softmax {softmax.name!r} runs in ONNX element type {onnx_type}, not a float")
        key = (id(g), onnx_type)
        if key not in biases:
            nodes, biases[key] = _bias_nodes(m, onnx_type, f"qkv/{MASK}/{len(biases)}")
            heads.setdefault(id(g), []).extend(nodes)
        masked = f"{softmax.input[0]}/qkv_masked"
        adds[id(softmax)] = m["NodeProto"](input=[softmax.input[0], biases[key]], output=[masked], name=masked,
                                           op_type="Add")  # fmt: skip
        softmax.input[0] = masked
    for g in _graphs(graph):
        if id(g) in heads:  # in an order still topological: the biases first, each Add just before its Softmax
            order = list(heads[id(g)])
            for node in g.node:
                order.extend((adds[id(node)], node) if id(node) in adds else (node,))
            del g.node[:]
            g.node.extend(order)
    mask = m["ValueInfoProto"](name=MASK)
    mask.type.tensor_type.elem_type = _INT64
    mask.type.tensor_type.shape.dim.add(dim_param="batch_size")
    mask.type.tensor_type.shape.dim.add(dim_param="past_decoder_sequence_length + 1")
    graph.input.append(mask)
    external = any(t.data_location == 1 for g in _graphs(graph) for t in g.initializer)  # EXTERNAL
    out: bytes = model.SerializeToString()
    return out, external
