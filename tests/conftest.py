"""Shared fixtures: a real `qkv serve` process on loopback (port 0), and the shipped repository."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.process import ServerProcess, stop_server
from service.process import start_server as _start

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
RunningServer = ServerProcess

__all__ = ["MODELS", "ROOT", "RunningServer", "start_server", "stop_server"]


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 60) -> ServerProcess:
    """`qkv serve` on the shipped models unless `args` names another repository."""
    if "--model-repository" not in args:
        args = ["--model-repository", str(MODELS), *args]
    return _start(args, log, env, timeout, cwd=ROOT)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One shared server on the shipped models."""
    s = start_server([], tmp_path_factory.mktemp("server") / "server.log")
    yield s
    stop_server(s)
