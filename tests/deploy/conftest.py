"""Fixtures for the deploy/ tests: the rendered Kubernetes overlays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import K8S, OVERLAYS, load_yaml_all, ok, run, tool


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    """overlay name -> (file with `kubectl kustomize` output, its documents)."""
    kubectl = tool("kubectl")
    out: dict[str, tuple[Path, list[dict[str, Any]]]] = {}
    tmp = tmp_path_factory.mktemp("k8s")
    for overlay in OVERLAYS:
        proc = run([kubectl, "kustomize", str(K8S / "overlays" / overlay)])
        ok(proc)
        path = tmp / f"{overlay}.yaml"
        path.write_text(proc.stdout, encoding="utf-8")
        out[overlay] = (path, load_yaml_all(proc.stdout))
    return out
