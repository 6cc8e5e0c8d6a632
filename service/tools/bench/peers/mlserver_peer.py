"""MLServer with its adaptive batching in front of a custom runtime that runs onnxruntime.

`OnnxRuntimeModel` is the runtime (an `mlserver.MLModel`); `main` writes MLServer's settings.json and the
model's model-settings.json (max_batch_size, max_batch_time) into a scratch folder and starts MLServer
on it, as `mlserver start FOLDER` would. MLServer's defaults are kept otherwise: one parallel worker
process runs `predict`, the gRPC front end another. It runs in its own virtual environment and imports
nothing of qkv; this file's folder must be on PYTHONPATH so that the worker finds the runtime.

    python mlserver_peer.py --model model.onnx --name zoo_medium --port 8001 --http-port 8000 \
        --metrics-port 8002 --threads 2 --folder /tmp/scratch
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntimeModel(MLModel):  # type: ignore[misc]
    """One onnxruntime session; each batch MLServer's adaptive batcher forms is one `run`."""

    async def load(self) -> bool:
        extra = self.settings.parameters.extra or {}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = int(extra.get("threads", 1)), 1
        self.session = ort.InferenceSession(self.settings.parameters.uri, opts, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        outputs: list[np.ndarray] = await asyncio.to_thread(self.session.run, None, feeds)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(n, a) for n, a in zip(self.output_names, outputs, strict=True)],
        )


def write_settings(folder: Path, args: argparse.Namespace) -> None:
    server: dict[str, Any] = {
        "host": "127.0.0.1",
        "grpc_port": args.port,
        "http_port": args.http_port,
        "metrics_port": args.metrics_port,
        "load_models_at_startup": True,
    }
    model = {
        "name": args.name,
        "implementation": f"{Path(__file__).stem}.OnnxRuntimeModel",
        "max_batch_size": args.max_batch_size,
        "max_batch_time": args.max_batch_time,
        "parameters": {"uri": str(args.model.resolve()), "extra": {"threads": args.threads}},
    }
    (folder / args.name).mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps(server, indent=2))
    (folder / args.name / "model-settings.json").write_text(json.dumps(model, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-batch-time", type=float, default=0.002, help="seconds")
    args = parser.parse_args()
    write_settings(args.folder, args)

    from mlserver.cli.main import main as mlserver

    sys.argv = ["mlserver", "start", str(args.folder)]
    mlserver()  # MLServer's own command line; it handles SIGTERM itself: stops its workers, then returns


if __name__ == "__main__":
    main()
