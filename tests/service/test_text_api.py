"""The text endpoints' JSON writing of embeddings (service/frontends/text_api.py): what a client reads back
is the float32 the model computed, exactly, in fewer digits than json.dumps writes."""

from __future__ import annotations

import json

import numpy as np

from service.frontends.json_numbers import float_rows, floats


def test_nine_digits_give_every_float32_back_exactly() -> None:
    rng = np.random.default_rng(0)
    edges = np.array([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.17549435e-38, 3.4028235e38, -3.4028235e38, 0.1, 1 / 3],
                     dtype=np.float32)  # fmt: skip
    vectors = np.concatenate([edges, rng.standard_normal(20_000).astype(np.float32) / 20,
                              rng.uniform(-1e30, 1e30, 2_000).astype(np.float32)])  # fmt: skip
    written = floats(vectors)
    back = np.array(json.loads(written), dtype=np.float32)
    assert np.array_equal(back.view(np.uint32), vectors.view(np.uint32)), "bit for bit, -0.0 and subnormals too"
    assert len(written) < 0.7 * len(json.dumps(vectors.tolist())), "shorter than float64's shortest repr"


def test_rows_are_arrays_and_values_json_has_no_number_for_are_written_as_json_dumps_writes_them() -> None:
    matrix = np.array([[0.5, -0.25], [1.5, 2.0]], dtype=np.float32)
    assert json.loads(float_rows(matrix)) == [[0.5, -0.25], [1.5, 2.0]]
    odd = np.array([np.nan, np.inf, 1.0], dtype=np.float32)
    assert floats(odd) == json.dumps([float("nan"), float("inf"), 1.0])
