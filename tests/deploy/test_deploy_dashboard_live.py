"""The dashboard's queries and the rules against a real Prometheus.

A stand-in exporter publishes the metrics of docs/design.md, "Metrics" (names, types, labels) on a
loopback port picked by the OS; a real Prometheus scrapes it every second with
deploy/prometheus/rules.yml loaded. Every dashboard query must return data, and every rule must
evaluate without error.
(The end-to-end check with a real `qkv serve` lives with the service tests.)
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from deploy_helpers import GRAFANA, PROMETHEUS, SEQ_LEN_VALUES, module, tool

from tests.conftest import script_module

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def exporter() -> Iterator[int]:
    module("prometheus_client")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

    reg = CollectorRegistry()
    latency = Histogram(
        "qkv_request_duration_seconds",
        "request",
        ["model", "version", "seq_len"],
        registry=reg,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    )
    queue = Histogram("qkv_queue_duration_seconds", "queue", ["model", "version"], registry=reg)
    compute = Histogram("qkv_compute_duration_seconds", "compute", ["model", "version"], registry=reg)
    batch = Histogram("qkv_batch_size", "batch", ["model", "version"], registry=reg, buckets=(1, 2, 4, 8, 16, 32, 64))
    padding = Histogram(
        "qkv_batch_padding_ratio",
        "padding",
        ["model", "version"],
        registry=reg,
        buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
    )
    requests = Counter("qkv_requests", "requests", ["model", "version", "code"], registry=reg)
    inflight = Gauge("qkv_inflight_requests", "inflight", ["model", "version"], registry=reg)
    depth = Gauge("qkv_queue_depth", "queue depth", ["model", "version"], registry=reg)
    tokens = Counter("qkv_tokens", "tokens", ["model", "version", "direction"], registry=reg)
    info = Gauge("qkv_model_info", "model", ["model", "version", "provider"], registry=reg)
    http = Counter("qkv_http_requests", "http", ["model", "endpoint", "code"], registry=reg)
    steps = Counter("qkv_ensemble_steps", "steps", ["model", "version", "step", "step_model", "code"], registry=reg)
    step_time = Histogram(
        "qkv_ensemble_step_duration_seconds", "step", ["model", "version", "step", "step_model"], registry=reg
    )
    utilization = Gauge("qkv_utilization", "utilization", ["model", "version"], registry=reg)
    wait = Gauge("qkv_predicted_queue_wait_seconds", "predicted wait", ["model", "version"], registry=reg)
    for model in ("g2p", "g2p_encoder"):
        info.labels(model, "1", "CPUExecutionProvider").set(1)

    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    stop = threading.Event()

    def traffic() -> None:
        rnd = random.Random(0)
        while not stop.is_set():
            for model in ("g2p", "g2p_encoder"):
                for seq_len in SEQ_LEN_VALUES:
                    latency.labels(model, "1", seq_len).observe(rnd.uniform(0.001, 0.3))
                requests.labels(model, "1", "OK").inc(8)
                queue.labels(model, "1").observe(rnd.uniform(0.0, 0.01))
                compute.labels(model, "1").observe(rnd.uniform(0.001, 0.05))
                batch.labels(model, "1").observe(rnd.randint(1, 32))
                padding.labels(model, "1").observe(rnd.uniform(0, 0.6))
                tokens.labels(model, "1", "input").inc(40)
                tokens.labels(model, "1", "output").inc(50)
                inflight.labels(model, "1").set(rnd.randint(0, 4))
                depth.labels(model, "1").set(rnd.randint(0, 8))
                utilization.labels(model, "1").set(rnd.uniform(0, 1.2))
                wait.labels(model, "1").set(rnd.uniform(0, 0.2))
                http.labels(model, "infer", "200").inc(3)
                steps.labels("pipeline", "1", "0", model, "OK").inc(2)
                step_time.labels("pipeline", "1", "0", model).observe(rnd.uniform(0.001, 0.05))
            stop.wait(0.1)

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    yield int(server.server_port)
    stop.set()
    worker.join(5)
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def prometheus(exporter: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    shutil.copy(PROMETHEUS / "rules.yml", tmp / "rules.yml")
    (tmp / "prometheus.yml").write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": ["rules.yml"],
                "scrape_configs": [{"job_name": "qkv", "static_configs": [{"targets": [f"127.0.0.1:{exporter}"]}]}],
            }
        ),
        encoding="utf-8",
    )
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def api(base: str, path: str, **params: str) -> dict[str, Any]:
    url = f"{base}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return dict(json.load(r))
    except OSError as e:  # not listening yet, or a 4xx with the error in the body
        return {"status": "unreachable", "error": repr(e)}


def test_every_dashboard_query_returns_data(prometheus: str) -> None:
    dq = script_module(GRAFANA / "dashboard_queries.py", "dashboard_queries")
    pending = {expr: title for title, expr in dq.queries()}
    deadline = time.monotonic() + 60  # first scrape ~5 s after start, rate() needs two
    while pending and time.monotonic() < deadline:
        for expr in list(pending):
            r = api(prometheus, "query", query=expr)
            assert r["status"] != "error", (pending[expr], expr, r)
            if r["status"] == "success" and r["data"]["result"]:
                del pending[expr]
        time.sleep(0.5)
    assert not pending, f"queries without data after 60 s: {pending}"


def test_rules_load_and_evaluate_in_prometheus(prometheus: str) -> None:
    rules: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = api(prometheus, "rules")
        if r["status"] == "success":
            rules = {rule["name"]: rule for g in r["data"]["groups"] for rule in g["rules"]}
            if rules and all(rule["health"] != "unknown" for rule in rules.values()):
                break
        time.sleep(0.5)
    assert {"QkvHighErrorRatio", "QkvHighP99Latency", "QkvQueueSaturated", "QkvTargetDown"} <= set(rules), rules
    bad = {name: (rule["health"], rule.get("lastError")) for name, rule in rules.items() if rule["health"] != "ok"}
    assert not bad, bad
    # Healthy traffic: no alert is pending or firing.
    active = {
        name: rule["state"]
        for name, rule in rules.items()
        if rule["type"] == "alerting" and rule["state"] != "inactive"
    }
    assert not active, active
