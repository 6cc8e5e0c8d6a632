"""Float32 arrays written as JSON text: as many digits as give each value back exactly, and no more."""

from __future__ import annotations

import functools
import json

import numpy as np

__all__ = ["float_rows", "floats"]


CACHED_FORMATS = 32  # the formats of the lengths seen last (an embedding's width, a model's output size)


@functools.lru_cache(maxsize=CACHED_FORMATS)
def _float_format(n: int) -> str:
    return "[" + ",".join(["%.9g"] * n) + "]"


def floats(vector: np.ndarray) -> str:
    """A float32 vector as a JSON array, each value to 9 significant digits: as many as give every float32 back
    exactly, where json.dumps of its float64 widening writes up to 17 (a 384-float embedding: 5 kB, not 8, in
    a third of the time). A value JSON has no number for (nan, inf) is written as json.dumps writes it."""
    values = vector.tolist()
    if not np.isfinite(vector).all():
        return json.dumps(values)
    # -0.0 as "-0.0": "-0" reads back as the integer 0 (an exponent has two digits: no other "-0," or "-0]")
    return (_float_format(len(values)) % tuple(values)).replace("-0,", "-0.0,").replace("-0]", "-0.0]")


def float_rows(matrix: np.ndarray) -> str:
    """A float32 [N, D] as a JSON array of arrays (`floats` each)."""
    return "[" + ",".join(map(floats, matrix)) + "]"
