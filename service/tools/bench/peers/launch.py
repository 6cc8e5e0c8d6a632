"""Start and stop the peer servers: each in its own environment and process group, on 127.0.0.1 only.

A peer is ready when it answers a real ModelInfer: the three have no readiness call in common that means
the same thing, and the answer is kept, to be checked against onnxruntime in process. infinity-emb (the
text-model bench's peer) speaks HTTP only: it is ready when it answers a real POST /embeddings. A peer is stopped
by its PID: SIGTERM (each stops its own children on it), then SIGKILL to the process group it leads,
for any child left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc

from service import protocol

__all__ = ["Peer", "start_peer", "stop_peer", "wait_http_ready", "wait_ready"]

HERE = Path(__file__).resolve().parent
DESCRIPTORS = HERE.parents[2] / "protocol" / "inference.binpb"


@dataclass
class Peer:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    log_file: IO[bytes]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    # Triton and MLServer take fixed ports: one the kernel just gave out is very likely still free.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _libdir(python: Path) -> str:
    done = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def start_peer(name: str, python: Path, model: Path, model_name: str, scratch: Path, threads: int) -> Peer:
    """Start peer `name` with `python` (its environment's) serving `model` as `model_name`."""
    port = _free_port()
    env = dict(os.environ)
    cwd = scratch
    common = ["--model", str(model), "--port", str(port), "--threads", str(threads)]
    if name == "plain":
        argv = [str(HERE / "plain_peer.py"), *common, "--descriptors", str(DESCRIPTORS)]
    elif name == "triton":
        argv = [str(HERE / "triton_peer.py"), *common, "--name", model_name, "--http-port", str(_free_port())]
        # Triton's Python backend stub loads libpython by its soname: the system's 3.11 when the
        # environment's Python is another build of 3.11 (pyenv's here), and the stdlib then disagrees with it.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [_libdir(python), env.get("LD_LIBRARY_PATH", "")]))
    elif name == "mlserver":
        folder = scratch / "mlserver"
        folder.mkdir(parents=True, exist_ok=True)
        argv = [str(HERE / "mlserver_peer.py"), *common, "--name", model_name, "--folder", str(folder),
                "--http-port", str(_free_port()), "--metrics-port", str(_free_port())]  # fmt: skip
        env["PYTHONPATH"] = str(HERE)  # MLServer's worker process imports the runtime by module name
    elif name == "infinity":
        # Its ONNX engine (optimum, mean pooling as the folder's 1_Pooling says: its default for it is CLS). It
        # names the graph by its path under --model-id, which optimum-onnx 0.1.0 wants relative to the folder:
        # an absolute --model-id fails ("Could not find any ONNX files with target file name /.../model.onnx,
        # only found: [PosixPath('model.onnx')]"), so it runs in the folder, as ".". Its threads are
        # onnxruntime's default, every core.
        argv = [str(python.parent / "infinity_emb"), "v2", "--model-id", ".", "--served-model-name", model_name,
                "--engine", "optimum", "--device", "cpu", "--pooling-method", "mean", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning"]  # fmt: skip
        cwd = model
        # no hub: what it would fetch or cache goes to the scratch folder, and no usage statistics are sent
        env |= {"HF_HOME": str(scratch / "hf"), "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                "DO_NOT_TRACK": "1"}  # fmt: skip
    else:
        raise ValueError(f"no peer {name!r}")
    log = scratch / f"{name}.log"
    out = log.open("wb")
    process = subprocess.Popen(
        [str(python), *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )
    return Peer(name, process, f"127.0.0.1:{port}", log, out)


def wait_ready(url: str, request: Any, alive: Any = None, timeout: float = 300) -> Any:
    """The first OK answer of `url` to `request`, retried until `timeout`; `alive()` False stops early."""
    deadline = time.monotonic() + timeout
    last = ""
    with grpc.insecure_channel(url) as channel:
        stub = protocol.Stub(channel)
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise RuntimeError(f"exited before it answered ({last})")
            try:
                return stub.ModelInfer(request, timeout=30)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
                time.sleep(0.5)
    raise RuntimeError(f"no answer in {timeout:g} s ({last})")


def wait_http_ready(url: str, path: str, body: dict[str, Any], alive: Any = None, timeout: float = 300) -> Any:
    """The first 200 answer (JSON) of POST `path` on `url` with `body`, retried until `timeout`; `alive()`
    False stops early."""
    deadline = time.monotonic() + timeout
    last = ""
    data, headers = json.dumps(body).encode(), {"Content-Type": "application/json"}
    request = urllib.request.Request(f"http://{url}{path}", data, headers)
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"exited before it answered ({last})")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return json.loads(r.read())
        except (OSError, ValueError) as e:  # refused while starting, an HTTP error, a broken answer
            last = str(e)
            time.sleep(0.5)
    raise RuntimeError(f"no answer in {timeout:g} s ({last})")


def stop_peer(peer: Peer, timeout: float = 30) -> None:
    if peer.process.poll() is None:
        peer.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            peer.process.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(peer.process.pid, signal.SIGKILL)  # the group the peer leads: its children, if any are left
    peer.process.wait()
    peer.log_file.close()
