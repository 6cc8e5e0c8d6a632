"""Grafana: the dashboard is built from its script, well formed, and its PromQL is sound."""

from __future__ import annotations

import json
import sys
from types import ModuleType
from typing import Any

import pytest
from deploy_helpers import EXPOSED, GRAFANA, METRICS, grouping_labels, load_yaml, metric_names, ok, run, selectors

from tests.conftest import script_module

DASHBOARD = GRAFANA / "dashboards" / "qkv.json"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def dq() -> ModuleType:
    return script_module(GRAFANA / "dashboard_queries.py", "dashboard_queries")


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels") or [])
    return out


def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def raw_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in data_panels(dashboard) for t in p["targets"]]


def test_dashboard_json_is_what_the_build_script_makes() -> None:
    ok(run([sys.executable, str(GRAFANA / "build_dashboard.py"), "--check"]))


def test_dashboard_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "qkv-overview" and len(dashboard["uid"]) <= 40
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard.get("id") is None  # provisioned dashboards carry no database id
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_every_panel_has_type_position_and_targets(dashboard: dict[str, Any]) -> None:
    known = {"timeseries", "heatmap", "table", "stat", "bargauge", "gauge", "row"}
    for panel in all_panels(dashboard):
        assert panel["type"] in known, panel["title"]
        pos = panel["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in pos.values()), panel["title"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
    for panel in data_panels(dashboard):
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert all(refs) and len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert t["expr"].strip(), panel["title"]


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(dashboard):
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_template_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("model", "instance"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] is True and v["includeAll"] is True, name
        assert v["datasource"]["uid"] == "${datasource}"
        assert v["query"].startswith("label_values(") and v["query"].endswith(f", {name})")
    assert metric_names(variables["instance"]["query"][len("label_values(") : -len(", instance)")]) <= set(EXPOSED)


def test_every_query_filters_by_model_and_instance(dashboard: dict[str, Any]) -> None:
    for title, expr in raw_exprs(dashboard):
        marked = expr.replace("$model", "MODEL").replace("$instance", "INSTANCE").replace("$__rate_interval", "1m")
        for name, matchers in selectors(marked):
            assert matchers.get("model") == ("MatchOp.Re", "MODEL"), (title, name)
            assert matchers.get("instance") == ("MatchOp.Re", "INSTANCE"), (title, name)


def test_queries_substitute_every_variable(dashboard: dict[str, Any], dq: ModuleType) -> None:
    queries = dq.queries(DASHBOARD)
    assert len(queries) == len(raw_exprs(dashboard))
    for title, expr in queries:
        assert "$" not in expr.replace('"$1"', ""), (title, expr)
        assert 'model=~".*"' in expr and 'instance=~".*"' in expr, (title, expr)
        if "rate(" in expr or "increase(" in expr:
            assert "[1m]" in expr, (title, expr)
    with pytest.raises(ValueError, match="typo"):
        dq.substitute('up{model=~"$typo"}', {"model": ".*"})
    assert dq.substitute('x{a="$1"}[$__range]', {}) == 'x{a="$1"}[5m]'
    assert dq.substitute("${model:regex} [[model]] $__interval_ms", {"model": ".*"}) == ".* .* 15000"


def test_every_query_parses_and_uses_only_contract_metrics(dq: ModuleType) -> None:
    used: set[str] = set()
    for title, expr in dq.queries(DASHBOARD):
        names = metric_names(expr)  # raises ValueError on a syntax error
        assert names, (title, expr)
        assert names <= set(EXPOSED), (title, names - set(EXPOSED))
        used |= {EXPOSED[n] for n in names}
    assert used == set(METRICS), f"metrics without a panel: {set(METRICS) - used}"


def test_latency_is_shown_by_sequence_length(dashboard: dict[str, Any], dq: ModuleType) -> None:
    by_seq_len = [(t, e) for t, e in dq.queries(DASHBOARD) if any("seq_len" in g for g in grouping_labels(e))]
    assert any(
        e.startswith("histogram_quantile(") and "qkv_request_duration_seconds_bucket" in e for _, e in by_seq_len
    ), by_seq_len
    heatmaps = [p for p in data_panels(dashboard) if p["type"] == "heatmap"]
    assert any("seq_len" in t["expr"] for p in heatmaps for t in p["targets"])
    assert any(t.get("format") == "heatmap" for p in heatmaps for t in p["targets"])


def test_dashboard_covers_the_asked_panels(dashboard: dict[str, Any]) -> None:
    titles = " | ".join(p["title"].lower() for p in data_panels(dashboard))
    for words in (
        "request rate",
        "error",
        "p50 / p95 / p99",
        "sequence length",
        "heatmap",
        "queue time vs compute",
        "batch size",
        "padding",
        "in-flight",
        "per instance",
        "models loaded",
    ):
        assert words in titles, words
    info = [p for p in data_panels(dashboard) if "qkv_model_info" in p["targets"][0]["expr"]]
    assert any(p["type"] in {"table", "stat"} for p in info)


def test_provisioning_files() -> None:
    ds = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["apiVersion"] == 1
    [source] = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    providers = load_yaml(GRAFANA / "provisioning" / "dashboards" / "qkv.yml")
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards"
