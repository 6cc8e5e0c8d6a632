"""A plain grpc.aio v2 server with no batching: `qkv bench --peers`' floor of what Python gRPC alone gives.

ModelInfer only, each request run on its own as it comes, one at a time on one onnxruntime session that
has every core. It runs in its own virtual environment (grpcio, protobuf, numpy and onnxruntime at
requirements/serve.txt's pins) and imports nothing of qkv: the v2 messages come from the descriptor set
qkv ships, `service/protocol/inference.binpb`, whose path it is given.

    python plain_peer.py --model model.onnx --descriptors inference.binpb --port 8001 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "inference.GRPCInferenceService"
NUMPY = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "FP16": np.float16, "BOOL": np.bool_}
V2 = {np.dtype(t): name for name, t in NUMPY.items()}


def messages(descriptors: Path) -> tuple[Any, Any]:
    """ModelInferRequest and ModelInferResponse from the descriptor set, in a pool of their own."""
    pool = descriptor_pool.DescriptorPool()
    for f in descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file:
        pool.Add(f)
    find = pool.FindMessageTypeByName
    return (
        message_factory.GetMessageClass(find("inference.ModelInferRequest")),
        message_factory.GetMessageClass(find("inference.ModelInferResponse")),
    )


async def serve(model: Path, descriptors: Path, port: int, threads: int) -> None:
    request_class, response_class = messages(descriptors)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    compute = ThreadPoolExecutor(max_workers=1)  # one request at a time: no batching, all cores on each

    async def infer(request: Any, context: grpc.aio.ServicerContext) -> Any:
        feeds = {
            t.name: np.frombuffer(raw, dtype=NUMPY[t.datatype]).reshape(tuple(t.shape))
            for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)
        }
        outputs = await asyncio.get_running_loop().run_in_executor(compute, session.run, None, feeds)
        response = response_class(model_name=request.model_name, id=request.id)
        for spec, array in zip(session.get_outputs(), outputs, strict=True):
            response.outputs.add(name=spec.name, datatype=V2[array.dtype], shape=list(array.shape))
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
        return response

    handler = grpc.unary_unary_rpc_method_handler(
        infer, request_deserializer=request_class.FromString, response_serializer=response_class.SerializeToString
    )
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ModelInfer": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--descriptors", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.model, args.descriptors, args.port, args.threads))


if __name__ == "__main__":
    main()
