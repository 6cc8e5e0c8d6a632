"""The bench's model zoo (service/tools/bench/zoo.py): valid ONNX that onnxruntime runs, padding and batching that
do not change a row's output, and a repository the server loads."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service import protocol
from service.tools.bench.zoo import ZOO, ZooModel, feeds, write_zoo
from tests.conftest import start_server, stop_server

TRANSFORMERS = [m for m in ZOO if m.sequence]
Run = Callable[[ZooModel, dict[str, np.ndarray]], np.ndarray]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_zoo(tmp_path_factory.mktemp("zoo") / "zoo")


@pytest.fixture(scope="module")
def run(zoo: Path) -> Run:
    """A model's output for some inputs, from one session per model: loading is the slow part."""
    sessions: dict[str, ort.InferenceSession] = {}

    def output(model: ZooModel, inputs: dict[str, np.ndarray]) -> np.ndarray:
        if model.name not in sessions:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1  # the machine's cores are shared
            path = zoo / model.name / "1" / "model.onnx"
            sessions[model.name] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        (out,) = sessions[model.name].run(None, inputs)
        return np.asarray(out)

    return output


def test_the_zoo_is_the_five_models_in_order() -> None:
    assert [m.name for m in ZOO] == ["zoo_small", "zoo_medium", "zoo_large", "zoo_decoder", "zoo_mlp"]
    assert [m.causal for m in ZOO] == [False, False, False, True, False]


@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_each_model_is_valid_onnx_and_runs(zoo: Path, run: Run, model: ZooModel) -> None:
    onnx_model = onnx.load(str(zoo / model.name / "1" / "model.onnx"))
    onnx.checker.check_model(onnx_model, full_check=True)
    assert onnx_model.ir_version == 8 and onnx_model.opset_import[0].version == 17
    (output,) = onnx_model.graph.output
    dims = [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
    assert dims == ["batch", model.output_width]  # dynamic batch, no sequence axis
    out = run(model, feeds(model, 2, 16, np.random.default_rng(0)))
    assert out.shape == (2, model.output_width)
    assert np.isfinite(out).all() and out.std() > 0.01


@pytest.mark.parametrize("model", TRANSFORMERS, ids=lambda m: m.name)
def test_padding_at_the_end_does_not_change_a_row(run: Run, model: ZooModel) -> None:
    # For the decoder too: causal attention never looks at the later, padded positions anyway.
    alone = feeds(model, 1, 10, np.random.default_rng(1))
    padded = {k: np.zeros((1, 16), dtype=np.int64) for k in alone}
    for k, a in alone.items():
        padded[k][:, :10] = a
    padded["input_ids"][:, 10:] = 7  # padding's ids must not matter either
    np.testing.assert_allclose(run(model, padded), run(model, alone), atol=1e-4)


@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_rows_of_a_batch_are_independent(run: Run, model: ZooModel) -> None:
    both = feeds(model, 2, 16, np.random.default_rng(2))
    together = run(model, both)
    for row in range(2):
        one = {k: a[row : row + 1] for k, a in both.items()}
        np.testing.assert_allclose(together[row : row + 1], run(model, one), atol=1e-4)


def test_a_row_of_padding_alone_is_finite(run: Run) -> None:
    model = ZOO[0]
    inputs = feeds(model, 2, 8, np.random.default_rng(3))
    inputs["attention_mask"][1] = 0
    out = run(model, inputs)
    assert np.isfinite(out).all() and not out[1].any()  # the masked mean of nothing: 0, not NaN


def test_the_decoder_is_causal_and_the_encoders_are_not(run: Run) -> None:
    # Pooled is a mean of final LayerNormalization outputs (scale 1, shift 0: each has mean 0, variance 1).
    # Causal, a sequence's first 9 states do not depend on its 10th token, so 10 x pooled(10 tokens) -
    # 9 x pooled(first 9) is the 10th state alone, variance 1; an encoder's first 9 states change with it.
    for model in TRANSFORMERS:
        full = feeds(model, 1, 10, np.random.default_rng(4))
        prefix = {k: a[:, :9] for k, a in full.items()}
        last = 10 * run(model, full)[0] - 9 * run(model, prefix)[0]
        assert abs(float(last.mean())) < 1e-3
        assert (abs(float(last.var()) - 1) < 1e-3) == model.causal, model.name


def test_config_json_leaves_batching_to_the_server(zoo: Path) -> None:
    from service.repository.layout import load_repository

    configs = {c.name: c for c in load_repository(zoo)}
    assert set(configs) == {m.name for m in ZOO}
    for model in ZOO:
        c = configs[model.name]
        assert c.kind == "tensor" and not c.batching_given
        if model.sequence:
            assert c.sequence_axis == 1
            assert c.limits == {"max_sequence_length": 1024, "vocab_size": {"input_ids": 1000}}
        else:
            assert c.sequence_axis is None and not c.limits


def test_the_server_loads_the_zoo(tmp_path: Path) -> None:
    chosen = [m for m in ZOO if m.name in ("zoo_small", "zoo_mlp")]  # the two quickest to load and warm up
    repo = write_zoo(tmp_path / "zoo", chosen)
    s = start_server(["--model-repository", str(repo)], tmp_path / "log")
    try:
        with grpc.insecure_channel(s.url) as channel:
            stub = protocol.Stub(channel)
            for model in chosen:
                assert stub.ModelReady(protocol.ModelReadyRequest(name=model.name), timeout=10).ready
    finally:
        stop_server(s)


def test_the_zoo_benchmark_measures_each_cell_against_its_ceiling_and_the_fixed_defaults(tmp_path: Path) -> None:
    """A short `qkv bench --zoo` on the smallest model: every figure the table is made of is measured."""
    from service.tools.bench.zoo_bench import SLICES, zoo_benchmark

    small = tuple(m for m in ZOO if m.name == "zoo_small")
    start = time.perf_counter()
    results = zoo_benchmark(tmp_path / "out", seconds=0.8, models=small, lengths=(16,))
    took_ms = (time.perf_counter() - start) * 1e3
    cell = results["zoo_small 16"]
    assert cell["ceiling"]["seq_per_s"] > 0 and cell["ceiling"]["batch"] in (1, 8, 32)
    # Milliseconds of one sequence's compute, whatever this machine's speed: a part of the benchmark's own time.
    assert 0 < cell["ceiling"]["c1_compute_ms"] < took_ms
    for kind in ("tuned c1", "fixed c1", "tuned c32", "fixed c32"):
        assert cell[kind]["rps"] > 0 and cell[kind]["codes"] == {"OK": cell[kind]["requests"]}, kind
    assert cell["tuned c32"]["requests"] >= SLICES  # every slice answered
    tuned = " ".join(results["settings tuned"])
    assert "zoo_small" in tuned and "inline_max_tokens" in tuned and "config.json" not in tuned
    assert "config.json" in " ".join(results["settings fixed"])  # the fixed defaults, given explicitly
    table = (tmp_path / "out" / "zoo.md").read_text().splitlines()
    assert len(table) == 3 and table[2].startswith("| zoo_small | 16 |")
