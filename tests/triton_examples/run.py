"""Triton's example clients against qkv serving Triton's example repository: `make triton-examples`.

    .venv/bin/python -m tests.triton_examples.run [--out DIR] [--only NAME ...] [--form json]

Builds the repository (tests/triton_examples/build.py), starts `qkv serve` on it on loopback, runs each of
Triton's Python example clients (vendored unchanged in tests/triton_examples/clients, from Triton's client
repository, src/python/examples) with the pinned tritonclient, and prints passed / failed per client, then
the count. A client passes when it exits 0 (and prints its PASS line, for those that print one). The
model-control clients load and unload models, so each runs on a server of its own, on a repository of as
many models as it counts (8 for gRPC, 7 for HTTP, as Triton's test repositories hold). Exit status: 0 when
every client expected to pass passed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from service.tools.process import ServerProcess, start_server, stop_server
from tests.triton_examples.build import build

HERE = Path(__file__).resolve().parent
CLIENTS = HERE / "clients"
ROOT = HERE.parents[1]
CLIENT_TIMEOUT_S = 120


@dataclass(frozen=True)
class Client:
    name: str  # as the report shows it
    script: str
    args: tuple[str, ...] = ()
    protocol: str = "grpc"  # which port -u names
    server: str = "main"  # main, or a model-control server of its own: grpc_control, http_control
    cannot: str = ""  # why it is not run (a GPU, Triton's C API, ...)


IMAGE = ("-m", "densenet_onnx", "-c", "3", "-s", "INCEPTION")
RUNS = (
    Client("grpc_client", "grpc_client.py"),
    Client("grpc_explicit_byte_content_client", "grpc_explicit_byte_content_client.py"),
    Client("grpc_explicit_int8_content_client", "grpc_explicit_int8_content_client.py"),
    Client("grpc_explicit_int_content_client", "grpc_explicit_int_content_client.py"),
    Client("grpc_image_client", "grpc_image_client.py", IMAGE),
    Client("image_client -i gRPC", "image_client.py", (*IMAGE, "-i", "gRPC")),
    Client(
        "image_client -i HTTP",
        "image_client.py",
        (*IMAGE, "-i", "HTTP"),
        "http",
        cannot="it imports attrdict, which fails on Python 3.10 and later",
    ),
    Client("image_client -i gRPC -a (async)", "image_client.py", (*IMAGE, "-i", "gRPC", "-a")),
    Client("image_client -i gRPC --streaming", "image_client.py", (*IMAGE, "-i", "gRPC", "--streaming")),
    Client("reuse_infer_objects_client", "reuse_infer_objects_client.py", ("-i", "grpc")),
    Client("reuse_infer_objects_client -i http", "reuse_infer_objects_client.py", ("-i", "http"), "http"),
    Client("simple_grpc_aio_infer_client", "simple_grpc_aio_infer_client.py"),
    Client("simple_grpc_aio_sequence_stream_infer_client", "simple_grpc_aio_sequence_stream_infer_client.py"),
    Client("simple_grpc_async_infer_client", "simple_grpc_async_infer_client.py"),
    Client("simple_grpc_custom_args_client", "simple_grpc_custom_args_client.py"),
    Client("simple_grpc_health_metadata", "simple_grpc_health_metadata.py"),
    Client("simple_grpc_infer_client", "simple_grpc_infer_client.py"),
    Client("simple_grpc_keepalive_client", "simple_grpc_keepalive_client.py"),
    Client("simple_grpc_model_control", "simple_grpc_model_control.py", server="grpc_control"),
    Client("simple_grpc_sequence_stream_infer_client", "simple_grpc_sequence_stream_infer_client.py"),
    Client("simple_grpc_sequence_stream_infer_client -d", "simple_grpc_sequence_stream_infer_client.py", ("-d",)),
    Client("simple_grpc_sequence_sync_infer_client", "simple_grpc_sequence_sync_infer_client.py"),
    Client("simple_grpc_sequence_sync_infer_client -d", "simple_grpc_sequence_sync_infer_client.py", ("-d",)),
    Client("simple_grpc_shm_client", "simple_grpc_shm_client.py"),
    Client("simple_grpc_shm_string_client", "simple_grpc_shm_string_client.py"),
    Client("simple_grpc_string_infer_client", "simple_grpc_string_infer_client.py"),
    Client("simple_http_aio_infer_client", "simple_http_aio_infer_client.py", protocol="http"),
    Client("simple_http_async_infer_client", "simple_http_async_infer_client.py", protocol="http"),
    Client("simple_http_health_metadata", "simple_http_health_metadata.py", protocol="http"),
    Client("simple_http_infer_client", "simple_http_infer_client.py", protocol="http"),
    Client("simple_http_model_control", "simple_http_model_control.py", protocol="http", server="http_control"),
    Client("simple_http_sequence_sync_infer_client", "simple_http_sequence_sync_infer_client.py", protocol="http"),
    Client("simple_http_sequence_sync_infer_client -d", "simple_http_sequence_sync_infer_client.py", ("-d",), "http"),
    Client("simple_http_shm_client", "simple_http_shm_client.py", protocol="http"),
    Client("simple_http_shm_string_client", "simple_http_shm_string_client.py", protocol="http"),
    Client("simple_http_string_infer_client", "simple_http_string_infer_client.py", protocol="http"),
    Client("simple_grpc_cudashm_client", "simple_grpc_cudashm_client.py", cannot="CUDA shared memory: needs a GPU"),
    Client("simple_http_cudashm_client", "simple_http_cudashm_client.py", cannot="CUDA shared memory: needs a GPU"),
    Client(
        "simple_grpc_custom_repeat", "simple_grpc_custom_repeat.py", cannot="a decoupled C++ backend (repeat_int32)"
    ),
    Client(
        "ensemble_image_client",
        "ensemble_image_client.py",
        cannot="an ensemble of DALI / Python pre-processing backends",
    ),
    Client("memory_growth_test", "memory_growth_test.py", cannot="Triton's own test harness (custom_identity_int32)"),
)


def _passed(client: Client, rc: int, output: str) -> bool:
    prints_pass = "PASS" in (CLIENTS / client.script).read_text()
    return rc == 0 and ("PASS" in output or not prints_pass)


def _run(client: Client, url: str, image: Path) -> tuple[bool, str]:
    args = [sys.executable, str(CLIENTS / client.script), "-u", url, *client.args]
    if client.script in ("image_client.py", "grpc_image_client.py"):
        args.append(str(image))
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, cwd=CLIENTS)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {CLIENT_TIMEOUT_S} s"
    output = done.stdout + done.stderr
    return _passed(client, done.returncode, output), output


def _serve(repository: Path, log: Path, control: bool) -> ServerProcess:
    args = ["--model-repository", str(repository), "--server-name", "triton"]
    if control:
        args += ["--model-control-mode", "explicit", "--load-model", "*"]
    return start_server(args, log, cwd=ROOT)


def _subset(repository: Path, out: Path, count: int) -> Path:
    """A copy of the repository holding its first `count` models, for a model-control client's count."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for model in sorted(repository.iterdir())[:count]:
        shutil.copytree(model, out / model.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="where the repository is built (default: a temporary dir)"
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only these clients (names as printed)")
    parser.add_argument(
        "--form", choices=("pbtxt", "json"), default="pbtxt", help="the configs as config.pbtxt, or Triton's JSON form"
    )
    flags = parser.parse_args(argv)
    out = flags.out or Path(tempfile.mkdtemp(prefix="qkv-triton-examples-"))
    repository = build(out, flags.form)
    runs = [c for c in RUNS if flags.only is None or c.name in flags.only]
    results: list[tuple[Client, str]] = []
    servers = {
        "main": (repository, False),
        "grpc_control": (_subset(repository, out / "repository_8", 8), True),
        "http_control": (_subset(repository, out / "repository_7", 7), True),
    }
    started = time.monotonic()
    for key, (repo, control) in servers.items():
        todo = [c for c in runs if c.server == key and not c.cannot]
        if not todo:
            continue
        server = _serve(repo, out / f"{key}.log", control)
        try:
            for client in todo:
                url = server.url if client.protocol == "grpc" else server.http_url
                ok, output = _run(client, url, out / "mug.png")
                results.append((client, "passed" if ok else "failed"))
                print(f"{'passed' if ok else 'FAILED'}  {client.name}", flush=True)
                if not ok:
                    tail = "\n".join(output.strip().splitlines()[-6:])
                    print("        " + tail.replace("\n", "\n        "), flush=True)
        finally:
            stop_server(server)
    for client in runs:
        if client.cannot:
            results.append((client, "not run"))
            print(f"not run {client.name}: {client.cannot}")
    passed = sum(1 for _, r in results if r == "passed")
    ran = sum(1 for _, r in results if r != "not run")
    print(f"{passed} of {ran} clients passed ({len(results) - ran} not run) in {time.monotonic() - started:.0f} s")
    return 0 if passed == ran else 1


if __name__ == "__main__":
    sys.exit(main())
