"""docker-compose.yml: valid for docker-compose and the compose-spec schema, wired right."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import COMPOSE, GRAFANA, PROMETHEUS, ROOT, load_yaml, module, ok, run, tool

NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent.sock"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(load_yaml(COMPOSE))


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path of the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            out[target] = (ROOT / source).resolve()
    return out


@pytest.mark.parametrize(
    "profile", [[], ["--profile", "gpu"], ["--profile", "tracing"]], ids=["default", "gpu", "tracing"]
)
def test_docker_compose_config_accepts_the_file(profile: list[str]) -> None:
    ok(run([tool("docker-compose"), "-f", str(COMPOSE), *profile, "config", "-q"], env=NO_ENGINE))


def test_compose_spec_schema_accepts_the_file() -> None:
    module("check_jsonschema")
    ok(run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)]))


def test_compose_spec_without_version_key(compose: dict[str, Any]) -> None:
    assert "version" not in compose
    assert set(services(compose)) == {"qkv", "qkv-gpu", "prometheus", "grafana", "otel-collector", "jaeger"}


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    for name, svc in services(compose).items():
        image = svc["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), (name, image)
    assert services(compose)["prometheus"]["image"].startswith("prom/prometheus:v2.")


def test_qkv_is_built_from_the_cpu_dockerfile_and_health_checked(compose: dict[str, Any]) -> None:
    qkv = services(compose)["qkv"]
    assert qkv["build"] == {"context": ".", "dockerfile": "deploy/docker/Dockerfile"}
    test = qkv["healthcheck"]["test"]
    assert test[:3] == ["CMD", "qkv", "health"], test
    published = {p.rsplit(":", 1)[-1] for p in qkv["ports"]}
    assert published == {"8000", "8001", "8002"}
    assert qkv["read_only"] is True and qkv["cap_drop"] == ["ALL"]


def test_gpu_profile_reserves_a_gpu_for_the_cuda_image(compose: dict[str, Any]) -> None:
    gpu = services(compose)["qkv-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    assert gpu["environment"]["QKV_DEVICE"] == "cuda"
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] >= 1
    assert gpu["healthcheck"]["test"][:3] == ["CMD", "qkv", "health"]
    for name, svc in services(compose).items():
        if name not in ("qkv-gpu", "otel-collector", "jaeger"):
            assert "profiles" not in svc, name


def test_tracing_profile_sends_qkvs_spans_through_a_collector_to_jaeger(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    assert svcs["otel-collector"]["profiles"] == svcs["jaeger"]["profiles"] == ["tracing"]
    env = svcs["qkv"]["environment"]
    assert env["QKV_TRACING"] == "${QKV_TRACING:-false}"  # off unless asked for
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    mounts = bind_mounts(svcs["otel-collector"])
    config_file = mounts["/etc/otelcol/config.yml"]
    assert "--config=/etc/otelcol/config.yml" in svcs["otel-collector"]["command"]
    config = load_yaml(config_file)
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    [pipeline] = config["service"]["pipelines"].values()
    assert pipeline["receivers"] == ["otlp"]
    [exporter] = pipeline["exporters"]
    assert config["exporters"][exporter]["endpoint"] == "jaeger:4317"
    # Prometheus keeps exemplars; Grafana's Prometheus datasource links them to the Jaeger datasource.
    assert "--enable-feature=exemplar-storage" in svcs["prometheus"]["command"]
    [prom] = load_yaml(GRAFANA / "provisioning/datasources/prometheus.yml")["datasources"]
    [jaeger] = load_yaml(GRAFANA / "provisioning/datasources/traces.yml")["datasources"]
    assert prom["jsonData"]["exemplarTraceIdDestinations"] == [{"name": "trace_id", "datasourceUid": jaeger["uid"]}]
    assert jaeger["type"] == "jaeger" and jaeger["url"] == "http://jaeger:16686"


def test_start_order_is_health_gated(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    assert svcs["prometheus"]["depends_on"] == {"qkv": {"condition": "service_healthy"}}
    assert svcs["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    for name in ("prometheus", "grafana"):
        assert svcs[name]["healthcheck"]["test"][0] == "CMD", name


def test_named_volumes_hold_the_data(compose: dict[str, Any]) -> None:
    declared = set(compose["volumes"])
    used = {
        v.split(":")[0]
        for svc in services(compose).values()
        for v in svc.get("volumes", [])
        if not v.startswith((".", "/"))
    }
    assert used == declared == {"prometheus-data", "grafana-data"}


def test_mounted_files_are_the_checked_files(compose: dict[str, Any]) -> None:
    prom = bind_mounts(services(compose)["prometheus"])
    assert prom == {
        "/etc/prometheus/prometheus.yml": PROMETHEUS / "prometheus.yml",
        "/etc/prometheus/rules.yml": PROMETHEUS / "rules.yml",
    }
    graf = bind_mounts(services(compose)["grafana"])
    assert graf == {
        "/etc/grafana/provisioning/datasources/prometheus.yml": GRAFANA / "provisioning/datasources/prometheus.yml",
        "/etc/grafana/provisioning/datasources/traces.yml": GRAFANA / "provisioning/datasources/traces.yml",
        "/etc/grafana/provisioning/dashboards/qkv.yml": GRAFANA / "provisioning/dashboards/qkv.yml",
        "/etc/grafana/dashboards": GRAFANA / "dashboards",
    }
    for host in [*prom.values(), *graf.values()]:
        assert host.exists(), host
    assert (GRAFANA / "dashboards" / "qkv.json").is_file()
    # The config mounted at /etc/prometheus/ loads rules.yml from beside itself.
    assert load_yaml(PROMETHEUS / "prometheus.yml")["rule_files"] == ["rules.yml"]
    # Prometheus' command points at the mounted config.
    assert "--config.file=/etc/prometheus/prometheus.yml" in services(compose)["prometheus"]["command"]


def test_services_find_each_other(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    scrape = load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"]
    targets = [t for job in scrape for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert "qkv:8002" in targets and "qkv" in svcs
    dns = [n for job in scrape for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
    assert set(dns) <= set(svcs)
    ds = load_yaml(GRAFANA / "provisioning/datasources/prometheus.yml")["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"
    provider = load_yaml(GRAFANA / "provisioning/dashboards/qkv.yml")["providers"][0]
    assert provider["options"]["path"] in bind_mounts(svcs["grafana"])
    env = svcs["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].startswith(provider["options"]["path"] + "/")
