"""System shared memory against plain gRPC: 8 MiB in and 8 MiB out through an Identity FP32 model, concurrency 1.

    .venv/bin/python -m service.tools.bench.shared_memory [--rounds 60] [--mib 8]

Starts a server on loopback (port 0) with a one-model repository in a temporary directory and sends
the same tensor both ways, alternating, one request at a time: plain, the tensor in raw_input_contents
and the output in the answer; shared memory, the tensor copied into a registered region and the output
written by the server into another, read back as an array. Each timing covers what a client does for
one answer (copy in, round trip, array out). Prints the p50 and p90 of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper

from service import protocol
from service.tools.process import start_server, stop_server

__all__ = ["main"]


def _identity(directory: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    (directory / "config.json").write_text(json.dumps({"max_batch_size": 0, "instances": 1}))


def _request(n: int) -> Any:
    request = protocol.ModelInferRequest(model_name="identity")
    request.inputs.add(name="x", datatype="FP32", shape=[n])
    return request


def _timed(fn: Callable[[], np.ndarray], rounds: int) -> list[float]:
    return [_one(fn) for _ in range(rounds)]


def _one(fn: Callable[[], np.ndarray]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.tools.bench.shared_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=60, help="requests measured each way")
    parser.add_argument("--mib", type=int, default=8, help="MiB in, and out")
    args = parser.parse_args(argv)
    size = args.mib << 20
    n = size // 4
    data = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    key = f"/qkv_bench_{os.getpid()}"
    with tempfile.TemporaryDirectory() as scratch:
        _identity(Path(scratch) / "models" / "identity")
        server = start_server(["--model-repository", str(Path(scratch) / "models")], Path(scratch) / "server.log")
        inputs = shm.create_shared_memory_region("in", key + "_in", size)
        outputs = shm.create_shared_memory_region("out", key + "_out", size)
        options = [
            ("grpc.max_receive_message_length", 2 * size + (1 << 20)),
            ("grpc.max_send_message_length", 2 * size),
        ]
        try:
            with grpc.insecure_channel(server.url, options=options) as channel:
                stub = protocol.Stub(channel)
                for name in ("in", "out"):
                    register = protocol.SystemSharedMemoryRegisterRequest(
                        name=name, key=f"{key}_{name}", byte_size=size
                    )
                    stub.SystemSharedMemoryRegister(register, timeout=10)
                through_shm = _request(n)
                for tensor, name in ((through_shm.inputs[0], "in"), (through_shm.outputs.add(name="y"), "out")):
                    tensor.parameters["shared_memory_region"].string_param = name
                    tensor.parameters["shared_memory_byte_size"].int64_param = size

                def plain() -> np.ndarray:
                    request = _request(n)
                    request.raw_input_contents.append(data.tobytes())
                    answer = stub.ModelInfer(request, timeout=60)
                    return np.frombuffer(answer.raw_output_contents[0], np.float32)

                def shared() -> np.ndarray:
                    shm.set_shared_memory_region(inputs, [data])
                    stub.ModelInfer(through_shm, timeout=60)
                    out: np.ndarray = shm.get_contents_as_numpy(outputs, np.float32, [n])
                    return out

                assert np.array_equal(plain(), data) and np.array_equal(shared(), data), "the identity changed data"
                _timed(plain, 5)  # warm up both paths
                _timed(shared, 5)
                times: dict[str, list[float]] = {"plain gRPC": [], "shared memory": []}
                for _ in range(args.rounds):  # alternating: a drift of the machine's speed falls on both
                    times["plain gRPC"].append(_one(plain))
                    times["shared memory"].append(_one(shared))
        finally:
            shm.destroy_shared_memory_region(inputs)
            shm.destroy_shared_memory_region(outputs)
            stop_server(server)
    p50 = {k: float(np.percentile(v, 50)) * 1e3 for k, v in times.items()}
    print(f"{args.mib} MiB in, {args.mib} MiB out, Identity FP32, concurrency 1, {args.rounds} requests each")
    for name, values in times.items():
        print(f"  {name:14} p50 {p50[name]:7.2f} ms   p90 {float(np.percentile(values, 90)) * 1e3:7.2f} ms")
    print(f"  shared memory / plain p50: {p50['shared memory'] / p50['plain gRPC']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
