"""The autoscaling simulation (deploy/compose): the rule the controller applies, on injected values, and
the simulation for real: a load step from 1x to 4x through the balancer settles at the replicas the rule
predicts from the measured per-replica capacity, back at 1x it drains down again, and no request fails.

The slow test needs a Docker engine (tests/deploy/docker_engine.sh starts one); like the compose stack's
tests it fails without one in CI and skips elsewhere. Its figures are printed in the test summary.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import (
    COMPOSE,
    DOCKER,
    K8S,
    PROMETHEUS,
    SIMULATION,
    compose_script,
    load_yaml,
    load_yaml_all,
    ok,
    run,
    run_name,
    selectors,
    tool,
)
from test_deploy_stack import Stack, _engine, _until

from service.scheduling.admission import DEMAND_HORIZON_S
from tests.figures import FIGURES as ALL_FIGURES

autoscaler = compose_script("autoscaler")
Policy, Rule, Memory = autoscaler.Policy, autoscaler.Rule, autoscaler.Memory
FIGURES = ALL_FIGURES.setdefault("compose autoscaling simulation", {})
OVERLAY = SIMULATION / "autoscale.yml"
HPA = K8S / "base" / "hpa.yaml"

# A rule to decide on: target 0.5 per replica, 1..10 replicas, +2 per 10 s, -1 per 20 s, 60 s down-window.
RULE = Rule(
    query="sum(x)",
    target=0.5,
    min_replicas=1,
    max_replicas=10,
    interval=1.0,
    up_window=0.0,
    down_window=60.0,
    up_policies=(Policy(2, 10.0),),
    down_policies=(Policy(1, 20.0),),
)


def test_the_recommendation_is_ceil_of_replicas_times_mean_over_target() -> None:
    recommend = autoscaler.recommend
    assert recommend(RULE, 3, 2.6) == 6  # mean 0.867 over 0.5: ceil(3 x 1.73)
    assert recommend(RULE, 4, 1.0) == 2  # mean 0.25
    assert recommend(RULE, 2, 0.0) == 0  # no load: the bounds then keep the minimum
    assert recommend(replace(RULE, target=0.1), 1, 0.3) == 3  # 0.3 / 0.1 is 2.9999999999999996 in floats
    # Within the HPA's 10 % tolerance of the target the replicas stay: 3 x 0.5 = 1.5 +- 0.15.
    assert [recommend(RULE, 3, v) for v in (1.36, 1.5, 1.64)] == [3, 3, 3]
    assert [recommend(RULE, 3, v) for v in (1.3, 1.7)] == [3, 4]


def test_scale_up_acts_at_once_within_the_rate_policy_and_the_bounds() -> None:
    decide = autoscaler.decide
    d = decide(RULE, Memory(), 0.0, 1, 5.0)  # asks for 10
    assert (d.recommended, d.replicas) == (10, 3)  # +2 per 10 s
    d = decide(RULE, d.memory, 5.0, 3, 5.0)
    assert d.replicas == 3  # the period's 2 are spent
    d = decide(RULE, d.memory, 10.5, 3, 5.0)
    assert d.replicas == 5
    wide = Rule("sum(x)", 0.5, 1, 4, 1.0, up_policies=(Policy(100, 10.0),))
    assert decide(wide, Memory(), 0.0, 1, 50.0).replicas == 4  # the maximum
    assert decide(wide, Memory(), 0.0, 3, 0.0).replicas == 1  # the minimum (no down-policy, window 300 s)


def test_scale_down_waits_for_the_window_then_goes_one_replica_per_period() -> None:
    decide = autoscaler.decide
    d = decide(RULE, Memory(), 0.0, 4, 2.0)  # exactly at target: 4
    assert d.replicas == 4
    for now in (1.0, 30.0, 59.0):  # the load is gone, but 4 is still in the window
        d = decide(RULE, d.memory, now, 4, 0.0)
        assert (d.recommended, d.replicas) == (0, 4)
    d = decide(RULE, d.memory, 61.0, 4, 0.0)
    assert d.replicas == 3  # the window's highest is now 1 (the minimum); one replica per 20 s
    assert decide(RULE, d.memory, 70.0, 3, 0.0).replicas == 3
    d = decide(RULE, decide(RULE, d.memory, 70.0, 3, 0.0).memory, 81.5, 3, 0.0)
    assert d.replicas == 2


def test_a_rise_inside_the_down_window_scales_up_at_once() -> None:
    decide = autoscaler.decide
    d = decide(RULE, Memory(), 0.0, 2, 0.2)  # asks for 1, and the window holds nothing higher
    assert d.replicas == 1
    d = decide(RULE, d.memory, 1.0, 1, 0.9)  # asks for 2: the up-window is 0 s, so at once
    assert d.replicas == 2
    d = decide(RULE, d.memory, 2.0, 2, 0.3)  # asks for 1, but 2 is in the down-window
    assert (d.recommended, d.replicas) == (1, 2)


def test_the_rule_is_the_scaled_objects_and_the_hpas() -> None:
    """One source: the controller reads the ScaledObject, whose query, target, bounds and behaviour are the
    HPA's (tests/deploy/test_deploy_k8s.py checks the overlays render them alike)."""
    rule = autoscaler.rule_from_scaled_object()
    scaled = load_yaml(K8S / "components" / "autoscale-keda" / "scaledobject.yaml")["spec"]
    [trigger] = scaled["triggers"]
    assert rule.query == trigger["metadata"]["query"]
    hpa = load_yaml(HPA)["spec"]
    [metric] = hpa["metrics"]
    assert rule.target == float(metric["pods"]["target"]["averageValue"].rstrip("m")) / 1000
    assert metric["pods"]["metric"]["name"] in rule.query
    assert (rule.min_replicas, rule.max_replicas) == (hpa["minReplicas"], hpa["maxReplicas"])
    behaviour = hpa["behavior"]
    assert (rule.up_window, rule.down_window) == (
        behaviour["scaleUp"]["stabilizationWindowSeconds"],
        behaviour["scaleDown"]["stabilizationWindowSeconds"],
    )
    for policies, side in ((rule.up_policies, "scaleUp"), (rule.down_policies, "scaleDown")):
        assert [(p.pods, p.period) for p in policies] == [
            (p["value"], p["periodSeconds"]) for p in behaviour[side]["policies"]
        ]
    assert rule.interval == scaled["pollingInterval"]
    fast = rule.scaled(0.05)
    assert (fast.interval, fast.down_window, fast.target) == (rule.interval * 0.05, rule.down_window * 0.05, 0.7)
    assert [p.period for p in fast.down_policies] == [p.period * 0.05 for p in rule.down_policies]


