"""Triton's classification extension: an output answered as its top k classes instead of its values.

A requested output with the parameter `classification` = k is answered as BYTES of shape [batch, k]
(or [k] for a model without a batch axis), each element `<value>:<index>` or, when the output has a
labels file (config.json `label_filename`, read at load by service/repository/layout.py),
`<value>:<index>:<label>`. Classes are ranked by value, highest first, over every element of a row
(a [1000, 1, 1] output is 1000 classes); ties keep the lower index first.
"""

from __future__ import annotations

import numpy as np

from service.errors import InvalidArgument, quote

__all__ = ["classify"]


def _shown(value: np.generic) -> str:
    """A value as Triton writes it: floats with six decimals, integers as they are."""
    return f"{float(value):f}" if np.issubdtype(value.dtype, np.floating) else str(value)


def classify(array: np.ndarray, count: int, labels: tuple[str, ...], batched: bool, output: str) -> np.ndarray:
    """The top `count` classes of each row of `array` (each element of the whole array, unbatched)."""
    if array.dtype == np.object_ or array.dtype.kind in "SUb":
        raise InvalidArgument(f"output {quote(output)}: classification needs numbers, the output is {array.dtype}")
    if count < 1:
        raise InvalidArgument(f"output {quote(output)}: classification count must be >= 1, got {count}")
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim else array.reshape(1, -1)
    k = min(count, rows.shape[1])
    out = np.empty((rows.shape[0], k), dtype=np.object_)
    for r, row in enumerate(rows):
        # a stable sort of the negated values: highest first, ties by index
        top = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for j, i in enumerate(top):
            label = f":{labels[i]}" if i < len(labels) else ""
            out[r, j] = f"{_shown(row[i])}:{i}{label}".encode()
    return out if batched else out[0]
