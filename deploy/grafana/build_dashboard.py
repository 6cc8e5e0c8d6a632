"""Build the qkv Grafana dashboard: ``deploy/grafana/dashboards/qkv.json``.

The JSON is generated, not hand-edited: change this file, then run

    python deploy/grafana/build_dashboard.py          # rewrites qkv.json
    python deploy/grafana/build_dashboard.py --check  # exit 1 if qkv.json is stale

Plain Python on purpose (no Grafana SDK needed to rebuild). Every query uses only the metrics
of docs/design.md, "Metrics", and the dashboard variables ``$datasource``, ``$model``,
``$instance``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["OUTPUT", "build", "render"]

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "qkv.json"

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model=~"$model",instance=~"$instance"'
RI = "$__rate_interval"

Panel = dict[str, Any]


def _rate(metric: str, by: str, extra: str = "") -> str:
    sel = SEL + ("," + extra if extra else "")
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{RI}]))"


def _quantile(q: float, histogram: str, by: str, extra: str = "") -> str:
    return f"histogram_quantile({q}, {_rate(histogram + '_bucket', 'le, ' + by, extra)})"


# The requests that have a length: a model without a sequence axis leaves seq_len empty (docs/design.md, "Metrics").
HAS_LENGTH = 'seq_len!=""'


def _mean(histogram: str, by: str) -> str:
    return f"{_rate(histogram + '_sum', by)} / {_rate(histogram + '_count', by)}"


def _or_zero(expr: str) -> str:
    """`expr`, or a single 0 when it has no series (a metric only some models have, none of them serving)."""
    return f"{expr} or on() vector(0)"


def _target(
    expr: str, legend: str, ref: str, fmt: str = "time_series", instant: bool = False, exemplar: bool = False
) -> dict[str, Any]:
    return {
        "datasource": DS,
        "editorMode": "code",
        "exemplar": exemplar,
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "legendFormat": legend,
        "range": not instant,
        "refId": ref,
    }


def _targets(*pairs: tuple[str, str], **kw: Any) -> list[dict[str, Any]]:
    return [_target(expr, legend, chr(ord("A") + i), **kw) for i, (expr, legend) in enumerate(pairs)]


def _timeseries(title: str, description: str, unit: str, targets: list[dict[str, Any]], **custom: Any) -> Panel:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "min": 0,
                "color": {"mode": "palette-classic"},
                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never", **custom},
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["mean", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def _heatmap(title: str, description: str, targets: list[dict[str, Any]], y_unit: str, cell_unit: str) -> Panel:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "cellValues": {"unit": cell_unit},
            "color": {"mode": "scheme", "scheme": "Spectral", "scale": "exponential", "exponent": 0.5, "steps": 64},
            "rowsFrame": {"layout": "auto"},
            "showValue": "never",
            "tooltip": {"mode": "single", "showColorScale": True, "yHistogram": False},
            "yAxis": {"axisPlacement": "left", "unit": y_unit, "reverse": False},
            "legend": {"show": True},
        },
        "targets": targets,
    }


def _row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def _layout() -> list[tuple[Panel, int, int]]:
    """(panel, width, height) in reading order; rows take the full width."""
    latency_by_len = _quantile(0.95, "qkv_request_duration_seconds", "seq_len", HAS_LENGTH)
    requests, errors = _rate("qkv_requests_total", "model"), _rate("qkv_requests_total", "model", 'code!="OK"')
    errors_by_code = (
        _rate("qkv_requests_total", "model, code", 'code!="OK"')
        + f' or on (model) label_replace({requests} * 0, "code", "none", "", "")'
    )
    error_ratio = f"({errors} or on (model) {requests} * 0) / {requests}"
    return [
        (_row("Traffic and errors"), 24, 1),
        (
            _timeseries(
                "Request rate by model and code",
                "Answered requests per second, by model and gRPC status code (qkv_requests_total).",
                "reqps",
                _targets((_rate("qkv_requests_total", "model, code"), "{{model}} {{code}}")),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "Error rate by model and code",
                "Non-OK answers per second by gRPC status (a zero line per model while there are none).",
                "reqps",
                _targets((errors_by_code, "{{model}} {{code}}")),
            ),
            6,
            8,
        ),
        (
            _timeseries(
                "Error ratio by model",
                "Share of requests answered with a non-OK status (alert QkvHighErrorRatio at 5 %).",
                "percentunit",
                _targets((error_ratio, "{{model}}")),
            ),
            6,
            8,
        ),
        (
            _timeseries(
                "Requests per instance",
                "Requests per second on each server: uneven lines mean long-lived gRPC connections are "
                "not spread (see max connection age and client-side round_robin in deploy/README.md).",
                "reqps",
                _targets((_rate("qkv_requests_total", "instance"), "{{instance}}")),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "Tokens per second",
                "Input tokens read and output tokens produced per second (qkv_tokens_total).",
                "short",
                _targets((_rate("qkv_tokens_total", "model, direction"), "{{model}} {{direction}}")),
            ),
            12,
            8,
        ),
        (_row("Latency"), 24, 1),
        (
            _timeseries(
                "Request latency p50 / p95 / p99",
                "End-to-end request latency in the server (queue + compute), all sequence lengths. With "
                "tracing on, the dots are exemplars: one traced request each, linked to its trace.",
                "s",
                _targets(
                    (_quantile(0.5, "qkv_request_duration_seconds", "model"), "p50 {{model}}"),
                    (_quantile(0.95, "qkv_request_duration_seconds", "model"), "p95 {{model}}"),
                    (_quantile(0.99, "qkv_request_duration_seconds", "model"), "p99 {{model}}"),
                    exemplar=True,
                ),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "p95 latency by sequence length",
                "p95 request latency per seq_len bucket (longest input, in tokens, up to 8, 16, ... 512, inf). "
                "Models without a sequence axis have no seq_len and are left out.",
                "s",
                _targets((latency_by_len, "seq_len ≤ {{seq_len}}")),
            ),
            12,
            8,
        ),
        (
            _heatmap(
                "p95 latency per sequence length (heatmap)",
                "One row per seq_len bucket; the colour is that bucket's p95 latency.",
                _targets((latency_by_len, "{{seq_len}}")),
                y_unit="short",
                cell_unit="s",
            ),
            12,
            8,
        ),
        (
            _heatmap(
                "Latency distribution (heatmap)",
                "Requests per latency bucket over time (qkv_request_duration_seconds_bucket).",
                _targets(
                    (
                        f"sum by (le) (increase(qkv_request_duration_seconds_bucket{{{SEL}}}[{RI}]))",
                        "{{le}}",
                    ),
                    fmt="heatmap",
                ),
                y_unit="s",
                cell_unit="short",
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "Request rate by sequence length",
                "Traffic mix over the seq_len buckets, to read the latency panels against (requests of models "
                "without a sequence axis, which have no seq_len, left out).",
                "reqps",
                _targets((_rate("qkv_request_duration_seconds_count", "seq_len", HAS_LENGTH), "seq_len ≤ {{seq_len}}")),
                stacking={"mode": "normal", "group": "A"},
            ),
            24,
            8,
        ),
        (_row("Batching and queue"), 24, 1),
        (
            _timeseries(
                "Queue time vs compute time",
                "Time a request waits for a batch (qkv_queue_duration_seconds) against the time a batch "
                "runs (qkv_compute_duration_seconds, one observation per batch).",
                "s",
                _targets(
                    (_quantile(0.95, "qkv_queue_duration_seconds", "model"), "queue p95 {{model}}"),
                    (_quantile(0.95, "qkv_compute_duration_seconds", "model"), "compute p95 {{model}}"),
                    (_mean("qkv_queue_duration_seconds", "model"), "queue mean {{model}}"),
                    (_mean("qkv_compute_duration_seconds", "model"), "compute mean {{model}}"),
                ),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "In-flight requests and queue depth",
                "Requests being served and requests waiting for a batch, summed over the instances.",
                "short",
                _targets(
                    (f"sum by (model) (qkv_inflight_requests{{{SEL}}})", "in flight {{model}}"),
                    (f"sum by (model) (qkv_queue_depth{{{SEL}}})", "queued {{model}}"),
                ),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "Batch size",
                "Requests per batch run (qkv_batch_size).",
                "short",
                _targets(
                    (_mean("qkv_batch_size", "model"), "mean {{model}}"),
                    (_quantile(0.95, "qkv_batch_size", "model"), "p95 {{model}}"),
                ),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "Batch padding ratio",
                "Padded / total tokens per batch (qkv_batch_padding_ratio): the compute spent on padding.",
                "percentunit",
                _targets(
                    (_mean("qkv_batch_padding_ratio", "model"), "mean {{model}}"),
                    (_quantile(0.95, "qkv_batch_padding_ratio", "model"), "p95 {{model}}"),
                ),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "Ensemble steps",
                "Steps of ensemble requests per second by position, step model and status "
                "(qkv_ensemble_steps_total), and each step's p95 time (qkv_ensemble_step_duration_seconds).",
                "short",
                _targets(
                    (
                        _rate("qkv_ensemble_steps_total", "model, step, step_model, code"),
                        "{{model}} step {{step}} ({{step_model}}) {{code}}",
                    ),
                    (
                        _quantile(0.95, "qkv_ensemble_step_duration_seconds", "model, step, step_model"),
                        "p95 s {{model}} step {{step}} ({{step_model}})",
                    ),
                ),
            ),
            24,
            8,
        ),
        (_row("Sequences"), 24, 1),
        (
            _timeseries(
                "Live sequences",
                "Stateful models' sequences started and not yet ended or freed (qkv_live_sequences); 0 when "
                "no stateful model has started one. Abandoned sequences leave within "
                "max_sequence_idle_microseconds.",
                "short",
                _targets((_or_zero(f"sum by (model) (qkv_live_sequences{{{SEL}}})"), "live {{model}}")),
            ),
            8,
            8,
        ),
        (
            _timeseries(
                "Sequence state held",
                "Bytes of implicit state the live sequences hold (qkv_sequence_state_bytes), bounded per model "
                "by sequence_batching.max_state_bytes.",
                "bytes",
                _targets((_or_zero(f"sum by (model) (qkv_sequence_state_bytes{{{SEL}}})"), "state {{model}}")),
            ),
            8,
            8,
        ),
        (
            _timeseries(
                "Sequences freed for idling",
                "Sequences per second freed after max_sequence_idle_microseconds with nothing to do "
                "(qkv_expired_sequences_total): clients that abandon sequences instead of ending them.",
                "short",
                _targets((_or_zero(_rate("qkv_expired_sequences_total", "model")), "freed/s {{model}}")),
            ),
            8,
            8,
        ),
        (_row("Generation"), 24, 1),
        (
            _timeseries(
                "Time to first token",
                "p50 and p99 from a generation request's arrival to its first token "
                "(qkv_generation_time_to_first_token_seconds): queue wait, prefill and one step.",
                "s",
                _targets(
                    (_quantile(0.5, "qkv_generation_time_to_first_token_seconds", "model"), "p50 {{model}}"),
                    (_quantile(0.99, "qkv_generation_time_to_first_token_seconds", "model"), "p99 {{model}}"),
                ),
            ),
            8,
            8,
        ),
        (
            _timeseries(
                "Time per output token",
                "p50 and p99 of an answer's time after its first token per further token, by prompt length "
                "(qkv_generation_time_per_output_token_seconds): what a streaming reader sees between tokens.",
                "s",
                _targets(
                    (
                        _quantile(0.5, "qkv_generation_time_per_output_token_seconds", "model, prompt_tokens"),
                        "p50 {{model}} prompt<={{prompt_tokens}}",
                    ),
                    (
                        _quantile(0.99, "qkv_generation_time_per_output_token_seconds", "model, prompt_tokens"),
                        "p99 {{model}} prompt<={{prompt_tokens}}",
                    ),
                ),
            ),
            8,
            8,
        ),
        (
            _timeseries(
                "Tokens/s",
                "Output tokens written and prompt tokens read per second (qkv_generation_tokens_total).",
                "short",
                _targets(
                    (_or_zero(_rate("qkv_generation_tokens_total", "model", 'kind="output"')), "output {{model}}"),
                    (_or_zero(_rate("qkv_generation_tokens_total", "model", 'kind="prompt"')), "prompt {{model}}"),
                ),
            ),
            8,
            8,
        ),
        (
            _timeseries(
                "Running batch",
                "Sequences in the running batch at the last step (qkv_generation_running_sequences).",
                "short",
                _targets(
                    (_or_zero(f"sum by (model) (qkv_generation_running_sequences{{{SEL}}})"), "running {{model}}"),
                ),
            ),
            8,
            8,
        ),
        (
            _timeseries(
                "KV cache use",
                "Key/value cache the running sequences hold (qkv_generation_kv_cache_bytes) over the budget they "
                "may reserve (qkv_generation_kv_cache_budget_bytes, limits.cache_bytes).",
                "percentunit",
                _targets(
                    (
                        f"sum by (model) (qkv_generation_kv_cache_bytes{{{SEL}}}) / "
                        f"sum by (model) (qkv_generation_kv_cache_budget_bytes{{{SEL}}})",
                        "cache {{model}}",
                    ),
                ),
            ),
            8,
            8,
        ),
        (
            _timeseries(
                "Generation queue wait",
                "p50 and p99 of a request's wait before it joined the running batch "
                "(qkv_generation_queue_wait_seconds): the batch full, or the cache budget spent.",
                "s",
                _targets(
                    (_quantile(0.5, "qkv_generation_queue_wait_seconds", "model"), "p50 {{model}}"),
                    (_quantile(0.99, "qkv_generation_queue_wait_seconds", "model"), "p99 {{model}}"),
                ),
            ),
            8,
            8,
        ),
        (_row("Models"), 24, 1),
        (
            {
                "type": "table",
                "title": "Models loaded",
                "description": "qkv_model_info: which model versions each instance serves, on which provider.",
                "datasource": DS,
                "fieldConfig": {"defaults": {}, "overrides": []},
                "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
                "transformations": [
                    {"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}},
                ],
                "targets": _targets(
                    (f"max by (model, version, provider, instance) (qkv_model_info{{{SEL}}})", ""),
                    fmt="table",
                    instant=True,
                ),
            },
            18,
            7,
        ),
        (
            {
                "type": "stat",
                "title": "Instances serving",
                "description": "Servers that report qkv_model_info for the selected models.",
                "datasource": DS,
                "fieldConfig": {"defaults": {"unit": "short", "color": {"mode": "thresholds"}}, "overrides": []},
                "options": {
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value",
                    "graphMode": "area",
                    "textMode": "value",
                },
                "targets": _targets((f"count(count by (instance) (qkv_model_info{{{SEL}}}))", "instances")),
            },
            6,
            7,
        ),
        (
            _timeseries(
                "Requests by model version",
                "Inference requests per second answered by each model version (qkv_requests_total): traffic "
                "moving from one version to the next as it loads, and the old one draining.",
                "reqps",
                _targets(
                    (
                        f'sum by (model, version) (rate(qkv_requests_total{{{SEL},version!=""}}[$__rate_interval]))',
                        "{{model}} v{{version}}",
                    ),
                ),
            ),
            12,
            8,
        ),
        (
            _timeseries(
                "HTTP/REST requests by endpoint and status",
                "HTTP requests per second by endpoint and HTTP status (qkv_http_requests_total); inference "
                "requests of both protocols are in the panels above.",
                "reqps",
                _targets(
                    (
                        f"sum by (endpoint, code) (rate(qkv_http_requests_total{{{SEL}}}[$__rate_interval]))",
                        "{{endpoint}} {{code}}",
                    ),
                ),
            ),
            12,
            8,
        ),
    ]


def _place(layout: list[tuple[Panel, int, int]]) -> list[Panel]:
    panels, x, y, line = [], 0, 0, 0
    for i, (panel, w, h) in enumerate(layout, start=1):
        if x + w > 24:
            x, y, line = 0, y + line, 0
        panels.append({"id": i, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **panel})
        x, line = x + w, max(line, h)
    return panels


def _query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": query,
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "hide": 0,
    }


def build() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict."""
    return {
        "uid": "qkv-overview",
        "title": "qkv model server",
        "description": "qkv: traffic, errors, latency by sequence length, batching and models.",
        "tags": ["qkv", "grpc", "inference"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "regex": "",
                    "current": {},
                    "options": [],
                    "refresh": 1,
                    "hide": 0,
                    "multi": False,
                    "includeAll": False,
                },
                _query_variable("model", "Model", "label_values(qkv_model_info, model)"),
                _query_variable("instance", "Instance", 'label_values(qkv_model_info{model=~"$model"}, instance)'),
            ]
        },
        "panels": _place(_layout()),
    }


def render() -> str:
    """The dashboard file's exact text."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the build")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.output.exists() or args.output.read_text(encoding="utf-8") != text:
            print(f"{args.output} is out of date: run python deploy/grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