def test_the_simulations_prometheus_labels_its_targets_as_the_query_selects() -> None:
    """The query from deploy/k8s reads the simulation's series unchanged: each label it selects on is one
    the compose Prometheus gives every replica (the job's name, or a relabelling)."""
    rule = autoscaler.rule_from_scaled_object()
    config = load_yaml(SIMULATION / "prometheus.yml")
    [(name, matchers)] = selectors(rule.query)
    assert name == "qkv_server_utilization"
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == matchers["job"][1]]
    assert job["dns_sd_configs"][0]["names"] == ["qkv"]  # every replica, found by Docker's DNS
    given = {r["target_label"]: r["replacement"] for r in job["relabel_configs"]}
    for label, (op, value) in matchers.items():
        assert op == "MatchOp.Equal" and (label == "job" or given[label] == value), (label, op, value)


def test_the_simulations_files_are_valid(tmp_path: Path) -> None:
    """The overlay merges with docker-compose.yml (docker-compose config, no engine needed), Prometheus'
    configuration checks with the rules beside it, and the balancer has a slot for every replica."""
    proc = run(
        [tool("docker-compose"), "-f", str(COMPOSE), "-f", str(OVERLAY), "config"],
        env={"DOCKER_HOST": "unix:///nonexistent.sock"},
    )
    ok(proc)
    [merged] = load_yaml_all(proc.stdout)
    services = merged["services"]
    mounts = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in services["prometheus"]["volumes"]]
    assert mounts.count("/etc/prometheus/prometheus.yml") == 1
    assert any(str(SIMULATION / "prometheus.yml") in str(v) for v in services["prometheus"]["volumes"])
    shutil.copy(SIMULATION / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(PROMETHEUS / "rules.yml", tmp_path / "rules.yml")
    ok(run([tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")]))
    slots = _slots((SIMULATION / "haproxy" / "haproxy.cfg").read_text(encoding="utf-8"))
    assert set(slots) == {"qkv-grpc", "qkv-http"}, slots
    assert min(slots.values()) >= autoscaler.rule_from_scaled_object().max_replicas, slots


def _slots(cfg: str) -> Counter[str]:
    """Each HAProxy backend's servers: its `server` lines and the servers of its `server-template`s."""
    slots: Counter[str] = Counter()
    backend = None
    for words in (line.split("#")[0].split() for line in cfg.splitlines()):
        if words and words[0] in ("global", "defaults", "resolvers", "frontend", "backend"):
            backend = words[1] if words[0] == "backend" else None
        elif backend and words and words[0] == "server":
            slots[backend] += 1
        elif backend and words and words[0] == "server-template":
            first, last = words[2].split("-")
            slots[backend] += int(last) - int(first) + 1
    return slots


# --- the simulation, for real ----------------------------------------------------------------------------

RATE = 10.0  # 1x, requests per second
CALIBRATE_S = 35.0  # 1x before the rule is set from the measured capacity
BEFORE_STEP_S = 15.0  # 1x with the controller running
STEP_S = 85.0  # 4x
AFTER_S = 65.0  # 1x again: the replicas drain away
SETTLED_S = 15.0  # the end of the 4x step over which the count must not change
TIME_SCALE = 0.05  # the ScaledObject's 15 s polling, 300 s down-window and policy periods, 20 x faster
UP, BASE = 3, 1  # the replicas the test sets the target for: 4x -> 3, 1x -> 1
MAX_REPLICAS = 4


@dataclass
class Simulation(Stack):
    """docker-compose.yml with the simulation's overlay, as one compose project."""

    def compose(self, *args: str, timeout: float = 300) -> str:
        cmd = [tool("docker-compose"), "-p", self.project, "-f", str(COMPOSE), "-f", str(OVERLAY), *args]
        proc = run(cmd, env=self.env, timeout=timeout)
        ok(proc)
        return proc.stdout


@pytest.fixture(scope="module")
def simulation() -> Iterator[Simulation]:
    _engine()
    sim = Simulation(
        run_name("qkvt") + "as",
        {
            "DOCKER_BUILDKIT": "0",  # the classic builder: BuildKit's frontend image comes from a registry
            "COMPOSE_DOCKER_CLI_BUILD": "0",
            "QKV_TAG": run_name("test") + "as",  # qkv:TAG and qkv:TAG-lb
            "QKV_LB_BASE": "qkv-standin/bookworm:minbase",  # offline-bases.sh's Debian rootfs
            **{
                v: ""  # free host ports
                for v in (
                    "QKV_HTTP_HOST_PORT",
                    "QKV_GRPC_HOST_PORT",
                    "QKV_METRICS_HOST_PORT",
                    "PROMETHEUS_HOST_PORT",
                    "QKV_LB_HTTP_HOST_PORT",
                    "QKV_LB_GRPC_HOST_PORT",
                )
            },
        },
    )
    ok(run(["bash", str(DOCKER / "offline-bases.sh")], timeout=900))
    try:
        start = time.monotonic()
        sim.compose("up", "-d", "--build", "qkv", "prometheus", "lb", timeout=900)
        sim.wait_healthy("qkv")
        sim.wait_healthy("prometheus")
        FIGURES["build and up -> qkv and Prometheus healthy"] = f"{time.monotonic() - start:.1f} s"
        yield sim
    finally:
        sim.remove(sim.image(), sim.image() + "-lb")


def _decisions(path: Path) -> list[dict[str, Any]]:
    return [d for line in path.read_text().splitlines() if "time" in (d := json.loads(line))]


@pytest.mark.slow
def test_a_load_step_settles_at_the_replicas_the_rule_predicts(simulation: Simulation, tmp_path: Path) -> None:
    sim = simulation
    rule = autoscaler.rule_from_scaled_object()
    prometheus = f"http://{sim.address('prometheus', 9090)}"
    _until("the replica's signal in Prometheus", lambda: autoscaler.query(prometheus, rule.query) is not None)
    # Every container of the project that exits: a replica scaled away must exit by itself (code 0, drained).
    died = subprocess.Popen(
        [tool("docker"), "events", "--format", "{{json .}}", "--filter", "event=die",
         "--filter", f"label=com.docker.compose.project={sim.project}"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    steps = [(RATE, CALIBRATE_S + BEFORE_STEP_S), (4 * RATE, STEP_S), (RATE, AFTER_S)]
    load = subprocess.Popen(
        [sys.executable, str(SIMULATION / "load.py"), "--target", sim.address("lb", 8001), "--no-lexicon",
         *(arg for rate, seconds in steps for arg in ("--step", f"{rate}:{seconds}"))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    log = tmp_path / "autoscaler.log"
    controller: subprocess.Popen[str] | None = None
    try:
        # The per-replica capacity, measured: the signal at 1x, corrected for its demand estimate's
        # smoothing (an exponential average over DEMAND_HORIZON_S that started at 0 with the load).
        started = time.monotonic()
        time.sleep(CALIBRATE_S)
        value = autoscaler.query(prometheus, rule.query)
        assert value, "no utilization at 1x"
        age = time.monotonic() - started - 1.0  # the sample is up to a scrape interval (2 s) old
        u1 = value / (1 - math.exp(-age / DEMAND_HORIZON_S))
        capacity = RATE / u1  # requests per second one replica does at utilization 1
        # A target that puts 4x in the middle of UP's band: ceil(4 x RATE / (capacity x target)) = UP.
        target = 4 * u1 / (UP - 0.5)
        predicted = [max(1, math.ceil(n * RATE / (capacity * target))) for n in (1, 4)]
        assert predicted == [BASE, UP]
        FIGURES["measured capacity of one replica"] = (
            f"{capacity:.0f} g2p requests/s at utilization 1 ({u1:.4f} at {RATE:.0f}/s); target {target:.4f}"
        )
        compose_command = shlex.join([tool("docker-compose"), "-f", str(COMPOSE), "-f", str(OVERLAY)])
        with log.open("w") as out:
            controller = subprocess.Popen(
                [sys.executable, str(SIMULATION / "autoscaler.py"), "--prometheus", prometheus,
                 "--time-scale", str(TIME_SCALE), "--target", str(target), "--min-replicas", "1",
                 "--max-replicas", str(MAX_REPLICAS), "-p", sim.project, "--compose", compose_command],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **sim.env}, text=True,
            )  # fmt: skip
        stdout, stderr = load.communicate(timeout=sum(s for _, s in steps) + 120)
        assert load.returncode == 0, stderr[-3000:]
    finally:
        for proc in (load, controller):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
        died.terminate()
    result = json.loads(stdout)
    records, ran = result["records"], result["steps"]
    decisions = _decisions(log)
    codes = Counter(r[2] for r in records)
    retried = sum(1 for r in records if r[3] > 1)
    exits = [json.loads(line) for line in died.communicate(timeout=10)[0].splitlines()]
    replica_exits = [e["Actor"]["Attributes"] for e in exits]
    FIGURES["load step 1x -> 4x -> 1x"] = (
        f"{RATE:.0f} -> {4 * RATE:.0f} -> {RATE:.0f} requests/s: {len(records)} sent, {codes['OK']} answered, "
        f"{len(records) - codes['OK']} failed, {retried} answered after a retry"
    )
    FIGURES["replicas over time"] = " ".join(_changes(decisions, ran[0][1]))
    assert codes == {"OK": len(records)}, codes  # 0 failed requests, retries of UNAVAILABLE included
    assert len(records) >= sum(rate * seconds for rate, seconds in steps) * 0.99

    up_at, down_at = ran[1][1], ran[2][1]
    before = [d for d in decisions if d["time"] < up_at]
    settled = [d for d in decisions if down_at - SETTLED_S <= d["time"] < down_at]
    assert before and settled and decisions[-1]["time"] > down_at, decisions
    assert {d["current"] for d in before} == {BASE}, before
    # Settled at 4x: one count over the end of the step, the one the rule gives for the signal there
    # (the highest recommendation of the down-window, within the bounds).
    counts = {d["current"] for d in settled} | {d["replicas"] for d in settled}
    assert len(counts) == 1, settled
    [n] = counts
    assert BASE < n == min(max(d["recommended"] for d in settled), MAX_REPLICAS), settled
    # Each replica's own capacity (its requests/s over its utilization at the end of the step), and the
    # count they predict for the offered load split evenly: the sum the controller reads.
    at = f"@ {down_at:.3f}"
    served = _vector(prometheus, f'sum by (instance) (rate(qkv_requests_total{{job="qkv", model="g2p"}}[10s] {at}))')
    utilization = _vector(prometheus, f'sum by (instance) (qkv_server_utilization{{job="qkv"}} {at})')
    capacities = sorted(served[i] / utilization[i] for i in served if utilization.get(i))
    from_capacities = min(math.ceil(sum(4 * RATE / len(capacities) / c for c in capacities) / target), MAX_REPLICAS)
    FIGURES["settled at 4x"] = (
        f"{n} replicas; the first replica's capacity predicted {UP}; the serving replicas' capacities "
        f"({' / '.join(f'{c:.0f}' for c in capacities)} requests/s at utilization 1) predict {from_capacities}; "
        f"shares of the requests: {' / '.join(f'{r / sum(served.values()):.2f}' for r in served.values())}"
    )
    # The balancer spread the step over the new replicas: more than one answered, together all of it.
    assert len(served) >= 2 and sum(served.values()) == pytest.approx(4 * RATE, rel=0.15), served
    # Back at 1x: scaled down, by draining: each replica removed got SIGTERM, answered what it held and
    # exited by itself.
    n_after = decisions[-1]["current"]
    assert n_after < n, decisions[-10:]
    removed = [a for a in replica_exits if a.get("com.docker.compose.service") == "qkv"]
    assert len(removed) == n - n_after and all(a["exitCode"] == "0" for a in removed), replica_exits


def _vector(prometheus: str, expr: str) -> dict[str, float]:
    """An instant query's series by instance."""
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return {r["metric"]["instance"]: float(r["value"][1]) for r in json.load(answer)["data"]["result"]}


def _changes(decisions: list[dict[str, Any]], start: float) -> list[str]:
    """'N@Ts' for each change in the running replicas, T seconds after the load started."""
    out, last = [], None
    for d in decisions:
        if d["current"] != last:
            out.append(f"{d['current']}@{d['time'] - start:.0f}s")
            last = d["current"]
    return out
