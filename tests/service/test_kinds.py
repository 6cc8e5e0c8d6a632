"""Kinds from outside the server: a name an installed package registers in the entry point group qkv.kinds
(a dist-info directory on the path), and an import path; a kind that cannot be found refused at load,
naming config.json and its key, while the server serves on; a Python kind's wrong output failing only its
request. docs/kinds.md's own walk is run by tests/test_docs.py."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.errors import ConfigError
from service.models.catalog import ENTRY_POINTS, find_kind
from tests.conftest import RunningServer, start_server, stop_server

KINDS_MODULE = """
import numpy as np

from service.models.base import PythonModel


class Double(PythonModel):
    def compute(self, inputs):
        return {"y": inputs["x"] * 2}


class Wrong(PythonModel):
    def compute(self, inputs):
        return {"y": inputs["x"].astype(np.float64)}  # declared FP32
"""
DECLARED = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
}


def _package(path: Path) -> None:
    """`outside_kinds` installed in `path`: its module, and a dist-info registering Double as `doubling`."""
    (path / "outside_kinds.py").write_text(KINDS_MODULE)
    info = path / "outside_kinds-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-kinds\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINTS}]\ndoubling = outside_kinds:Double\n")


def _model(repo: Path, name: str, kind: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.json").write_text(json.dumps({"kind": kind, **DECLARED}))


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    root = tmp_path_factory.mktemp("kinds")
    _package(root)
    repo = root / "models"
    _model(repo, "registered", "doubling")
    _model(repo, "imported", "outside_kinds:Double")
    _model(repo, "wrong", "outside_kinds:Wrong")
    _model(repo, "missing", "no_such_package.kinds:Echo")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit"]
    for name in ("registered", "imported", "wrong"):
        args += ["--load-model", name]
    s = start_server(args, root / "server.log", env)
    yield s, repo
    stop_server(s)
    assert "Traceback" not in s.output()


def _post(s: RunningServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", f"{s.http_url}{path}", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    answer, status = done.stdout.rsplit("\n", 1)
    return int(status), json.loads(answer)


X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}]}


@pytest.mark.parametrize("name", ["registered", "imported"])
def test_a_kind_from_an_entry_point_or_an_import_path_serves(outside: tuple[RunningServer, Path], name: str) -> None:
    s, _ = outside
    status, answer = _post(s, f"/v2/models/{name}/infer", X)
    assert status == 200, answer
    assert answer["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [2, 3], "data": [2, 4, 6, 8, 10, 12]}]
    status, answer = _post(s, f"/v2/models/{name}/infer", {"inputs": [{**X["inputs"][0], "datatype": "INT32"}]})
    assert status == 400 and "datatype INT32" in answer["error"], answer


def test_a_wrong_output_fails_its_request_not_the_server(outside: tuple[RunningServer, Path]) -> None:
    s, _ = outside
    status, answer = _post(s, "/v2/models/wrong/infer", X)
    assert status == 500 and "computed output 'y' as FP64 [2, 3]; it declares FP32 [-1, 3]" in answer["error"]
    assert _post(s, "/v2/models/imported/infer", X)[0] == 200


def test_a_kind_that_cannot_be_found_is_refused_at_load_naming_the_file_and_key(
    outside: tuple[RunningServer, Path],
) -> None:
    s, _ = outside
    status, answer = _post(s, "/v2/repository/models/missing/load", {})
    assert status == 400, answer
    assert (
        "missing/config.json: kind 'no_such_package.kinds:Echo': cannot import 'no_such_package.kinds': No module named"
        in answer["error"]
    )
    assert _post(s, "/v2/models/registered/infer", X)[0] == 200


def test_find_kind_reads_the_entry_point_group_and_refuses_what_is_not_a_kind(tmp_path: Path) -> None:
    _package(tmp_path)
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        assert find_kind("doubling").build.__name__ == "Double"
        with pytest.raises(ConfigError) as e:
            find_kind("outside_kinds:KINDS_MODULE", tmp_path / "config.json")
    finally:
        sys.path.remove(str(tmp_path))
    assert e.value.key == "kind" and e.value.file == tmp_path / "config.json"
    assert "has no 'KINDS_MODULE'" in str(e.value)
