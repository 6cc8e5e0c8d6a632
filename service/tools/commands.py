"""The tool commands of `qkv`: `infer`, `health`, `attention` and `bench`, each a client of a running server.

`service/cli.py` dispatches to them and prints their refusals (`UsageError`) as one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from service.errors import UsageError
from service.tools.client import rpc_problem

__all__ = ["attention", "bench", "client_arguments", "health", "infer"]


def client_arguments(parser: argparse.ArgumentParser) -> None:
    from service.config import DEFAULT_URL, server_url

    parser.add_argument("--url", default=server_url(), help=f"server HOST:PORT (default: $QKV_URL, else {DEFAULT_URL})")
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds")
    parser.add_argument("--token", help="bearer token (or QKV_TOKEN)")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA to verify the server (enables TLS)")


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import grpc

    from service.tools.client import Client

    creds = grpc.ssl_channel_credentials(args.tls_ca.read_bytes()) if args.tls_ca else None
    # A tool fails at once where nothing listens, naming the address, rather than retrying to its deadline.
    return Client(args.url, args.timeout, args.token or os.environ.get("QKV_TOKEN"), creds, wait_for_server=False)


def infer(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="qkv infer",
        description="Call a model: words in, phonemes out (g2p), or tensors in and out for any model.",
        epilog="--input NAME=VALUE: VALUE is a .npy file, @FILE of JSON, or JSON (nested lists); each is checked "
        "against the model's metadata (datatype, shape) before it is sent.",
    )
    parser.add_argument("words", nargs="*", help="each argument is one TEXT element (g2p)")
    parser.add_argument("--model", default="g2p")
    parser.add_argument("--model-version", default="", help="a version of the model (default: the newest served)")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=VALUE", help="a tensor (any model)")
    parser.add_argument("--datatype", action="append", default=[], metavar="NAME=TYPE",
                        help="an input's v2 datatype (INT64, FP32, BYTES, ...); default: the model's")  # fmt: skip
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2",
                        help="an input's shape; default: its value's")  # fmt: skip
    parser.add_argument("--output", action="append", default=[], metavar="NAME", help="outputs to ask for (all)")
    parser.add_argument("--beam-size", type=int, default=1)
    parser.add_argument(
        "--no-lexicon", action="store_true", help="every word decoded by the model, none answered by its lexicon"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--traceparent", help="W3C trace context to continue (default: a new trace)")
    client_arguments(parser)
    args = parser.parse_args(argv)
    if args.words and args.input:
        raise UsageError("give words (TEXT, for g2p) or --input NAME=VALUE tensors (any model), not both")
    if not args.words and not args.input:
        raise UsageError("nothing to send: give words (g2p) or --input NAME=VALUE tensors")
    return _infer_tensors(args) if args.input else _infer_words(args)


def _infer_words(args: argparse.Namespace) -> int:
    import grpc

    from service.tools.client import g2p_outputs, g2p_request, new_traceparent, trace_id

    traceparent = args.traceparent or new_traceparent()
    # On stderr, so the output stays the phonemes: the id to find the call by in a tracing backend.
    print(f"trace {trace_id(traceparent)}", file=sys.stderr)
    try:
        with _client(args) as client:
            request = g2p_request(
                args.words,
                args.model,
                beam_size=args.beam_size,
                version=args.model_version,
                lexicon=not args.no_lexicon,
            )
            response = client.infer(request, traceparent=traceparent)
            out = g2p_outputs(response)
    except grpc.RpcError as e:
        print(f"qkv infer: {rpc_problem(e, args.url)}", file=sys.stderr)
        return 1
    if args.json:
        pairs = zip(args.words, out["PHONEMES"], strict=True)
        print(json.dumps([{"text": w, "phonemes": p, "model_version": response.model_version} for w, p in pairs]))
    else:
        for w, p in zip(args.words, out["PHONEMES"], strict=True):
            print(f"{w}\t{p}")
    return 0


def _infer_tensors(args: argparse.Namespace) -> int:
    """`--input` tensors checked against the model's metadata, sent, and every output printed."""
    import grpc

    from service import protocol
    from service.tools import tensor_io
    from service.tools.client import new_traceparent, trace_id

    try:
        given = tensor_io.given_inputs(args.input, args.datatype, args.shape)
    except tensor_io.TensorError as e:
        raise UsageError(str(e)) from None
    traceparent = args.traceparent or new_traceparent()
    print(f"trace {trace_id(traceparent)}", file=sys.stderr)
    try:
        with _client(args) as client:
            asked = protocol.ModelMetadataRequest(name=args.model, version=args.model_version)
            metadata = client.call("ModelMetadata", asked)
            try:
                inputs = tensor_io.checked(given, metadata)
            except tensor_io.TensorError as e:
                raise UsageError(str(e)) from None
            request = tensor_io.request(args.model, args.model_version, inputs, args.output)
            if args.beam_size != 1:
                request.parameters["beam_size"].int64_param = args.beam_size
            response = client.infer(request, traceparent=traceparent)
    except grpc.RpcError as e:
        print(f"qkv infer: {rpc_problem(e, args.url)}", file=sys.stderr)
        return 1
    print(tensor_io.outputs_json(response) if args.json else tensor_io.outputs_text(response))
    return 0


def health(argv: list[str]) -> int:
    import grpc

    from service.tools.client import health_check, unreachable

    parser = argparse.ArgumentParser(prog="qkv health", description="Exit 0 when the server (or --service) SERVES.")
    parser.add_argument("--service", default="", help="a model name, or '' for the whole server")
    client_arguments(parser)
    args = parser.parse_args(argv)
    creds = grpc.ssl_channel_credentials(args.tls_ca.read_bytes()) if args.tls_ca else None
    try:
        status = health_check(args.url, args.service, args.timeout, creds)
    except grpc.RpcError as e:
        # grpc.health answers an unknown service NOT_FOUND with no details: say which.
        unknown = e.code() == grpc.StatusCode.NOT_FOUND and not e.details()
        why = f"the server has no service '{args.service}'" if unknown else e.details()
        print(f"qkv health: {e.code().name}: {unreachable(e, args.url) or why}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def attention(argv: list[str]) -> int:
    from service.tools.attention_plot import main as attention_main

    return attention_main(argv, client_arguments, _client)


def bench(argv: list[str]) -> int:
    from service.tools.bench import main as bench_main

    return bench_main(argv)
