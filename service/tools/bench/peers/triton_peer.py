"""Triton Inference Server as PyTriton bundles it: its dynamic batcher in front of a Python callback that
runs onnxruntime.

PyTriton (PyPI `nvidia-pytriton`) ships a `tritonserver` binary and its Python backend; the callback runs
in this process, and Triton hands it each batch its dynamic batcher formed. It runs in its own virtual
environment (PyTriton needs numpy < 2) and imports nothing of qkv. SIGTERM stops Triton.

    python triton_peer.py --model model.onnx --name zoo_medium --port 8001 --http-port 8000 --threads 2
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

NUMPY = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-queue-delay-us", type=int, default=2000)
    args = parser.parse_args()

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(str(args.model), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    @batch  # type: ignore[untyped-decorator]
    def infer(**inputs: np.ndarray) -> dict[str, Any]:
        return dict(zip(names, session.run(None, inputs), strict=True))

    def tensors(args: list[ort.NodeArg]) -> list[Any]:  # shapes without the batch axis, -1 where dynamic
        return [
            Tensor(name=a.name, dtype=NUMPY[a.type], shape=tuple(d if isinstance(d, int) else -1 for d in a.shape[1:]))
            for a in args
        ]

    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=args.port,
        http_address="127.0.0.1",
        http_port=args.http_port,
        allow_metrics=False,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name=args.name,
            infer_func=infer,
            inputs=tensors(session.get_inputs()),
            outputs=tensors(session.get_outputs()),
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us),
            ),
            strict=False,
        )
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave the `with`: Triton is stopped
        triton.serve()


if __name__ == "__main__":
    main()
