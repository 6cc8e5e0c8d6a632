"""One /metrics for all the workers: the supervisor scrapes each worker's private metrics port (loopback, port 0)
at every scrape of its own and answers with the samples combined.

Why scraping and not prometheus_client's multiprocess mode: that mode keeps every series in files of a shared
directory, and needs every Gauge to declare its combination at creation and no Gauge read by a callback
(`set_function`, which the capacity signal uses); it also keeps a dead worker's series until they are removed
by hand. Scraping keeps a worker's metrics exactly as a single server's, costs a scrape of each worker per
scrape (a few ms), and a worker that dies drops out of the sum at once (its counters restart from zero with it,
which Prometheus's rate() reads as a counter reset).

How samples combine, by series (name and labels): counters, histograms and summaries are summed (so are the
gauges that count something: requests in flight, queue depth, bytes); a version's predicted queue wait and
utilization are averaged over the workers that report them (each worker batches on its own); information
gauges (qkv_model_info, qkv_batching_setting) and creation times take one worker's value.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["WorkerMetrics", "combine"]

AVERAGED = ("qkv_predicted_queue_wait_seconds", "qkv_utilization", "qkv_server_utilization",
            "qkv_server_predicted_queue_wait_seconds")  # fmt: skip
ONE_OF = ("qkv_model_info", "qkv_batching_setting")
SCRAPE_TIMEOUT_S = 5.0


def _rule(family: str, sample: str) -> str:
    if sample.endswith("_created") or family in ONE_OF:
        return "one"
    return "mean" if family in AVERAGED else "sum"


def combine(texts: Iterable[str]) -> list[Metric]:
    """The families of several workers' scrapes (Prometheus text format), each series combined."""
    families: dict[str, Metric] = {}
    series: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                series[family.name] = {}
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                series[family.name].setdefault(key, []).append(sample.value)
    for name, metric in families.items():
        for (sample_name, labels), values in series[name].items():
            rule = _rule(name, sample_name)
            value = values[0] if rule == "one" else sum(values) / len(values) if rule == "mean" else sum(values)
            metric.add_sample(sample_name, dict(labels), value)
    return list(families.values())


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as answer:
            return str(answer.read().decode())
    except OSError:  # a worker restarting: left out of this scrape
        return None


class WorkerMetrics:
    """A prometheus_client collector: the workers' metrics, combined, read from the ports `ports()` names."""

    def __init__(self, ports: Callable[[], list[int]]) -> None:
        self.ports = ports
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="qkv-scrape")

    def collect(self) -> Iterator[Metric]:
        texts = [t for t in self._pool.map(_scrape, self.ports()) if t is not None]
        yield from combine(texts)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
