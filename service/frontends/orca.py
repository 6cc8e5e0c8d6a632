"""ORCA out-of-band load reports: the capacity signal for gRPC clients that balance on it.

gRPC's weighted round robin (gRFC A58) and other ORCA-aware balancers open
`xds.service.orca.v3.OpenRcaService/StreamCoreMetrics` on each backend and weigh it by its reports
(gRFC A51): `application_utilization` first, else `cpu_utilization`. A qkv report holds the number the
autoscaling manifests read (docs/operations.md, "Autoscaling"):

- `application_utilization`: the server's utilization, the sum over its models of the work admitted per
  second over the work their batchers can do per second (`qkv_server_utilization`); above 1 the queues grow;
- `utilization["MODEL/VERSION"]`: each model's share (capped at 1, as the field's range asks);
- `named_metrics["queue_wait_seconds"]` and `["queue_wait_seconds/MODEL/VERSION"]`: the predicted queue wait
  for a request arriving now (`qkv_server_predicted_queue_wait_seconds`, `qkv_predicted_queue_wait_seconds`);
- `cpu_utilization` (this process's CPU over the interval, per core it may run on), `mem_utilization`
  (its resident memory over the memory it may use), `rps_fractional` and `eps` (answers and failures a
  second over the interval).

Reports come at the interval the client asks for, and no more often than `MIN_INTERVAL_S`; the stream ends
when the server drains, so that it never holds a shutdown.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service import protocol
from service.observability.metrics import Metrics
from service.serving.dataplane import DataPlane

__all__ = ["MIN_INTERVAL_S", "LoadReports", "Sample", "report"]

MIN_INTERVAL_S = 1.0  # a client asking for less gets this (the reports are computed, not free)
DRAIN_POLL_S = 0.25  # how soon a stream notices the server draining


@dataclass(frozen=True)
class Sample:
    """The process's counters at one moment, for the rates of the next report."""

    at: float  # monotonic seconds
    cpu: float  # process CPU seconds
    answered: int
    failed: int


def _memory_limit() -> int:
    """The bytes this process may use: its cgroup's limit where one is set, else the machine's memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak, which is what getrusage gives
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LoadReports:
    """The servicer of `OpenRcaService` over one data plane and the capacity signal its models feed `metrics`."""

    def __init__(self, plane: DataPlane, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.plane, self.metrics, self.clock = plane, metrics, clock
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.memory = _memory_limit()

    def sample(self) -> Sample:
        answered = failed = 0
        for model in self.plane.statistics():
            stats = model.stats
            answered, failed = answered + stats.success_count, failed + stats.fail_count
        return Sample(self.clock(), time.process_time(), answered, failed)

    def report(self, before: Sample, now: Sample) -> protocol.OrcaLoadReport:
        """The load report for the interval from `before` to `now`."""
        return report(self.metrics.capacity_signal(), before, now, self.cores, _resident_bytes() / self.memory)

    async def StreamCoreMetrics(self, request: protocol.OrcaLoadReportRequest, context: Any) -> None:
        asked = request.report_interval.seconds + request.report_interval.nanos / 1e9
        interval = max(asked, MIN_INTERVAL_S)
        before = self.sample()
        await context.write(self.report(before, before))  # at once: a balancer weighs a new backend early
        while not self.plane.draining:
            due = self.clock() + interval
            while not self.plane.draining and self.clock() < due:
                await asyncio.sleep(min(DRAIN_POLL_S, max(due - self.clock(), 0.0)))
            if self.plane.draining:
                break
            now = self.sample()
            await context.write(self.report(before, now))
            before = now


def report(
    signal: dict[tuple[str, str], tuple[float, float]], before: Sample, now: Sample, cores: int, memory_share: float
) -> protocol.OrcaLoadReport:
    """An `OrcaLoadReport` of each model version's (predicted wait, utilization) in `signal`, with the rates
    over `before` to `now`."""
    out = protocol.OrcaLoadReport()
    total, longest = 0.0, 0.0
    for (name, version), (wait, utilization) in signal.items():
        key = f"{name}/{version}"
        out.utilization[key] = min(utilization, 1.0)
        out.named_metrics[f"queue_wait_seconds/{key}"] = wait
        total, longest = total + utilization, max(longest, wait)
    out.application_utilization = total
    out.named_metrics["queue_wait_seconds"] = longest
    seconds = now.at - before.at
    if seconds > 0:
        out.cpu_utilization = max(now.cpu - before.cpu, 0.0) / seconds / cores
        out.rps_fractional = max(now.answered - before.answered, 0) / seconds
        out.eps = max(now.failed - before.failed, 0) / seconds
    out.mem_utilization = min(max(memory_share, 0.0), 1.0)
    return out
