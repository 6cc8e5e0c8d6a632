"""Start-up failures, user models dropped into the repository, and drain on SIGTERM."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service import protocol
from service.observability.metrics import UNKNOWN_MODEL
from service.tools.client import g2p_request
from tests.conftest import MODELS, ROOT, scale_model, start_server, stop_server


def copy_repository(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    shutil.copytree(MODELS, repo)
    return repo


def serve_exit(repo: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--model-repository",
        str(repo),
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_corrupt_model_file_stops_the_start(tmp_path: Path) -> None:
    repo = copy_repository(tmp_path)
    (repo / "g2p_encoder" / "1" / "model.onnx").write_bytes(b"not an onnx graph")
    done = serve_exit(repo)
    assert done.returncode != 0
    assert "g2p_encoder" in done.stderr and "model.onnx" in done.stderr


def test_missing_model_file_stops_the_start(tmp_path: Path) -> None:
    repo = copy_repository(tmp_path)
    (repo / "g2p" / "1" / "decoder.onnx").unlink()
    done = serve_exit(repo)
    assert done.returncode != 0 and "missing" in done.stderr and "decoder.onnx" in done.stderr


def test_bad_config_stops_the_start(tmp_path: Path) -> None:
    repo = copy_repository(tmp_path)
    (repo / "g2p_encoder" / "config.json").write_text('{"kind": "tensor", "batching": {"max_batch": 3}}')
    done = serve_exit(repo)
    assert done.returncode != 0 and "unknown setting" in done.stderr and "max_batch" in done.stderr


def test_a_precision_the_repository_lacks_stops_the_start(tmp_path: Path) -> None:
    repo = copy_repository(tmp_path)
    config = repo / "g2p_encoder" / "config.json"
    (repo / "g2p_encoder" / "config.json").write_text(
        config.read_text().replace('"kind"', '"precision": "int8", "kind"', 1)
    )
    done = serve_exit(repo)
    assert done.returncode != 0 and "missing" in done.stderr and "model.int8.onnx" in done.stderr
    assert "export.quantize" in done.stderr  # and how to write it
    config.write_text(config.read_text().replace('"precision": "int8"', '"precision": "fp16"'))
    done = serve_exit(repo)
    assert done.returncode != 0 and "unknown precision 'fp16'" in done.stderr


def test_a_users_onnx_model_is_served_from_its_graph(tmp_path: Path) -> None:
    """models/NAME/1/model.onnx without any config: inputs/outputs come from the graph."""
    scale_model(tmp_path / "repo" / "scale")
    s = start_server(["--model-repository", str(tmp_path / "repo")], tmp_path / "log")
    try:
        import tritonclient.grpc as g

        c = g.InferenceServerClient(s.url)
        meta = c.get_model_metadata("scale")
        assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [("x", "FP32", [-1, 3])]
        inp = g.InferInput("x", [2, 3], "FP32")
        inp.set_data_from_numpy(np.array([[1, 1, 1], [2, 2, 2]], np.float32))
        assert c.infer("scale", [inp]).as_numpy("y").tolist() == [[1, 2, 3], [2, 4, 6]]
        bad = g.InferInput("x", [1, 3], "FP32")
        bad.set_data_from_numpy(np.array([[1, np.nan, 1]], np.float32))
        with pytest.raises(Exception, match="NaN"):
            c.infer("scale", [bad])
    finally:
        stop_server(s)


def test_sigterm_under_load_answers_every_admitted_request(tmp_path: Path) -> None:
    s = start_server(["--grace-period", "20"], tmp_path / "log")
    sent, outcomes = 300, []
    words = ["transformer", "attention", "encoder", "decoder", "hello", "world", "phoneme", "grapheme"]
    flipped: list[int] = []

    async def load() -> None:
        async with grpc.aio.insecure_channel(s.url) as ch:
            stub = protocol.Stub(ch)

            async def one(i: int) -> None:
                await asyncio.sleep(i * 0.004)  # ~1.2 s of arrivals; SIGTERM lands in the middle
                try:
                    r = await stub.ModelInfer(g2p_request(words * 2, lexicon=False), timeout=30)  # decoded
                    outcomes.append("OK" if len(r.outputs) == 1 and r.raw_output_contents[0] else "EMPTY")
                except grpc.aio.AioRpcError as e:
                    outcomes.append(e.code().name)

            await asyncio.gather(*(one(i) for i in range(sent)))

    def terminate() -> None:
        time.sleep(0.6)
        s.process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        with grpc.insecure_channel(s.url) as ch:
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
                flipped.append(status)
            except grpc.RpcError:
                flipped.append(-1)  # already closed: also not serving

    killer = threading.Thread(target=terminate)
    killer.start()
    asyncio.run(load())
    killer.join()
    code = s.process.wait(30)
    stop_server(s)
    assert code == 0
    assert len(outcomes) == sent
    # Every request is answered, or refused at admission (draining: UNAVAILABLE; queue full: RESOURCE_EXHAUSTED).
    assert set(outcomes) <= {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}, set(outcomes)
    assert outcomes.count("OK") > 0 and outcomes.count("UNAVAILABLE") > 0
    assert flipped and flipped[0] != health_pb2.HealthCheckResponse.SERVING


def test_device_cuda_falls_back_to_cpu_with_one_log_line(tmp_path: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA: the fallback does not apply")
    s = start_server(["--device", "cuda"], tmp_path / "log")
    try:
        import tritonclient.grpc as g

        c = g.InferenceServerClient(s.url)
        assert "CPUExecutionProvider" in c.get_model_metadata("g2p_encoder").platform
        assert c.get_model_config("g2p").config.parameters["provider"].string_value == "CPUExecutionProvider"
    finally:
        stop_server(s)
    lines = [x for x in s.output().splitlines() if "falling back to CPUExecutionProvider" in x]
    assert len(lines) == 1


def test_a_model_named_like_the_unknown_label_stops_the_start(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    scale_model(repo / UNKNOWN_MODEL)
    done = serve_exit(repo)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"qkv: model '{UNKNOWN_MODEL}': the name is reserved (the metrics count requests for models the server "
        "does not have under it); rename the directory"
    )
