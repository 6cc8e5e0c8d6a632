"""Requests for any served model, made from what the server says of it: `qkv bench --url ... --model NAME`.

The model's metadata gives each input's name, datatype and shape; its configuration, where the server is
qkv, gives the sequence axis, the longest sequence and each token input's vocabulary (the ModelConfig
parameters `sequence_axis`, `max_sequence_length`, `vocab_size.NAME`). A request is one row: the batch
axis 1, every other variable axis the request's length, drawn from `--lengths`, or, without it, from 1 to
the model's longest sequence (64 where the model declares none). Values: token ids inside the vocabulary,
masks of ones, zeros for token types, positions counted up, numbers from a normal distribution, short
words for text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from service import protocol
from service.datatypes import NUMPY_DTYPES
from service.tools import loadgen
from service.tools.bench.load import held_out_words, word_maker
from service.tools.tensor_io import request

__all__ = ["DEFAULT_LENGTH", "ModelShape", "model_maker", "model_shape"]

DEFAULT_LENGTH = 64  # a variable axis's length when neither --lengths nor the model says one
ID_CEILING = 100  # token ids of an input whose vocabulary the model does not declare: below this


@dataclass
class ModelShape:
    """What a load generator needs to know of a model to make its requests."""

    name: str
    kind: str
    inputs: list[tuple[str, str, list[int]]]  # (name, datatype, shape) as the metadata gives them
    batched: bool
    sequence_axis: int | None = None
    max_sequence_length: int = 0
    vocab_size: dict[str, int] = field(default_factory=dict)

    def lengths(self, given: tuple[int, int] | None) -> tuple[int, int]:
        """--lengths LO:HI, or 1 to the model's longest sequence (DEFAULT_LENGTH when it has none)."""
        if given is not None:
            return given
        return (1, self.max_sequence_length) if self.max_sequence_length else (DEFAULT_LENGTH, DEFAULT_LENGTH)


def model_shape(url: str, model: str, timeout: float = 10.0) -> ModelShape:
    """The model's metadata and configuration, asked of the server at `url` (grpc.RpcError when it fails)."""
    with grpc.insecure_channel(url) as channel:
        stub = protocol.Stub(channel)
        meta = stub.ModelMetadata(protocol.ModelMetadataRequest(name=model), timeout=timeout)
        config = stub.ModelConfig(protocol.ModelConfigRequest(name=model), timeout=timeout).config
    params = {key: p.string_value for key, p in config.parameters.items()}
    axis = params.get("sequence_axis", "")
    return ModelShape(
        name=model,
        kind=params.get("kind", ""),
        inputs=[(t.name, t.datatype, [int(d) for d in t.shape]) for t in meta.inputs],
        batched=config.max_batch_size > 0,
        sequence_axis=int(axis) if axis else None,
        max_sequence_length=int(params.get("max_sequence_length") or 0),
        vocab_size={k.removeprefix("vocab_size."): int(v) for k, v in params.items() if k.startswith("vocab_size.")},
    )


def _dims(shape: list[int], batched: bool, length: int) -> list[int]:
    """One row's shape: the batch axis 1, every other variable axis `length`."""
    return [1 if (d == -1 and i == 0 and batched) else length if d == -1 else d for i, d in enumerate(shape)]


def _values(m: ModelShape, name: str, datatype: str, dims: list[int], rng: np.random.Generator) -> np.ndarray:
    dtype = NUMPY_DTYPES[datatype]
    lowered = name.lower()
    if datatype == "BYTES":
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        count = int(np.prod(dims))
        words = ["".join(rng.choice(letters, size=int(rng.integers(2, 12)))).encode() for _ in range(count)]
        return np.array(words, dtype=np.object_).reshape(dims)
    if datatype == "BOOL" or "mask" in lowered:
        return np.ones(dims, dtype=dtype)
    if np.issubdtype(dtype, np.integer):
        if "type" in lowered:  # token_type_ids: one segment
            return np.zeros(dims, dtype=dtype)
        if "position" in lowered and dims:  # position ids: 0, 1, 2, ... along the last axis
            return np.broadcast_to(np.arange(dims[-1], dtype=dtype), dims).copy()
        high = m.vocab_size.get(name, ID_CEILING)
        high = min(high, int(np.iinfo(dtype).max))
        return rng.integers(0, max(high, 1), size=dims, dtype=dtype)
    return rng.standard_normal(dims).astype(dtype)


def model_maker(m: ModelShape, lengths: tuple[int, int] | None, seed: int = 0) -> loadgen.MakeRequest:
    """Requests of one row for `m`, lengths uniform in `lengths` (or the model's own, `ModelShape.lengths`);
    a g2p model gets test-split words instead, as `qkv infer` sends them."""
    if m.kind == "g2p":
        return word_maker(held_out_words(), model=m.name)
    lo, hi = m.lengths(lengths)
    rng, nprng = random.Random(seed), np.random.default_rng(seed)

    def make(i: int) -> tuple[Any, int, str]:
        n = rng.randint(lo, hi)
        inputs = {}
        for name, datatype, shape in m.inputs:
            dims = _dims(shape, m.batched, n)
            inputs[name] = (datatype, _values(m, name, datatype, dims, nprng))
        return request(m.name, "", inputs, ()), n, ""

    return make
