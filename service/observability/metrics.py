"""Prometheus metrics (docs/design.md, "Metrics"): every name, label and bucket in one place.

Buckets: request and queue latency span 0.25 ms to 10 s (sub-millisecond tensor calls to
multi-second overloaded g2p requests), compute 0.1 ms to 5 s; batch sizes are powers of two up to
the largest max_batch_size; padding ratio in tenths. The HTTP exporter runs on its own port, on the
server's event loop (service/observability/metrics_http.py).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:  # aiohttp is imported only when the port is served
    from service.observability.metrics_http import MetricsServer

__all__ = [
    "SEQ_LEN_BUCKETS",
    "UNKNOWN_MODEL",
    "GenerationObserver",
    "Metrics",
    "ModelObserver",
    "VersionSeries",
    "prompt_bucket",
    "seq_len_bucket",
]

SEQ_LEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512)
# Every label value comes from a fixed set: a model label names a model of the repository, and
# requests for any other name are counted under this one value (no series per name a client invents).
UNKNOWN_MODEL = "unknown"
LATENCY_BUCKETS = (
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.004,
    0.008,
    0.016,
    0.032,
    0.064,
    0.128,
    0.256,
    0.512,
    1.0,
    2.0,
    4.0,
    10.0,
)
COMPUTE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.004,
    0.008,
    0.016,
    0.032,
    0.064,
    0.128,
    0.256,
    0.512,
    1.0,
    2.0,
    5.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REQUEST_TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
PADDING_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
# Generation: a prompt's length, the label time per output token is split by (a long prompt's answer
# attends to more, and a chunked prefill shares its steps).
PROMPT_BUCKETS = (128, 512, 2048)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0)


def prompt_bucket(tokens: int) -> str:
    """The label of a prompt's length: '128', '512', '2048' (the smallest bound it is within) or 'inf'."""
    i = bisect.bisect_left(PROMPT_BUCKETS, tokens)
    return str(PROMPT_BUCKETS[i]) if i < len(PROMPT_BUCKETS) else "inf"


def seq_len_bucket(length: int) -> str:
    """The label of the smallest bucket upper bound >= length: '8', '16', ... '512', 'inf'; '' for a request
    with no length (0: a model without a sequence axis), which Prometheus reads as no label at all."""
    if length <= 0:
        return ""
    i = bisect.bisect_left(SEQ_LEN_BUCKETS, length)
    return str(SEQ_LEN_BUCKETS[i]) if i < len(SEQ_LEN_BUCKETS) else "inf"


class _Off:
    """Stands in for a metric when recording is off (to measure what recording costs)."""

    def labels(self, *_: object) -> _Off:
        return self

    def inc(self, *_: object) -> None: ...
    def dec(self, *_: object) -> None: ...
    def set(self, *_: object) -> None: ...
    def observe(self, *_: object) -> None: ...
    def set_function(self, *_: object) -> None: ...


