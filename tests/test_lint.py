"""The house style, checked by the one test command: ruff (lint and format), strict mypy, and the layers
of service/ (import-linter's contracts in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy", "service", "export"],  # strict, from pyproject.toml
        ["lint-imports", "--no-cache"],  # a wrong import fails naming the contract and the import
    ],
    ids=["ruff-check", "ruff-format", "mypy", "layers"],
)
def test_the_code_passes(command: list[str]) -> None:
    done = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}{done.stderr}"
