"""Kubernetes: the overlays build, validate against the 1.33 schemas, and say what matters."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import K8S, KEDA_OVERLAYS, OVERLAYS, PROMETHEUS, load_yaml, load_yaml_all, module, ok, run, tool

Rendered = dict[str, tuple[Path, list[dict[str, Any]]]]
PROBE_TIMING = {"periodSeconds", "timeoutSeconds", "failureThreshold", "initialDelaySeconds", "successThreshold"}


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = pod_spec(docs)["containers"]
    assert [c["name"] for c in containers] == ["qkv"]
    return containers[0]


def config(docs: list[dict[str, Any]]) -> dict[str, str]:
    return one(docs, "ConfigMap")["data"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_kubernetes_1_33(rendered: Rendered, overlay: str) -> None:
    module("kubernetes_validate")
    path, _ = rendered[overlay]
    proc = run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "--no-warn", "-k", "1.33.0", str(path)]
    )
    ok(proc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_resources_round_trip_through_operator_models(rendered: Rendered, overlay: str) -> None:
    module("cloudcoil.models.prometheus_operator")
    path, _ = rendered[overlay]
    proc = run([sys.executable, str(K8S / "crdcheck.py"), str(path)])
    ok(proc)
    keda = ["ok", "ScaledObject/qkv"] if overlay in KEDA_OVERLAYS else []  # kustomize's order: by kind
    assert proc.stdout.split() == [*keda, "ok", "PrometheusRule/qkv", "ok", "ServiceMonitor/qkv"], proc.stdout


def test_crdcheck_catches_unknown_fields_and_wrong_types(rendered: Rendered, tmp_path: Path) -> None:
    module("cloudcoil.models.prometheus_operator")
    import yaml

    docs = [dict(d) for d in rendered["cpu"][1]]
    for d in docs:
        if d["kind"] == "ServiceMonitor":
            d["spec"] = {**d["spec"], "endpoints": [{**d["spec"]["endpoints"][0], "intervall": "5s"}]}
        if d["kind"] == "PrometheusRule":
            groups = yaml.safe_load(yaml.safe_dump(d["spec"]["groups"]))
            groups[1]["rules"][0]["for"] = ["5m"]
            d["spec"] = {"groups": groups}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    proc = run([sys.executable, str(K8S / "crdcheck.py"), str(bad)])
    assert proc.returncode == 1
    assert "intervall: unknown field" in proc.stdout
    assert "PrometheusRule/qkv" in proc.stdout and "valid string" in proc.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_has_every_resource(rendered: Rendered, overlay: str) -> None:
    kinds = sorted(d["kind"] for d in rendered[overlay][1])
    assert kinds == sorted(
        [
            "Namespace",
            "ConfigMap",
            "Deployment",
            "Service",
            "Service",
            "ScaledObject" if overlay in KEDA_OVERLAYS else "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "ServiceMonitor",
            "PrometheusRule",
            *(["PersistentVolumeClaim"] if overlay == "cpu-poll" else []),
        ]
    )
    for d in rendered[overlay][1]:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "qkv", d["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_native_grpc_on_8001(rendered: Rendered, overlay: str) -> None:
    c = container(rendered[overlay][1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(c[probe]) - PROBE_TIMING == {"grpc"}, c[probe]
        assert c[probe]["grpc"]["port"] == 8001
        assert c[probe]["grpc"].get("service", "") == ""  # the server's overall health
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    cfg = config(rendered[overlay][1])
    assert cfg["QKV_GRPC_PORT"] == "8001" and cfg["QKV_METRICS_PORT"] == "8002" and cfg["QKV_HTTP_PORT"] == "8000"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_outlasts_prestop_plus_drain(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay][1]
    grace = float(config(docs)["QKV_GRACE_PERIOD"])
    pre_stop = container(docs).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    termination = pod_spec(docs)["terminationGracePeriodSeconds"]
    assert termination > grace + pre_stop, (termination, grace, pre_stop)
    assert grace > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_come_from_the_configmap(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay][1]
    cm = one(docs, "ConfigMap")
    refs = [e["configMapRef"]["name"] for e in container(docs)["envFrom"]]
    assert refs == [cm["metadata"]["name"]]
    assert all(key.startswith(("QKV_", "OTEL_")) for key in cm["data"])  # OTEL_*: the OpenTelemetry SDK's
    # The image's repository, or (cpu-poll) the shared volume polled for new versions
    assert cm["data"]["QKV_MODEL_REPOSITORY"] == ("/srv/models" if overlay == "cpu-poll" else "/opt/qkv/models")
    assert int(cm["data"]["QKV_MAX_CONNECTION_AGE"]) > 0  # clients reconnect and spread over pods
    assert (
        cm["data"]["QKV_DEVICE"]
        == {
            "cpu": "cpu",
            "gpu": "cuda",
            "cpu-tracing": "cpu",
            "cpu-poll": "cpu",
            "cpu-keda": "cpu",
            "gpu-keda": "cuda",
        }[overlay]
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_have_requests_and_limits(rendered: Rendered, overlay: str) -> None:
    resources = container(rendered[overlay][1])["resources"]
    for key in ("cpu", "memory"):
        assert resources["requests"][key] and resources["limits"][key], resources


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_locked_down(rendered: Rendered, overlay: str) -> None:
    spec = pod_spec(rendered[overlay][1])
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    sc = container(rendered[overlay][1])["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    # The read-only root still has a writable /tmp.
    mounts = {m["mountPath"]: m["name"] for m in container(rendered[overlay][1])["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_spread_over_nodes_and_zones(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay][1]
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    keys = set()
    for tsc in pod_spec(docs)["topologySpreadConstraints"]:
        assert matches(tsc["labelSelector"]["matchLabels"], labels)
        keys.add(tsc["topologyKey"])
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_the_pods(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay][1]
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    svc = one(docs, "Service", "qkv")
    assert matches(svc["spec"]["selector"], labels)
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "http": (8000, "http"),
        "grpc": (8001, "grpc"),
        "metrics": (8002, "metrics"),
    }
    headless = one(docs, "Service", "qkv-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert matches(headless["spec"]["selector"], labels)
    assert [p["port"] for p in headless["spec"]["ports"]] == [8001]


CAPACITY = "qkv_server_utilization"  # the capacity signal (docs/operations.md, "Autoscaling")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaling_targets_the_deployment_on_the_capacity_signal(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay][1]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "name": one(docs, "Deployment")["metadata"]["name"]}
    if overlay in KEDA_OVERLAYS:
        scaled = one(docs, "ScaledObject")
        assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["spec"]["scaleTargetRef"] == deployment
        assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
        [trigger] = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert (
            trigger["metadata"]["query"].startswith(f"sum({CAPACITY}{{") and trigger["metadata"]["threshold"] == "0.7"
        )
        return
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["scaleTargetRef"] == deployment
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {"metric": {"name": CAPACITY}, "target": {"type": "AverageValue", "averageValue": "700m"}},
        }
    ]


def test_keda_and_the_hpa_scale_alike(rendered: Rendered) -> None:
    """The two variants are one rule: the same bounds and the same scaling behaviour, overlay by overlay."""
    for hpa_overlay, keda_overlay in (("cpu", "cpu-keda"), ("gpu", "gpu-keda")):
        hpa = one(rendered[hpa_overlay][1], "HorizontalPodAutoscaler")["spec"]
        scaled = one(rendered[keda_overlay][1], "ScaledObject")["spec"]
        assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
        assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]


def test_prometheus_adapter_serves_the_capacity_signal_as_a_pods_metric() -> None:
    import promql_parser

    values = load_yaml(K8S / "prometheus-adapter.yaml")
    [rule] = values["rules"]["custom"]
    assert rule["name"]["as"] == CAPACITY and rule["seriesQuery"].startswith(CAPACITY + "{")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    query = rule["metricsQuery"].replace("<<.GroupBy>>", "pod").replace("<<.Series>>", CAPACITY)
    promql_parser.parse(query.replace("<<.LabelMatchers>>", 'namespace="qkv"'))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdb_and_network_policy_select_the_pods(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay][1]
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
    netpol = one(docs, "NetworkPolicy")
    assert matches(netpol["spec"]["podSelector"]["matchLabels"], labels)
    allowed = {p["port"] for rule in netpol["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == {8000, 8001, 8002}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_the_metrics_port_once(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay][1]
    sm = one(docs, "ServiceMonitor")
    selected = [
        s
        for s in docs
        if s["kind"] == "Service" and matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    # Only the ClusterIP Service: the headless one would scrape every pod twice.
    assert [s["metadata"]["name"] for s in selected] == ["qkv"]
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    for endpoint in sm["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_rule_equals_rules_yml(rendered: Rendered, overlay: str) -> None:
    rule = one(rendered[overlay][1], "PrometheusRule")
    assert rule["spec"]["groups"] == load_yaml(PROMETHEUS / "rules.yml")["groups"]


def test_prometheus_rule_file_is_generated_from_rules_yml() -> None:
    ok(run([sys.executable, str(K8S / "sync_rules.py"), "--check"]))


def test_prometheus_rule_groups_pass_promtool(rendered: Rendered, tmp_path: Path) -> None:
    import yaml

    promtool = tool("promtool")
    groups = one(rendered["cpu"][1], "PrometheusRule")["spec"]["groups"]
    path = tmp_path / "cr-rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    ok(run([promtool, "check", "rules", str(path)]))


def test_cpu_overlay_runs_the_cpu_image(rendered: Rendered) -> None:
    c = container(rendered["cpu"][1])
    assert "cuda" not in c["image"] and c["image"].startswith("qkv:")
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert c["command"] == ["qkv"] and c["args"][0] == "serve"


def test_gpu_overlay_runs_the_cuda_image_on_a_gpu_node(rendered: Rendered) -> None:
    docs = rendered["gpu"][1]
    c = container(docs)
    assert c["image"].endswith("-cuda")
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    spec = pod_spec(docs)
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]} | set(spec.get("nodeSelector", {}))
    assert "nvidia.com/gpu.present" in keys
    assert config(docs)["QKV_DEVICE"] == "cuda"
    # The CPU overlay's probes survive the GPU patch.
    assert c["startupProbe"]["grpc"]["port"] == 8001


def test_namespace_enforces_restricted_pod_security(rendered: Rendered) -> None:
    ns = one(rendered["cpu"][1], "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --- KServe ----------------------------------------------------------------------------


def kserve_docs() -> list[dict[str, Any]]:
    kubectl = tool("kubectl")
    proc = run([kubectl, "kustomize", str(K8S / "kserve")])
    ok(proc)
    return load_yaml_all(proc.stdout)


def test_kserve_serving_runtime_speaks_grpc_v2_on_8001() -> None:
    docs = kserve_docs()
    runtime = one(docs, "ServingRuntime")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = runtime["spec"]
    assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"])
    assert spec["supportedModelFormats"] and all("name" in f for f in spec["supportedModelFormats"])
    [c] = spec["containers"]
    assert c["name"] == "kserve-container" and c["image"].startswith("qkv:")
    argv = c["command"] + c["args"]
    assert argv[:2] == ["qkv", "serve"]
    assert "--model-repository=/mnt/models" in argv and "--grpc-port=8001" in argv
    assert c["ports"] == [{"name": "h2c", "containerPort": 8001, "protocol": "TCP"}]
    assert c["securityContext"]["runAsNonRoot"] is True
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_kserve_inference_service_uses_the_runtime() -> None:
    docs = kserve_docs()
    runtime = one(docs, "ServingRuntime")
    isvc = one(docs, "InferenceService")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert model["protocolVersion"] == "grpc-v2"
    assert "://" in model["storageUri"]
    assert [p["containerPort"] for p in model["ports"]] == [8001]


def test_tracing_overlay_sends_otlp_to_the_collector_and_only_there(rendered: Rendered) -> None:
    docs = rendered["cpu-tracing"][1]
    settings = config(docs)
    assert settings["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4317") and settings["OTEL_SERVICE_NAME"] == "qkv"
    assert 0 <= float(settings["QKV_TRACE_SAMPLE_RATIO"]) <= 1
    assert {k: v for k, v in settings.items() if not k.startswith(("OTEL_", "QKV_TRACE"))} == config(rendered["cpu"][1])
    egress = one(docs, "NetworkPolicy")["spec"]["egress"]
    ports = {p["port"] for rule in egress for p in rule["ports"]}
    assert ports == {4317, 53}
    assert not config(rendered["cpu"][1]).keys() & {"OTEL_EXPORTER_OTLP_ENDPOINT", "QKV_TRACE_SAMPLE_RATIO"}
    assert one(rendered["cpu"][1], "NetworkPolicy")["spec"]["egress"] == []


def test_poll_overlay_serves_the_shared_volume_in_poll_mode(rendered: Rendered) -> None:
    docs = rendered["cpu-poll"][1]
    settings = config(docs)
    assert settings["QKV_MODEL_CONTROL_MODE"] == "poll" and float(settings["QKV_REPOSITORY_POLL_SECS"]) > 0
    changed = {k for k in settings if settings[k] != config(rendered["cpu"][1]).get(k)}
    assert changed == {"QKV_MODEL_CONTROL_MODE", "QKV_MODEL_REPOSITORY", "QKV_REPOSITORY_POLL_SECS"}
    pvc = one(docs, "PersistentVolumeClaim", "qkv-models")
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    volume = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"] == {"claimName": "qkv-models", "readOnly": True}
    mount = next(m for m in container(docs)["volumeMounts"] if m["name"] == "models")
    assert mount["mountPath"] == settings["QKV_MODEL_REPOSITORY"] and mount["readOnly"] is True
    assert container(docs)["securityContext"]["readOnlyRootFilesystem"] is True
