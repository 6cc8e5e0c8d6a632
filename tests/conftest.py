"""Shared fixtures: a real `qkv serve` process on loopback (port 0), and the shipped repository."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from service.tools.process import ServerProcess, stop_server
from service.tools.process import start_server as _start

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
RunningServer = ServerProcess

__all__ = ["MODELS", "ROOT", "RunningServer", "scale_model", "script_module", "start_server", "stop_server"]


def script_module(path: Path, name: str) -> ModuleType:
    """The repository's script at `path` (a file to run, in no package), imported as module `name`; registered
    in sys.modules, where dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its figures to the controller, which prints the summary."""
    from tests.figures import FIGURES

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["figures"] = json.dumps(FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the controller: a worker's figures join the run's."""
    from tests.figures import FIGURES

    for section, figures in json.loads(getattr(node, "workeroutput", {}).get("figures", "{}")).items():
        FIGURES.setdefault(section, {}).update(figures)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.figures import FIGURES

    for section, figures in FIGURES.items():
        if figures:
            terminalreporter.section(section)
            for name, value in figures.items():
                terminalreporter.write_line(f"{name}: {value}")


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 180) -> ServerProcess:
    """`qkv serve` on the shipped models unless `args` names another repository. The wait for readiness is
    generous, a bound and not a speed: a start times its models' runs, which take several times as long with
    every core busy (`make test-loaded`); a server that exits fails at once."""
    if "--model-repository" not in args:
        args = ["--model-repository", str(MODELS), *args]
    return _start(args, log, env, timeout, cwd=ROOT)


def scale_model(directory: Path) -> None:
    """A user's model for the tests. `scale`: y = x * [1, 2, 3], x FP32 [batch, 3]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "scale", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One shared server on the shipped models."""
    s = start_server([], tmp_path_factory.mktemp("server") / "server.log")
    yield s
    stop_server(s)
