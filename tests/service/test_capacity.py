"""The capacity signal (docs/operations.md, "Autoscaling"): each model's predicted queue wait and its
utilization (work admitted per second / work its batcher can do per second), and the server's, as
/metrics shows them. The estimates are decided on an injected clock; the server test reads a real scrape."""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g

from service import protocol
from service.frontends.orca import MIN_INTERVAL_S, Sample, report
from service.scheduling.admission import DEMAND_HORIZON_S, Admission, Demand
from service.scheduling.config import BatchingConfig
from tests.conftest import RunningServer
from tests.service.onnx_models import masked_encoder, serving


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steady(demand: Demand, clock: Clock, tokens_per_second: float, seconds: float, step: float = 0.1) -> None:
    for _ in range(round(seconds / step)):
        clock.now += step
        demand.add(round(tokens_per_second * step))


def test_demand_reads_a_steady_rate_and_follows_a_step_within_one_horizon() -> None:
    clock = Clock()
    demand = Demand(clock=clock)
    steady(demand, clock, 500, 6 * DEMAND_HORIZON_S)
    assert demand.per_second() == pytest.approx(500, rel=0.01)
    steady(demand, clock, 2000, DEMAND_HORIZON_S)  # a 4x load step
    assert demand.per_second() == pytest.approx(500 + 1500 * (1 - math.exp(-1)), rel=0.02)
    clock.now += 10 * DEMAND_HORIZON_S  # idle
    assert demand.per_second() < 1


def test_utilization_is_admitted_work_over_measured_throughput() -> None:
    clock = Clock()
    admission = Admission("m", BatchingConfig(), instances=2, clock=clock)
    assert admission.utilization() == 0 and admission.wait_seconds() == 0  # nothing measured yet
    admission.seed(tokens=1000, seconds=1.0)  # one instance: 1,000 tokens/s; two: 2,000
    for _ in range(int(6 * DEMAND_HORIZON_S * 10)):
        clock.now += 0.1
        admission.admit(150, None)  # 1,500 tokens/s
        admission.release(150)
    assert admission.utilization() == pytest.approx(0.75, rel=0.01)
    for _ in range(4):
        admission.admit(500, None)  # 2,000 tokens queued: a second's work
    assert admission.wait_seconds() == pytest.approx(1.0)


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        named = line.startswith(name) and line[len(name)] in "{ "  # not a longer name beginning so
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("capacity") / "models"
    masked_encoder(repo / "a")
    masked_encoder(repo / "b")
    yield from serving(repo, "--model-control-mode", "explicit", "--load-model", "a", "--load-model", "b")


def encoder_inputs() -> list[g.InferInput]:
    ids = np.array([[1, 2, 3, 4, 5, 6]], dtype=np.int64)
    inputs = [g.InferInput("ids", list(ids.shape), "INT64"), g.InferInput("attention_mask", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.ones_like(ids))
    return inputs


def scrape(server: RunningServer) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()


def test_the_server_exports_each_models_signal_and_their_sum(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    for _ in range(40):
        client.infer("a", encoder_inputs())
    text = scrape(server)
    a = sample(text, "qkv_utilization", model="a", version="1")
    b = sample(text, "qkv_utilization", model="b", version="1")
    total = sample(text, "qkv_server_utilization")
    assert a is not None and b is not None and total is not None
    assert a > 0 and b == 0  # a's admitted work shows; b had none
    assert total == pytest.approx(a, rel=0.05)  # read in the same scrape, a moment apart
    assert sample(text, "qkv_predicted_queue_wait_seconds", model="a", version="1") == 0  # nothing queued now
    assert sample(text, "qkv_server_predicted_queue_wait_seconds") == 0
    client.unload_model("b")
    deadline = time.monotonic() + 30
    while sample(scrape(server), "qkv_utilization", model="b", version="1") is not None:
        assert time.monotonic() < deadline, "b's series outlived its unload"
        time.sleep(0.1)


def load_reports(server: RunningServer, count: int, interval_s: float = 0.0) -> list[Any]:
    """`count` reports of ORCA's out-of-band stream, as gRPC's weighted round robin opens it."""
    with grpc.insecure_channel(server.url) as channel:
        stream = channel.unary_stream(
            f"/{protocol.ORCA_SERVICE_NAME}/StreamCoreMetrics",
            request_serializer=protocol.OrcaLoadReportRequest.SerializeToString,
            response_deserializer=protocol.OrcaLoadReport.FromString,
        )
        request = protocol.OrcaLoadReportRequest()
        request.report_interval.FromNanoseconds(int(interval_s * 1e9))
        call = stream(request, timeout=30)
        reports = [next(call) for _ in range(count)]
        call.cancel()
        return reports


def test_orca_reports_carry_the_same_signal_to_grpc_balancers(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    client.load_model("b")
    t0 = time.monotonic()
    first, second = load_reports(server, 2, interval_s=0.01)  # asks for 10 ms: gets MIN_INTERVAL_S
    assert time.monotonic() - t0 >= MIN_INTERVAL_S
    assert {"a/1", "b/1"} <= set(first.utilization)
    assert first.application_utilization == pytest.approx(sum(first.utilization.values()))
    assert first.named_metrics["queue_wait_seconds"] == 0  # nothing queued
    assert 0 < second.mem_utilization <= 1
    for _ in range(40):
        client.infer("a", encoder_inputs())
    (report,) = load_reports(server, 1)
    assert report.utilization["a/1"] > 0 and report.utilization["b/1"] == 0
    assert report.application_utilization == pytest.approx(report.utilization["a/1"], rel=0.05)
    assert "queue_wait_seconds/a/1" in report.named_metrics


def test_an_orca_report_sums_the_models_and_rates_the_interval() -> None:
    signal = {("a", "1"): (0.5, 1.7), ("b", "2"): (0.0, 0.2)}  # (predicted wait s, utilization)
    before, now = Sample(at=10.0, cpu=1.0, answered=10, failed=1), Sample(at=12.0, cpu=2.0, answered=30, failed=5)
    out = report(signal, before, now, cores=2, memory_share=0.3)
    assert out.application_utilization == pytest.approx(1.9)  # past 1: the queues grow
    assert dict(out.utilization) == pytest.approx({"a/1": 1.0, "b/2": 0.2})  # each capped at 1, the field's range
    assert out.named_metrics["queue_wait_seconds"] == 0.5 and out.named_metrics["queue_wait_seconds/b/2"] == 0
    assert (out.cpu_utilization, out.rps_fractional, out.eps) == pytest.approx((0.25, 10.0, 2.0))
    assert out.mem_utilization == pytest.approx(0.3)
