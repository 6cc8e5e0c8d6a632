"""A model's outputs bounded from its declarations and a request's inputs, before it runs
(service/models/output_bounds.py): what an ensemble checks before each step."""

from __future__ import annotations

import numpy as np

from service.models.output_bounds import Bound, Declared, predicted, unbounded
from service.models.runtime import TensorSpec


def _spec(name: str, *dims: int | str | None) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) else -1 for d in dims)
    return TensorSpec(name, "FP32", shape, tuple(d if isinstance(d, str) else None for d in dims))


A, B = _spec("A", "batch", "n"), _spec("B", "batch", "m")
OUTER = _spec("P", "batch", "n", "m")


def test_a_dynamic_dimension_takes_the_size_of_the_input_axis_of_its_name() -> None:
    declared = Declared((A, B), True, {}, None)
    feeds = {"A": np.zeros((2, 65_536), np.float32), "B": np.zeros((2, 8_192), np.float32)}
    assert unbounded(declared, OUTER) == ""
    assert predicted(declared, OUTER, feeds) == Bound((2, 65_536, 8_192), 2 * 65_536 * 8_192)
    # fixed dimensions are their own bound; an unnamed batch axis takes the rows
    assert predicted(declared, _spec("S", None, 10), feeds) == Bound((2, 10), 20)


def test_an_input_of_another_rank_than_declared_bounds_its_axes_by_all_it_holds() -> None:
    text = _spec("TEXT", "batch")
    declared = Declared((text,), False, {"word": 256}, None)
    feeds = {"TEXT": np.empty((3, 4, 0, 5), np.object_)}  # zeros bound nothing away: 3 x 4 x 5
    assert predicted(declared, _spec("PHONEMES", "batch"), feeds) == Bound((60,), 60)
    assert predicted(declared, _spec("WORDS", "word", 40), feeds) == Bound((256, 40), 10_240)  # the kind's limit


def test_what_nothing_bounds_is_said_and_a_declared_limit_bounds_it() -> None:
    tiled = _spec("Y", "batch", None)
    said = unbounded(Declared((A,), False, {}, None), tiled)
    assert said == "dimension 1 (an unnamed axis) is dynamic and no input's dimension or declared limit bounds it"
    assert "axis 'k'" in unbounded(Declared((A,), False, {}, None), _spec("Y", "k"))
    assert predicted(Declared((A,), False, {}, None), tiled, {"A": np.zeros((1, 4))}) is None
    limited = Declared((A,), False, {}, 64)
    assert unbounded(limited, tiled) == ""
    assert predicted(limited, tiled, {"A": np.zeros((1, 4))}) == Bound(None, 64)
    assert predicted(limited, OUTER, {"A": np.zeros((1, 100))}) == Bound(None, 64)  # m: no input has it
    assert predicted(limited, _spec("Z", "batch", "n"), {"A": np.zeros((1, 100))}) == Bound((1, 100), 64)
