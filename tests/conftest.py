"""Shared fixtures: a real `qkv serve` process on loopback (port 0), and the shipped repository."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
READY = re.compile(r"on grpc (\S+):(\d+) metrics (\S+):(-?\d+)")


@dataclass
class RunningServer:
    process: subprocess.Popen[str]
    url: str
    metrics_url: str
    log: Path
    log_file: Any = None

    def output(self) -> str:
        return self.log.read_text()


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 60) -> RunningServer:
    """Start `qkv serve` with `args` (ports 0 unless given) and wait for its ready line."""
    cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1"]
    if "--grpc-port" not in args:
        cmd += ["--grpc-port", "0"]
    if "--metrics-port" not in args:
        cmd += ["--metrics-port", "0"]
    if "--model-repository" not in args:
        cmd += ["--model-repository", str(MODELS)]
    out = log.open("w")
    proc = subprocess.Popen(
        [*cmd, *args], stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**os.environ, **(env or {})}
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = READY.search(log.read_text())
        if m:
            return RunningServer(proc, f"127.0.0.1:{m.group(2)}", f"http://127.0.0.1:{m.group(4)}/metrics", log, out)
        if proc.poll() is not None:
            out.close()
            raise RuntimeError(f"qkv serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    out.close()
    raise RuntimeError(f"qkv serve not ready in {timeout} s:\n{log.read_text()}")


def stop_server(server: RunningServer, timeout: float = 30) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return -9
    finally:
        if server.log_file is not None:
            server.log_file.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One shared server on the shipped models."""
    s = start_server([], tmp_path_factory.mktemp("server") / "server.log")
    yield s
    stop_server(s)
