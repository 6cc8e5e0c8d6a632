"""Prometheus: config and rules pass promtool, every alert is tested firing and silent."""

from __future__ import annotations

from typing import Any

from deploy_helpers import EXPOSED, PROMETHEUS, load_yaml, metric_names, ok, run, tool

ALERTS = {"QkvHighErrorRatio", "QkvHighP99Latency", "QkvQueueSaturated", "QkvTargetDown"}


def rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(PROMETHEUS / "rules.yml")["groups"] for r in g["rules"]]


def test_promtool_check_config() -> None:
    ok(run([tool("promtool"), "check", "config", str(PROMETHEUS / "prometheus.yml")]))


def test_promtool_check_rules() -> None:
    ok(run([tool("promtool"), "check", "rules", str(PROMETHEUS / "rules.yml")]))


def test_promtool_test_rules() -> None:
    proc = run([tool("promtool"), "test", "rules", str(PROMETHEUS / "rules_test.yml")])
    ok(proc)
    assert "SUCCESS" in proc.stdout


def test_config_loads_the_rules_and_scrapes_qkv() -> None:
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    assert config["rule_files"] == ["rules.yml"]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = [t for sc in jobs["qkv"]["static_configs"] for t in sc["targets"]]
    assert targets == ["qkv:8002"]
    assert jobs["qkv"].get("metrics_path", "/metrics") == "/metrics"


def test_the_required_alerts_exist_with_severity_and_summary() -> None:
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert rule.get("for"), f"{name} fires on one evaluation: give it a `for`"


def test_every_alert_is_tested_firing_and_silent() -> None:
    tests = load_yaml(PROMETHEUS / "rules_test.yml")
    assert tests["rule_files"] == ["rules.yml"]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            # exp_alerts lists every alert active at eval_time, so a firing check also proves
            # that the case's other series (models, instances under the thresholds) stay silent.
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert firing == ALERTS, f"no firing case for {ALERTS - firing}"
    assert silent == ALERTS, f"no silent case for {ALERTS - silent}"


def test_rules_use_only_the_contract_metrics() -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        for name in metric_names(rule["expr"]):
            assert name in EXPOSED or name in recorded or name == "up", (rule.get("alert") or rule["record"], name)


def test_recording_rule_names_follow_the_convention() -> None:
    for rule in rules():
        if "record" in rule:
            level, metric, operation = rule["record"].split(":")
            assert level and operation and metric.startswith("qkv_"), rule["record"]
