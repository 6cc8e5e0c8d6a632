"""Inputs for a tensor model's warm-up and padding check, read from the graph: its inputs' names,
datatypes and shapes are all that is known of a model served without a config.json.

Each dynamic dimension gets a size from its symbolic name, as the exporters write them:

- a name with `past` in it (`past_sequence_length`, optimum's past key values) is 0: no past, the first
  step of a decoder, which every decoder with past accepts;
- the model's sequence axis (config.json `sequence_axis`) is the length asked for;
- any other is 1, and a sum of names (`past_sequence_length + sequence_length`, an attention mask over
  past and new positions) is the sum of their sizes, so that it agrees with the inputs it spans.

The values are read from each input's name: a mask is ones, position ids count 0, 1, 2 ..., token type
ids are zeros, other integers are token ids inside the vocabulary (`limits.vocab_size`, or ids below 4 when
none is declared), floats are drawn in [-1, 1), a BOOL flag is true (false for a `use_cache_branch`:
there is no past). `plain` falls back to zeros for every id and float, for a graph that takes no other.

A caller that knows better (config.json's warm-up samples) builds its own feeds: `graph_feeds` is only
the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import numpy as np

from service.datatypes import NUMPY_DTYPES
from service.models.runtime import TensorSpec

__all__ = ["ID_CEILING", "dimension", "graph_feeds", "input_values"]

ID_CEILING = 4  # token ids below this, where no vocabulary is declared: inside any real one


def dimension(symbol: str | None, length: int, sequence: AbstractSet[str | None]) -> int:
    """The size of one dynamic dimension named `symbol`: `length` for a name of the sequence axis (in
    `sequence`), 0 for a past, 1 for any other; a sum of names is the sum of their sizes."""
    if symbol is None:
        return 1
    total = 0
    for term in (t.strip() for t in symbol.split("+")):
        if term.isdigit():
            total += int(term)
        elif term in sequence:
            total += length
        elif "past" not in term.lower():
            total += 1
    return total


def input_values(spec: TensorSpec, shape: Sequence[int], rng: np.random.Generator | None, vocab: int = 0) -> np.ndarray:
    """Values for input `spec` of `shape`, by its name and datatype (module docstring); `rng` None: plain."""
    name = spec.name.lower()
    if spec.datatype == "BYTES":  # "1": a string a graph may also parse as a number
        return np.full(shape, "1", dtype=np.object_)
    dtype = NUMPY_DTYPES[spec.datatype]
    if spec.datatype == "BOOL":
        return np.full(shape, "cache" not in name, dtype=np.bool_)
    if "mask" in name:
        return np.ones(shape, dtype=dtype)
    integer = np.dtype(dtype).kind in "iu"
    if integer and "position" in name and len(shape) >= 1:
        return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
    if integer and ("token_type" in name or "segment" in name):
        return np.zeros(shape, dtype=dtype)
    if rng is None:
        return np.zeros(shape, dtype=dtype)
    if integer:
        high = vocab if vocab > 0 else ID_CEILING
        return rng.integers(1 if high > 1 else 0, high, size=shape).astype(dtype)
    return rng.uniform(-1.0, 1.0, size=shape).astype(dtype)


def graph_feeds(
    specs: Sequence[TensorSpec],
    rows: int,
    length: int,
    batch_axis: bool,
    sequence: AbstractSet[str | None],
    vocab: dict[str, int] | None = None,
    seed: int | None = 0,
) -> dict[str, np.ndarray]:
    """One request's feeds: `rows` rows (when the model has a batch axis) of `length` along the sequence axis
    (the dimensions named in `sequence`); `seed` None: the plain values (zeros for ids and floats)."""
    rng = None if seed is None else np.random.default_rng(seed)
    feeds = {}
    for s in specs:
        shape = [
            d if d >= 0 else dimension(s.axes[i] if i < len(s.axes) else None, length, sequence)
            for i, d in enumerate(s.shape)
        ]
        if batch_axis and shape:
            shape[0] = rows
        feeds[s.name] = input_values(s, shape, rng, (vocab or {}).get(s.name, 0))
    return feeds
