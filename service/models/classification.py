"""Triton's classification extension: an output answered as its top k classes instead of its values.

A requested output with the parameter `classification` = k is answered as BYTES of shape [batch, k]
(or [k] for a model without a batch axis), each element `<value>:<index>` or, when the output has a
labels file (config.json `label_filename`, read at load by service/repository/layout.py),
`<value>:<index>:<label>`. Classes are ranked by value, highest first, over every element of a row
(a [1000, 1, 1] output is 1000 classes); ties keep the lower index first.

k is clamped to MAX_CLASS_COUNT: a count of a billion on a [64, 512, 192] output is answered with 1,024
classes a row, not 6.3 million strings. The top k of a row are chosen by a partial selection (linear in
the row), and only the k chosen become strings; the data plane runs a large one on a worker thread.
"""

from __future__ import annotations

import numpy as np

from service.errors import InvalidArgument, quote

__all__ = ["MAX_CLASS_COUNT", "classify"]

MAX_CLASS_COUNT = 1024  # classes answered a row, at most: a larger count is clamped to it


def _shown(values: np.ndarray) -> list[str]:
    """Values as Triton writes them: floats with six decimals, integers as they are."""
    if np.issubdtype(values.dtype, np.floating):
        return [f"{v:f}" for v in values.astype(np.float64).tolist()]
    return [str(v) for v in values.tolist()]


def _top(rows: np.ndarray, k: int) -> np.ndarray:
    """The indices of each row's k highest values, highest first, ties by index ([rows, k])."""
    key = rows
    if key.dtype.kind == "f":
        nan = np.isnan(key)
        if nan.any():  # NaN ranks last, as in a sort of the negated values
            key = np.where(nan, -np.inf, key)
    n = key.shape[1]
    if k < n:
        index = np.argpartition(key, n - k, axis=1)[:, n - k :]  # the k highest, in no order
        kth = np.take_along_axis(key, index, axis=1).min(axis=1, keepdims=True)
        # Of the values equal to the k-th highest, a full stable sort keeps the lowest indices; the partition
        # kept any. Where it left one of them out (a row with more ties than room), the row is chosen again.
        short = (key == kth).sum(axis=1) != (np.take_along_axis(key, index, axis=1) == kth).sum(axis=1)
        for r in np.flatnonzero(short):
            above = np.flatnonzero(key[r] > kth[r])
            index[r] = np.concatenate([above, np.flatnonzero(key[r] == kth[r])[: k - len(above)]])
        index = np.sort(index, axis=1)
    else:
        index = np.broadcast_to(np.arange(n), key.shape)
    values = np.take_along_axis(key, index, axis=1).astype(np.float64)
    return np.take_along_axis(index, np.argsort(-values, axis=1, kind="stable"), axis=1)


def classify(array: np.ndarray, count: int, labels: tuple[str, ...], batched: bool, output: str) -> np.ndarray:
    """The top `count` classes (at most MAX_CLASS_COUNT) of each row of `array` (each element of the whole
    array, unbatched)."""
    if array.dtype == np.object_ or array.dtype.kind in "SUb":
        raise InvalidArgument(f"output {quote(output)}: classification needs numbers, the output is {array.dtype}")
    if count < 1:
        raise InvalidArgument(f"output {quote(output)}: classification count must be >= 1, got {count}")
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim else array.reshape(1, -1)
    k = min(count, MAX_CLASS_COUNT, rows.shape[1])
    top = _top(rows, k)
    values = _shown(np.take_along_axis(rows, top, axis=1).reshape(-1))
    indices = top.reshape(-1).tolist()
    named = len(labels)
    out = np.array(
        [(f"{v}:{i}:{labels[i]}" if i < named else f"{v}:{i}").encode() for v, i in zip(values, indices, strict=True)],
        dtype=np.object_,
    ).reshape(rows.shape[0], k)
    return out if batched else out[0]
