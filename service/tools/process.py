"""Run `qkv serve` as a child process on loopback (port 0) and wait for its ready line.

Used by `qkv bench` (servers in several configurations, one run) and by the tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["ServerProcess", "start_server", "stop_server"]

READY = re.compile(r"on grpc (\S+):(\d+) metrics (\S+):(-?\d+)(?: http (?:\S+):(\d+))?")


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    url: str
    metrics_url: str
    log: Path
    log_file: IO[str] | None = None
    http_url: str = ""  # 127.0.0.1:PORT, when HTTP is on

    def output(self) -> str:
        return self.log.read_text()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *_: object) -> None:
        stop_server(self)


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 60,
                 cwd: Path | None = None) -> ServerProcess:  # fmt: skip
    """Start `qkv serve --host 127.0.0.1 ARGS` (ports 0 unless given) and wait until it is ready."""
    cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1"]
    if "--grpc-port" not in args:
        cmd += ["--grpc-port", "0"]
    if "--metrics-port" not in args:
        cmd += ["--metrics-port", "0"]
    if "--http-port" not in args:
        cmd += ["--http-port", "0"]
    out = log.open("w")
    proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env={**os.environ, **(env or {})})  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = READY.search(log.read_text())
        if m:
            http = f"127.0.0.1:{m.group(5)}" if m.group(5) else ""
            metrics = f"http://127.0.0.1:{m.group(4)}/metrics"
            return ServerProcess(proc, f"127.0.0.1:{m.group(2)}", metrics, log, out, http)
        if proc.poll() is not None:
            out.close()
            raise RuntimeError(f"qkv serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    out.close()
    raise RuntimeError(f"qkv serve not ready in {timeout} s:\n{log.read_text()}")


def stop_server(server: ServerProcess, timeout: float = 30) -> int:
    """SIGTERM, wait for the drain; SIGKILL if it takes longer than `timeout`."""
    try:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return -9
    finally:
        if server.log_file is not None:
            server.log_file.close()
