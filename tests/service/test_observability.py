"""Metrics end to end: a real qkv, a real Prometheus scraping it, the Grafana dashboard's queries.

Prometheus (Debian's package; `make test` installs it) scrapes the server every second with
deploy/prometheus/rules.yml loaded, while a background load of mixed sequence lengths runs.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from service import protocol
from service.observability.metrics import seq_len_bucket
from service.tools.bench.servers import variant
from service.tools.client import g2p_request
from service.tools.loadgen import encoder_request
from tests.conftest import MODELS, ROOT, RunningServer, start_server, stop_server

sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
from dashboard_queries import queries

LENGTHS = (3, 12, 30, 60, 120, 250, 500)  # one per seq_len bucket 8 .. 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


PIPELINE = "g2p_pipeline"
PIPELINE_CONFIG = {
    "kind": "ensemble",
    "max_batch_size": 0,
    "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "PHONEMES", "datatype": "BYTES", "shape": [-1]}],
    "ensemble_scheduling": {
        "step": [{"model_name": "g2p", "input_map": {"TEXT": "TEXT"}, "output_map": {"PHONEMES": "PHONEMES"}}]
    },
}


class Load:
    """Requests of every length bucket plus a few bad ones, until stopped; counts what it sent."""

    def __init__(self, url: str, http_url: str) -> None:
        self.url, self.http_url, self.stop = url, http_url, threading.Event()
        self.sent = {"ok": 0, "invalid": 0, "tokens": 0, "ensemble": 0}
        self.by_length = dict.fromkeys(LENGTHS, 0)  # encoder requests answered, by length
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        rng = np.random.default_rng(0)
        with grpc.insecure_channel(self.url) as ch:
            stub = protocol.Stub(ch)
            while not self.stop.is_set():
                for n in LENGTHS:
                    stub.ModelInfer(encoder_request(n, 33, rng), timeout=30)
                    self.sent["ok"] += 1
                    self.sent["tokens"] += n
                    self.by_length[n] += 1
                stub.ModelInfer(g2p_request(["hello", "world"]), timeout=30)
                stub.ModelInfer(g2p_request(["pipeline"], model=PIPELINE), timeout=30)  # an ensemble's one step
                self.sent["ensemble"] += 1
                try:
                    stub.ModelInfer(g2p_request(["h\x07llo"]), timeout=30)  # a control character: refused
                except grpc.RpcError:
                    self.sent["invalid"] += 1
                # and over HTTP, a readiness probe (counted in qkv_http_requests_total, not as inference)
                urllib.request.urlopen(f"http://{self.http_url}/v2/models/g2p/ready", timeout=30).close()
                time.sleep(0.02)

    def pause(self) -> None:
        """Stop sending and wait for the last answer: the server's counters then hold still."""
        self.stop.set()
        self.thread.join()

    def resume(self) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, str, Load]]:
    if not shutil.which("prometheus"):
        pytest.fail("prometheus is not installed: apt-get install prometheus (make test does)")
    tmp = tmp_path_factory.mktemp("prom")
    repo = variant(MODELS, tmp / "models", {})
    (repo / PIPELINE / "1").mkdir(parents=True)  # the shipped models and an ensemble of g2p, for its metrics
    (repo / PIPELINE / "config.json").write_text(json.dumps(PIPELINE_CONFIG))
    server = start_server(["--model-repository", str(repo)], tmp / "server.log")
    port = free_port()
    metrics = server.metrics_url.removeprefix("http://").removesuffix("/metrics")
    shutil.copy(ROOT / "deploy" / "prometheus" / "rules.yml", tmp / "rules.yml")
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\nrule_files: [rules.yml]\n"
        f"scrape_configs:\n  - job_name: qkv\n    static_configs: [{{targets: ['{metrics}']}}]\n"
    )
    prom_log = (tmp / "prom.log").open("w")
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=prom_log,
    )
    load = Load(server.url, server.http_url)
    try:
        with load:
            yield server, f"http://127.0.0.1:{port}", load
    finally:
        prom.terminate()
        prom.wait(10)
        prom_log.close()
        stop_server(server)


