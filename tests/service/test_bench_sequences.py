"""`qkv bench --sequences` end to end, briefly: its stateful model computes a recurrent step with the state
the server keeps (parity with numpy through tritonclient), and the bench runs both ways on a real server,
every step answered, the concurrent steps batched, every sequence it started ended."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import tritonclient.grpc as grpcclient
from onnx import numpy_helper

from service.tools.bench.sequences import CONCURRENT, FEATURES, HIDDEN, MODEL, TRANSPORTS, gru_step_model
from tests.conftest import start_server, stop_server
from tests.service.test_bench import bench


def test_the_gru_step_model_carries_its_state_between_the_steps_of_a_sequence(tmp_path: Path) -> None:
    directory = gru_step_model(tmp_path / "models")
    graph = onnx.load(str(directory / "1" / "model.onnx")).graph
    w = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    server = start_server(["--model-repository", str(tmp_path / "models")], tmp_path / "server.log")
    try:
        client = grpcclient.InferenceServerClient(server.url)
        rng = np.random.default_rng(1)
        xs = rng.normal(0, 1, (5, 1, FEATURES)).astype(np.float32)
        for sid in (11, 12):  # the second sequence starts again from zeros
            h = np.zeros((1, HIDDEN), np.float32)
            for i, x in enumerate(xs):
                tensor = grpcclient.InferInput("INPUT", [1, FEATURES], "FP32")
                tensor.set_data_from_numpy(x)
                r = client.infer(MODEL, [tensor], sequence_id=sid, sequence_start=i == 0, sequence_end=i == len(xs) - 1)
                h = np.tanh(x @ w["W"] + h @ w["U"] + w["b"])
                np.testing.assert_allclose(r.as_numpy("OUTPUT"), h, rtol=1e-5, atol=1e-6)
        client.close()
    finally:
        stop_server(server)


def test_sequences_bench_runs_both_ways_over_both_transports_and_batches_the_concurrent_steps(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = bench("--sequences", "--seconds", "0.6", "--out", str(out))
    assert done.returncode == 0, done.stderr
    r = json.loads((out / "sequences.json").read_text())
    for transport in TRANSPORTS:
        one, many = r[transport]["one at a time"], r[transport][f"{CONCURRENT} at once"]
        for mode in (one, many):
            assert mode["steps"] > 0 and mode["codes"] == {"OK": sum(x["steps"] for x in mode["rounds"])}, mode
            assert mode["steps_per_s"] > 0 and mode["server_cpu_us_per_step"] > 0
        assert one["mean_batch"] == 1.0  # one request in flight: never a batch of more
        assert many["mean_batch"] > 1.0  # 64 sequences waiting while a batch runs: theirs go together
        assert r[transport]["ratio"] > 0
        assert f"{transport}: {CONCURRENT} at once / one at a time:" in done.stdout
    assert r["bare_rpc"]["rps"] > 0
    assert r["live_sequences_after"] == 0  # each client ended the sequence the window cut, on either transport
