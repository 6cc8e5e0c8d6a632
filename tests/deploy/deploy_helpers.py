"""Helpers for the deploy/ tests: paths, the contract's metric names, and external tools.

A missing tool fails the test with the command that installs it (CI installs them all);
nothing here skips.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
DOCKER = DEPLOY / "docker"
COMPOSE = ROOT / "docker-compose.yml"
SIMULATION = DEPLOY / "compose"  # the autoscaling simulation: an overlay on COMPOSE and its scripts
OVERLAYS = ("cpu", "gpu", "cpu-tracing", "cpu-poll", "cpu-keda", "gpu-keda")
KEDA_OVERLAYS = ("cpu-keda", "gpu-keda")  # a ScaledObject in place of the HorizontalPodAutoscaler

# This test run's id: what it makes on a Docker engine is named after it (containers labelled
# org.qkv.test.run=ID, compose projects qkvtIDp<pid>, images qkv:testIDp<pid>), so that its cleanup
# (tests/deploy/docker_engine.sh, which sets it, or the fixtures' own) removes those and nothing of
# another run's. Lowercase hexadecimal: a compose project name and an image tag take it, and it has no "p".
TEST_RUN = os.environ.get("QKV_TEST_RUN") or secrets.token_hex(6)
RUN_LABEL = f"org.qkv.test.run={TEST_RUN}"


def run_name(prefix: str) -> str:
    """A name of this run's, for this process: PREFIX, the run id, p, the pid."""
    return f"{prefix}{TEST_RUN}p{os.getpid()}"


# docs/design.md, "Metrics": name -> type. Prometheus exposes histograms as _bucket/_sum/_count
# and counters with _total (prometheus_client adds _created beside them).
METRICS = {
    "qkv_request_duration_seconds": "histogram",
    "qkv_queue_duration_seconds": "histogram",
    "qkv_compute_duration_seconds": "histogram",
    "qkv_batch_size": "histogram",
    "qkv_batch_padding_ratio": "histogram",
    "qkv_requests": "counter",
    "qkv_inflight_requests": "gauge",
    "qkv_queue_depth": "gauge",
    "qkv_tokens": "counter",
    "qkv_model_info": "gauge",
    "qkv_http_requests": "counter",
    "qkv_ensemble_steps": "counter",
    "qkv_ensemble_step_duration_seconds": "histogram",
    "qkv_live_sequences": "gauge",
    "qkv_sequence_state_bytes": "gauge",
    "qkv_expired_sequences": "counter",
    "qkv_predicted_queue_wait_seconds": "gauge",
    "qkv_utilization": "gauge",
    "qkv_generation_time_to_first_token_seconds": "histogram",
    "qkv_generation_time_per_output_token_seconds": "histogram",
    "qkv_generation_tokens": "counter",
    "qkv_generation_running_sequences": "gauge",
    "qkv_generation_kv_cache_bytes": "gauge",
    "qkv_generation_kv_cache_budget_bytes": "gauge",
    "qkv_generation_queue_wait_seconds": "histogram",
}
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
EXPOSED = {name + suffix: name for name, kind in METRICS.items() for suffix in SUFFIXES[kind]}
SEQ_LEN_VALUES = ("8", "16", "32", "64", "128", "256", "512", "inf")

APT = "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y"
INSTALL = {
    "kubectl": "kubectl with kustomize (kubectl kustomize); Debian's kubernetes-client 1.20 is too old",
    "promtool": f"{APT} prometheus   (then make sure no packaged prometheus holds :9090)",
    "prometheus": f"{APT} prometheus   (then make sure no packaged prometheus holds :9090)",
    "docker-compose": f"{APT} --no-install-recommends docker-compose",
    "git": f"{APT} git",
    "bash": f"{APT} bash",
}
PIP = {
    "kubernetes_validate": "kubernetes-validate",
    "cloudcoil.models.prometheus_operator": "cloudcoil-models-prometheus-operator",
    "check_jsonschema": "check-jsonschema",
    "promql_parser": "promql-parser",
    "prometheus_client": "prometheus-client",
}


def tool(name: str) -> str:
    """Path of an executable, or fail saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; install it with: {INSTALL.get(name, name)}", pytrace=False)
    return path


def module(name: str) -> None:
    """Fail unless a Python module is importable by this interpreter."""
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.fail(
            f"Python module {name} is missing; install it with: {sys.executable} -m pip install {PIP[name]}",
            pytrace=False,
        )


def compose_script(name: str) -> ModuleType:
    """deploy/compose/NAME.py, imported: the simulation's scripts are files to run, not a package."""
    return script_module(SIMULATION / f"{name}.py", f"qkv_compose_{name}")


def run(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    timeout: float = 120,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        check=False,
    )


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_yaml_all(text: str) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def metric_names(expr: str) -> set[str]:
    """Names of every vector selector in a PromQL expression (parsed, not grepped)."""
    module("promql_parser")
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def grouping_labels(expr: str) -> list[list[str]]:
    """The `by (...)` label lists of every aggregation in an expression."""
    module("promql_parser")
    import promql_parser

    groups: list[list[str]] = []

    def visit(node: Any) -> None:
        modifier = getattr(node, "modifier", None) if isinstance(node, promql_parser.AggregateExpr) else None
        if modifier is not None and str(modifier.type).endswith("By"):
            groups.append(list(modifier.labels))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return groups


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (op, value)}) of every vector selector."""
    module("promql_parser")
    import promql_parser

    out: list[tuple[str, dict[str, tuple[str, str]]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {m.name: (str(m.op), m.value) for m in node.matchers.matchers}
            out.append((node.name, matchers))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return out