class Metrics:
    """The server's metrics in a registry of their own (tests can run several servers)."""

    def __init__(self, enabled: bool = True) -> None:
        r = self.registry = CollectorRegistry()
        self._server: MetricsServer | None = None  # the /metrics port, once served
        self._serving: asyncio.Task[None] | None = None
        self.request_duration = Histogram(
            "qkv_request_duration_seconds",
            "Time from a request's arrival to its response",
            ["model", "version", "seq_len"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "qkv_queue_duration_seconds",
            "Time a request waited before its batch started",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_duration = Histogram(
            "qkv_compute_duration_seconds",
            "Time of one batch run (one decoding step for g2p)",
            ["model", "version"],
            buckets=COMPUTE_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "qkv_batch_size", "Rows per batch run", ["model", "version"], buckets=BATCH_BUCKETS, registry=r
        )
        self.padding_ratio = Histogram(
            "qkv_batch_padding_ratio",
            "Padded tokens / total tokens of a batch run",
            ["model", "version"],
            buckets=PADDING_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "qkv_requests", "Inference requests by final gRPC status", ["model", "version", "code"], registry=r
        )
        self.inflight = Gauge("qkv_inflight_requests", "Requests being handled", ["model", "version"], registry=r)
        self.queue_depth = Gauge(
            "qkv_queue_depth", "Requests waiting in the model's queue", ["model", "version"], registry=r
        )
        self.tokens = Counter("qkv_tokens", "Tokens in and out", ["model", "version", "direction"], registry=r)
        self.model_info = Gauge(
            "qkv_model_info", "Served models (value 1)", ["model", "version", "provider"], registry=r
        )
        self.batch_tokens = Counter(
            "qkv_batch_tokens", "Tokens computed in batches: real or padding", ["model", "version", "kind"], registry=r
        )
        self.dropped = Counter(
            "qkv_dropped_requests", "Requests dropped before compute", ["model", "version", "reason"], registry=r
        )
        self.failed_computations = Counter(
            "qkv_failed_computations",
            "Runs that failed in the runtime: a batch of several requests (retried in parts), or a request alone",
            ["model", "version", "scope"],
            registry=r,
        )
        # Apart from qkv_requests_total, which counts the inference requests of both protocols as before.
        self.http_requests = Counter(
            "qkv_http_requests",
            "HTTP/REST requests by endpoint and HTTP status",
            ["model", "endpoint", "code"],
            registry=r,
        )
        self.batching_setting = Gauge(
            "qkv_batching_setting",
            "A tensor model's batching setting in force (tuned from its measured cost, or from config.json)",
            ["model", "version", "setting"],
            registry=r,
        )
        # The response cache (one for the server, --cache-size): per model, as its entries come and go.
        self.cache_lookups = Counter(
            "qkv_cache_lookups", "Response cache lookups by result: hit or miss", ["model", "result"], registry=r
        )
        self.cache_insertions = Counter(
            "qkv_cache_insertions", "Answers kept by the response cache", ["model"], registry=r
        )
        self.cache_evictions = Counter(
            "qkv_cache_evictions", "Answers pushed out of the response cache to make room", ["model"], registry=r
        )
        self.cache_bytes = Gauge("qkv_cache_bytes", "Bytes the response cache holds, all models", registry=r)
        # An ensemble's steps (each is also a request to its step's model, counted there as any other).
        self.ensemble_steps = Counter(
            "qkv_ensemble_steps",
            "Steps of ensemble requests, by position, step model and gRPC status",
            ["model", "version", "step", "step_model", "code"],
            registry=r,
        )
        self.ensemble_step_duration = Histogram(
            "qkv_ensemble_step_duration_seconds",
            "Time of one ensemble step answered OK, from its request to its step model to the answer",
            ["model", "version", "step", "step_model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Stateful models (sequence batching): what their live sequences hold.
        self.live_sequences = Gauge(
            "qkv_live_sequences", "Sequences started and not yet ended or freed", ["model", "version"], registry=r
        )
        self.sequence_state_bytes = Gauge(
            "qkv_sequence_state_bytes", "Bytes of implicit state the live sequences hold", ["model", "version"],
            registry=r,
        )  # fmt: skip
        self.expired_sequences = Counter(
            "qkv_expired_sequences",
            "Sequences freed for idling past max_sequence_idle_microseconds",
            ["model", "version"],
            registry=r,
        )
        # Text models: what a request's texts read as (docs/text-models.md).
        self.request_tokens = Histogram(
            "qkv_request_tokens", "Tokens of one text model request, all its inputs, as the model ran them",
            ["model", "version"], buckets=REQUEST_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokenize_duration = Histogram(
            "qkv_tokenize_duration_seconds", "Time to tokenize one text model request", ["model", "version"],
            buckets=COMPUTE_BUCKETS, registry=r,
        )  # fmt: skip
        self.truncated_requests = Counter(
            "qkv_truncated_requests", "Text model requests with an input cut to the model's max_length",
            ["model", "version"], registry=r,
        )  # fmt: skip
        # The capacity signal (docs/operations.md, "Autoscaling"): read from each model's admission at a scrape.
        self.predicted_wait = Gauge(
            "qkv_predicted_queue_wait_seconds", "The queue wait the model predicts for a request arriving now",
            ["model", "version"], registry=r,
        )  # fmt: skip
        self.utilization = Gauge(
            "qkv_utilization", "Work admitted per second / work the model's batcher can do per second",
            ["model", "version"], registry=r,
        )  # fmt: skip
        self._capacity: dict[tuple[str, str], tuple[Callable[[], float], Callable[[], float]]] = {}
        self.server_utilization = Gauge(
            "qkv_server_utilization",
            "The sum of the models' utilization: the share of the server's compute its admitted work needs",
            registry=r,
        )
        self.server_predicted_wait = Gauge(
            "qkv_server_predicted_queue_wait_seconds", "The longest queue wait any model predicts", registry=r
        )
        self.server_utilization.set_function(lambda: sum(u() for _, u in list(self._capacity.values())))
        self.server_predicted_wait.set_function(
            lambda: max((w() for w, _ in list(self._capacity.values())), default=0.0)
        )
        # Generation models (docs/generation.md).
        self.time_to_first_token = Histogram(
            "qkv_generation_time_to_first_token_seconds", "From a generation request's arrival to its first token",
            ["model", "version"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            "qkv_generation_time_per_output_token_seconds",
            "A generation answer's time after its first token, per further token, by prompt length",
            ["model", "version", "prompt_tokens"], buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.generated_tokens = Counter(
            "qkv_generation_tokens", "Tokens a generation model read (prompt) and wrote (output)",
            ["model", "version", "kind"], registry=r,
        )  # fmt: skip
        self.running_sequences = Gauge(
            "qkv_generation_running_sequences", "Sequences in a generation model's running batch at its last step",
            ["model", "version"], registry=r,
        )  # fmt: skip
        self.kv_cache_bytes = Gauge(
            "qkv_generation_kv_cache_bytes", "Key/value cache the running sequences hold", ["model", "version"],
            registry=r,
        )  # fmt: skip
        self.kv_cache_budget = Gauge(
            "qkv_generation_kv_cache_budget_bytes", "Key/value cache the running sequences may reserve",
            ["model", "version"], registry=r,
        )  # fmt: skip
        self.generation_queue_wait = Histogram(
            "qkv_generation_queue_wait_seconds", "A generation request's wait before it joined the running batch",
            ["model", "version"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.generation_step = Histogram(
            "qkv_generation_step_seconds", "One decoding step of a generation model's running batch",
            ["model", "version"], buckets=COMPUTE_BUCKETS, registry=r,
        )  # fmt: skip
        # The series of one model version: they go when it is unloaded.
        self._per_version: list[Counter | Gauge | Histogram] = [
            self.request_duration, self.queue_duration, self.compute_duration, self.batch_size, self.padding_ratio,
            self.requests, self.inflight, self.queue_depth, self.tokens, self.model_info, self.batch_tokens,
            self.dropped, self.failed_computations, self.batching_setting, self.ensemble_steps,
            self.ensemble_step_duration, self.live_sequences, self.sequence_state_bytes, self.expired_sequences,
            self.request_tokens, self.tokenize_duration, self.truncated_requests, self.predicted_wait,
            self.utilization, self.time_to_first_token, self.time_per_output_token, self.generated_tokens,
            self.running_sequences, self.kv_cache_bytes, self.kv_cache_budget, self.generation_queue_wait,
            self.generation_step,
        ]  # fmt: skip
        if not enabled:
            self._per_version = []
            for name, value in list(vars(self).items()):
                if name != "registry" and hasattr(value, "labels"):
                    setattr(self, name, _Off())

    def serve(self, host: str, port: int, timeout: float = 30.0) -> int:
        """Serve /metrics on the running event loop; return the bound port (port 0 picks a free one). The port
        is bound and listening on return (OSError when it cannot be); `timeout`: seconds a connection may take
        to send its request's headers, or idle."""
        from service.observability.metrics_http import MetricsServer

        server = self._server = MetricsServer(self.registry, timeout)
        bound = server.bind(host, port)
        self._serving = asyncio.get_running_loop().create_task(server.start())
        return bound

    def observer(self, model: str, version: str) -> ModelObserver:
        return ModelObserver(self, model, version)

    def forget(self, model: str, version: str) -> None:
        """Drop every series of one model version (unloaded): series never outlive what they describe."""
        for metric in self._per_version:
            metric.remove_by_labels({"model": model, "version": version})
        self._capacity.pop((model, version), None)

    def capacity(
        self, model: str, version: str, wait_seconds: Callable[[], float], utilization: Callable[[], float]
    ) -> None:
        """Read one version's capacity signal at every scrape, and count it in the server's."""
        self._capacity[(model, version)] = (wait_seconds, utilization)
        self.predicted_wait.labels(model, version).set_function(wait_seconds)
        self.utilization.labels(model, version).set_function(utilization)

    def capacity_signal(self) -> dict[tuple[str, str], tuple[float, float]]:
        """Each (model, version)'s predicted queue wait and utilization now, as a scrape reads them (kept with
        metrics off too: ORCA's load reports read them)."""
        return {key: (wait(), utilization()) for key, (wait, utilization) in list(self._capacity.items())}


class CacheMetrics:
    """The response cache's observer: its lookups, insertions and evictions into the metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def looked_up(self, model: str, hit: bool, n: int = 1) -> None:
        self.metrics.cache_lookups.labels(model, "hit" if hit else "miss").inc(n)

    def inserted(self, model: str, size: int) -> None:
        self.metrics.cache_insertions.labels(model).inc()
        self.metrics.cache_bytes.inc(size)

    def evicted(self, model: str, size: int) -> None:
        self.metrics.cache_evictions.labels(model).inc()
        self.metrics.cache_bytes.dec(size)

    def dropped(self, size: int) -> None:
        self.metrics.cache_bytes.dec(size)


class VersionSeries:
    """The data plane's series of one model version, each labelled once: `labels()` takes a lock and a
    lookup every call, several times a request otherwise."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        self._metrics, self._model, self._version = metrics, model, version
        self.inflight = metrics.inflight.labels(model, version)
        self.tokens_in = metrics.tokens.labels(model, version, "input")
        self.tokens_out = metrics.tokens.labels(model, version, "output")
        self._requests: dict[str, Counter] = {}
        self._durations: dict[str, Histogram] = {}

    def requests(self, code: str) -> Counter:
        child = self._requests.get(code)
        if child is None:
            child = self._requests[code] = self._metrics.requests.labels(self._model, self._version, code)
        return child

    def duration(self, seq_len_bucket: str) -> Histogram:
        child = self._durations.get(seq_len_bucket)
        if child is None:
            child = self._metrics.request_duration.labels(self._model, self._version, seq_len_bucket)
            self._durations[seq_len_bucket] = child
        return child


class ModelObserver:
    """The batchers' `BatchObserver` (and the sequence batcher's `SequenceObserver`) for one model version,
    with its label children bound once (the sequence series only once a sequence starts)."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        labels = (model, version)
        self._metrics, self._labels = metrics, labels
        self._sequence_series: tuple[Gauge, Gauge] | None = None  # bound by the first `sequences`
        self._depth = metrics.queue_depth.labels(*labels)
        self._queue = metrics.queue_duration.labels(*labels)
        self._compute = metrics.compute_duration.labels(*labels)
        self._size = metrics.batch_size.labels(*labels)
        self._padding = metrics.padding_ratio.labels(*labels)
        self._dropped = {r: metrics.dropped.labels(*labels, r) for r in ("cancelled", "deadline")}
        self._real = metrics.batch_tokens.labels(*labels, "real")
        self._pad = metrics.batch_tokens.labels(*labels, "padding")

    def queue_depth(self, requests: int) -> None:
        self._depth.set(requests)

    def waited(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None:
        self._compute.observe(compute_seconds)
        self._size.observe(rows)
        if padded_tokens > 0:
            self._padding.observe(max(0.0, (padded_tokens - real_tokens) / padded_tokens))
            self._real.inc(real_tokens)
            self._pad.inc(max(0, padded_tokens - real_tokens))

    def dropped(self, reason: str) -> None:
        self._dropped[reason].inc()

    def capacity(self, wait_seconds: Callable[[], float], utilization: Callable[[], float]) -> None:
        self._metrics.capacity(*self._labels, wait_seconds, utilization)

    def computation_failed(self, scope: str) -> None:
        self._metrics.failed_computations.labels(*self._labels, scope).inc()

    def step(self, position: int, step_model: str, code: str, seconds: float) -> None:
        """One step of an ensemble request ended with `code` after `seconds`."""
        step = (*self._labels, str(position), step_model)
        self._metrics.ensemble_steps.labels(*step, code).inc()
        if code == "OK":
            self._metrics.ensemble_step_duration.labels(*step).observe(seconds)

    def sequences(self, live: int, state_bytes: int) -> None:
        if self._sequence_series is None:
            m = self._metrics
            self._sequence_series = (
                m.live_sequences.labels(*self._labels),
                m.sequence_state_bytes.labels(*self._labels),
            )
        self._sequence_series[0].set(live)
        self._sequence_series[1].set(state_bytes)

    def tokenized(self, tokens: int, seconds: float, truncated: bool) -> None:
        """A text model's request read: its tokens, the time its tokenizing took, whether an input was cut."""
        m = self._metrics
        m.request_tokens.labels(*self._labels).observe(tokens)
        m.tokenize_duration.labels(*self._labels).observe(seconds)
        if truncated:
            m.truncated_requests.labels(*self._labels).inc()

    def sequences_expired(self, count: int) -> None:
        self._metrics.expired_sequences.labels(*self._labels).inc(count)

    def generation(self, cache_budget: int) -> GenerationObserver:
        """The observer of a generation model's engine."""
        return GenerationObserver(self._metrics, *self._labels, cache_budget)


class GenerationObserver:
    """A generation engine's observer: steps, first tokens and answers into the generation series."""

    def __init__(self, metrics: Metrics, model: str, version: str, cache_budget: int) -> None:
        labels = (model, version)
        self._metrics, self._labels = metrics, labels
        self._first = metrics.time_to_first_token.labels(*labels)
        self._prompt = metrics.generated_tokens.labels(*labels, "prompt")
        self._output = metrics.generated_tokens.labels(*labels, "output")
        self._running = metrics.running_sequences.labels(*labels)
        self._cache = metrics.kv_cache_bytes.labels(*labels)
        self._wait = metrics.generation_queue_wait.labels(*labels)
        self._step = metrics.generation_step.labels(*labels)
        self._per_token = {b: metrics.time_per_output_token.labels(*labels, b)
                           for b in (*map(str, PROMPT_BUCKETS), "inf")}  # fmt: skip
        metrics.kv_cache_budget.labels(*labels).set(cache_budget)

    def step(self, running: int, tokens: int, cache_bytes: int, seconds: float) -> None:
        self._step.observe(seconds)

    def held(self, running: int, cache_bytes: int) -> None:
        """The running batch and its cache as they are now: after a step, and after sequences leave."""
        self._running.set(running)
        self._cache.set(cache_bytes)

    def first_token(self, seconds: float, queued: float) -> None:
        self._first.observe(seconds)
        self._wait.observe(queued)

    def answered(self, prompt_tokens: int, completion_tokens: int, seconds: float, first: float) -> None:
        """An answer ended: `seconds` from arrival, `first` of them to its first token."""
        self._prompt.inc(prompt_tokens)
        self._output.inc(completion_tokens)
        if completion_tokens > 1:
            self._per_token[prompt_bucket(prompt_tokens)].observe((seconds - first) / (completion_tokens - 1))