def query(base: str, expr: str, need: int = 1, timeout: float = 60.0) -> list[dict]:  # type: ignore[type-arg]
    """Poll Prometheus until `expr` has at least `need` series (its first data takes ~5 s)."""
    deadline, result = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            r = json.load(
                urllib.request.urlopen(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5)
            )
            result = [x for x in r["data"]["result"] if x["value"][1] not in ("NaN", "+Inf", "-Inf")]
            if len(result) >= need:
                return result
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    return result


def test_latency_by_sequence_length_in_prometheus(stack: tuple[RunningServer, str, Load]) -> None:
    _, base, load = stack
    buckets = {seq_len_bucket(n) for n in LENGTHS}
    expr = (
        "histogram_quantile(0.5, sum by (le, seq_len) "
        '(rate(qkv_request_duration_seconds_bucket{model="g2p_encoder"}[30s])))'
    )
    result = query(base, expr, need=len(buckets))
    p50 = {r["metric"]["seq_len"]: float(r["value"][1]) for r in result}
    assert set(p50) == buckets and all(v > 0 for v in p50.values()), p50  # a latency for each length
    # Each length's requests land in its own series: every one has some, and none more than the load sent
    # of that length (its counts are read after Prometheus's; one more may be answered but not yet counted).
    counted = query(base, 'sum by (seq_len) (qkv_request_duration_seconds_count{model="g2p_encoder"})', len(buckets))
    sent = dict(load.by_length)
    by_bucket = {r["metric"]["seq_len"]: float(r["value"][1]) for r in counted}
    assert set(by_bucket) == buckets, by_bucket
    for n in LENGTHS:
        assert 0 < by_bucket[seq_len_bucket(n)] <= sent[n] + 1, (n, by_bucket, sent)


def test_every_dashboard_query_returns_data(stack: tuple[RunningServer, str, Load]) -> None:
    _, base, _ = stack
    exprs = queries(ROOT / "deploy" / "grafana" / "dashboards" / "qkv.json")
    assert len(exprs) >= 15
    empty = [(title, expr) for title, expr in exprs if not query(base, expr, timeout=60)]
    assert not empty, empty


def test_rules_load_and_evaluate(stack: tuple[RunningServer, str, Load]) -> None:
    _, base, _ = stack
    deadline, rules = time.monotonic() + 60, []  # rules are evaluated every second once Prometheus is up
    while time.monotonic() < deadline:
        try:
            groups = json.load(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=30))["data"]["groups"]
        except OSError:
            groups = []  # not listening yet
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules):
            break
        time.sleep(0.5)
    assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    up = query(base, 'up{job="qkv"}')
    assert up and up[0]["value"][1] == "1"


def test_counters_match_what_the_client_sent(stack: tuple[RunningServer, str, Load]) -> None:
    server, _, load = stack
    load.pause()  # the other tests, in any order, still find the load running
    try:
        text, sent = scrape(server.metrics_url), dict(load.sent)
    finally:
        load.resume()
    assert sample(text, "qkv_requests_total", model="g2p_encoder", code="OK") == sent["ok"]
    assert sample(text, "qkv_requests_total", model="g2p", code="INVALID_ARGUMENT") == sent["invalid"]
    assert sample(text, "qkv_tokens_total", model="g2p_encoder", direction="input") == sent["tokens"]
    assert sample(text, "qkv_request_duration_seconds_count", model="g2p_encoder") == sent["ok"]
    assert sample(text, "qkv_inflight_requests", model="g2p_encoder") == 0
    assert sample(text, "qkv_requests_total", model=PIPELINE, code="OK") == sent["ensemble"]
    assert (
        sample(text, "qkv_ensemble_steps_total", model=PIPELINE, step="0", step_model="g2p", code="OK")
        == sent["ensemble"]
    )
    assert re.search(r'qkv_model_info\{model="g2p",provider="CPUExecutionProvider",version="1"\} 1.0', text)
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
