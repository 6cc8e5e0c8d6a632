"""A small autoscaler for the compose simulation (deploy/compose/autoscale.yml): what KEDA and the HPA do
in Kubernetes, on the same query, with the same rule, for `docker compose up --scale`.

    python deploy/compose/autoscaler.py --prometheus http://127.0.0.1:9090 [--time-scale 0.1] [--target 0.7]

Everything about the rule is read from the KEDA ScaledObject (deploy/k8s/components/autoscale-keda/
scaledobject.yaml), the one source: the Prometheus query (the replicas' summed qkv_server_utilization),
its threshold, the replica bounds, the polling interval and the HPA behaviour (stabilisation windows and
rate policies). Every interval it reads the query, decides with `decide` (the HPA's algorithm for an
AverageValue metric) and, when the count changes, runs

    docker compose -f docker-compose.yml -f deploy/compose/autoscale.yml up -d --no-recreate --scale qkv=N qkv

Scale-down drains: compose stops the replicas it removes with SIGTERM, the balancer takes each out when
its readiness check fails, and qkv answers what it admitted before it exits (QKV_GRACE_PERIOD, within the
compose file's stop_grace_period). --time-scale multiplies every interval, window and period (0.1 runs
the simulation ten times faster); --target replaces the threshold. Each decision is printed as one JSON
line. Needs PyYAML.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCALED_OBJECT = ROOT / "deploy" / "k8s" / "components" / "autoscale-keda" / "scaledobject.yaml"
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "deploy" / "compose" / "autoscale.yml")
TOLERANCE = 0.1  # the HPA's default: no change while the metric is within 10 % of its target
# Replicas share the machine: no fixed host port for any of them (the balancer's ports stay as set).
NO_HOST_PORTS = {"QKV_HTTP_HOST_PORT": "", "QKV_GRPC_HOST_PORT": "", "QKV_METRICS_HOST_PORT": ""}


@dataclass(frozen=True)
class Policy:
    """At most `pods` replicas added (or removed) within any `period` seconds."""

    pods: int
    period: float


@dataclass(frozen=True)
class Rule:
    """The autoscaling rule: a query, its per-replica target, bounds and the HPA's behaviour."""

    query: str
    target: float  # the query's value per replica that the rule keeps (KEDA's threshold, the HPA's averageValue)
    min_replicas: int
    max_replicas: int
    interval: float  # seconds between decisions (KEDA's pollingInterval)
    up_window: float = 0.0  # stabilisation: scale up to the lowest recommendation of this window
    down_window: float = 300.0  # scale down to the highest recommendation of this window
    up_policies: tuple[Policy, ...] = ()
    down_policies: tuple[Policy, ...] = ()
    tolerance: float = TOLERANCE

    def scaled(self, factor: float) -> Rule:
        """The same rule with every interval, window and period multiplied by `factor`."""
        return replace(
            self,
            interval=self.interval * factor,
            up_window=self.up_window * factor,
            down_window=self.down_window * factor,
            up_policies=tuple(Policy(p.pods, p.period * factor) for p in self.up_policies),
            down_policies=tuple(Policy(p.pods, p.period * factor) for p in self.down_policies),
        )


@dataclass(frozen=True)
class Memory:
    """What the rule remembers between decisions: its recent recommendations and scale events."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time, replicas the metric asked for)
    events: tuple[tuple[float, int], ...] = ()  # (time, replicas added; negative: removed)


@dataclass(frozen=True)
class Decision:
    replicas: int
    recommended: int  # what the metric alone asks for, before stabilisation, policies and bounds
    memory: Memory = field(repr=False)


def recommend(rule: Rule, current: int, value: float) -> int:
    """The replicas the metric asks for: ceil(current x (value / current) / target), i.e. ceil(value /
    target) for the summed query, unless value per replica is within the tolerance of the target."""
    if current <= 0:
        return rule.min_replicas
    ratio = value / (rule.target * current)  # the mean per replica over the target
    if abs(ratio - 1.0) <= rule.tolerance:
        return current
    return math.ceil(round(ratio * current, 9))  # rounded: 2.0000000001 from float division is 2


def _limit(
    current: int, events: tuple[tuple[float, int], ...], now: float, policies: tuple[Policy, ...], up: bool
) -> int:
    """The most (up) or fewest (down) replicas the rate policies allow now; the most permissive policy
    applies (the HPA's selectPolicy: Max)."""
    if not policies:
        return sys.maxsize if up else 0
    limits = []
    for p in policies:
        moved = sum(d for t, d in events if t > now - p.period and (d > 0) == up)
        start = current - moved  # the replicas at the start of the period
        limits.append(start + p.pods if up else start - p.pods)
    return max(limits) if up else min(limits)


def decide(rule: Rule, memory: Memory, now: float, current: int, value: float) -> Decision:
    """The replicas to run now, given the query's `value` with `current` replicas running, as the HPA
    decides: the recommendation, stabilised over the windows (up to the lowest of the up-window, down
    to the highest of the down-window), limited by the rate policies, within the bounds."""
    recommended = recommend(rule, current, value)
    keep = max(rule.up_window, rule.down_window)
    recommendations = (*((t, r) for t, r in memory.recommendations if t > now - keep), (now, recommended))
    up_to = min(r for t, r in recommendations if t >= now - rule.up_window)
    down_to = max(r for t, r in recommendations if t >= now - rule.down_window)
    desired = min(max(current, up_to), down_to)
    if desired > current:
        desired = min(desired, _limit(current, memory.events, now, rule.up_policies, up=True))
    elif desired < current:
        desired = max(desired, _limit(current, memory.events, now, rule.down_policies, up=False))
    desired = min(max(desired, rule.min_replicas), rule.max_replicas)
    periods = [p.period for p in rule.up_policies + rule.down_policies] or [0.0]
    events = tuple((t, d) for t, d in memory.events if t > now - max(periods))
    if desired != current:
        events += ((now, desired - current),)
    return Decision(desired, recommended, Memory(recommendations, events))


def _policies(behaviour: dict[str, Any]) -> tuple[Policy, ...]:
    out = []
    for p in behaviour.get("policies", []):
        if p["type"] != "Pods":
            raise ValueError(f"only Pods policies are simulated, not {p['type']}")
        out.append(Policy(int(p["value"]), float(p["periodSeconds"])))
    return tuple(out)


def rule_from_scaled_object(path: Path = SCALED_OBJECT) -> Rule:
    """The rule as the KEDA ScaledObject states it (its one Prometheus trigger, AverageValue)."""
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))["spec"]
    [trigger] = [t for t in spec["triggers"] if t["type"] == "prometheus"]
    if trigger.get("metricType") != "AverageValue":
        raise ValueError(f"{path}: the simulation reads an AverageValue trigger, not {trigger.get('metricType')}")
    behaviour = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
    up, down = behaviour.get("scaleUp", {}), behaviour.get("scaleDown", {})
    return Rule(
        query=trigger["metadata"]["query"],
        target=float(trigger["metadata"]["threshold"]),
        min_replicas=int(spec.get("minReplicaCount", 0)),
        max_replicas=int(spec.get("maxReplicaCount", 100)),
        interval=float(spec.get("pollingInterval", 30)),
        up_window=float(up.get("stabilizationWindowSeconds", 0)),
        down_window=float(down.get("stabilizationWindowSeconds", 300)),
        up_policies=_policies(up),
        down_policies=_policies(down),
    )


def query(prometheus: str, expr: str, timeout: float = 5.0) -> float | None:
    """The query's one value now, or None where it has none (no replica scraped yet)."""
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        result = json.load(answer)["data"]["result"]
    if not result:
        return None
    if len(result) != 1:
        raise ValueError(f"the query gives {len(result)} series, not one: {expr}")
    return float(result[0]["value"][1])


class Compose:
    """The simulation's compose project: its running replicas, and `up --scale`."""

    def __init__(self, command: list[str], project: str, service: str = "qkv") -> None:
        self.command, self.project, self.service = [*command, "-p", project], project, service
        self.env = {**os.environ, **NO_HOST_PORTS}

    def replicas(self) -> int:
        """The service's running containers (asked of the engine: quicker than compose's own `ps`)."""
        labels = (f"com.docker.compose.project={self.project}", f"com.docker.compose.service={self.service}")
        docker = shutil.which("docker") or "docker"
        filters = [arg for label in labels for arg in ("--filter", f"label={label}")]
        return len(self._run([docker, "ps", "-q", *filters]).split())

    def scale(self, replicas: int) -> None:
        self._run([*self.command, "up", "-d", "--no-recreate", "--scale", f"{self.service}={replicas}", self.service])

    def _run(self, cmd: list[str], timeout: float = 300) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc.stdout


def project_name(given: str | None) -> str:
    """The compose project: -p, else COMPOSE_PROJECT_NAME, else the checkout's directory name, as compose
    normalises them."""
    return re.sub(r"[^-_a-z0-9]", "", (given or os.environ.get("COMPOSE_PROJECT_NAME") or ROOT.name).lower())


def default_compose() -> list[str]:
    """`docker compose` where the plugin is there, else docker-compose; with the simulation's files."""
    files = [arg for f in COMPOSE_FILES for arg in ("-f", str(f))]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose", *files]
    return [shutil.which("docker-compose") or "docker-compose", *files]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus' base URL")
    p.add_argument("--scaled-object", type=Path, default=SCALED_OBJECT, help="the ScaledObject the rule is read from")
    p.add_argument("--target", type=float, help="the per-replica target, in place of the trigger's threshold")
    p.add_argument("--min-replicas", type=int, help="in place of the ScaledObject's minReplicaCount")
    p.add_argument("--max-replicas", type=int, help="in place of the ScaledObject's maxReplicaCount")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies every interval, window and period")
    p.add_argument("--project-name", "-p", help="the compose project")
    p.add_argument(
        "--compose", help="the compose command with its -f files (default: docker compose, or docker-compose)"
    )
    p.add_argument("--seconds", type=float, help="stop after this long (default: run until interrupted)")
    args = p.parse_args(argv)

    rule = rule_from_scaled_object(args.scaled_object).scaled(args.time_scale)
    overrides = {"target": args.target, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas}
    rule = replace(rule, **{k: v for k, v in overrides.items() if v is not None})
    compose = Compose(shlex.split(args.compose) if args.compose else default_compose(), project_name(args.project_name))
    memory = Memory()
    end = time.monotonic() + args.seconds if args.seconds else math.inf
    print(json.dumps({"rule": {"query": rule.query, "target": rule.target, "min": rule.min_replicas,
                               "max": rule.max_replicas, "interval": rule.interval,
                               "down_window": rule.down_window}}), flush=True)  # fmt: skip
    while time.monotonic() < end:
        started = time.monotonic()
        current = compose.replicas()
        try:
            value = query(args.prometheus, rule.query)
        except (OSError, ValueError) as e:
            value, error = None, str(e)
        else:
            error = "" if value is not None else "no value"
        if value is None:  # KEDA with ignoreNullValues false: an error, and the replicas stay as they are
            print(json.dumps({"time": time.time(), "current": current, "error": error}), flush=True)
        else:
            decision = decide(rule, memory, time.monotonic(), current, value)
            memory = decision.memory
            line = {"current": current, "value": value, "recommended": decision.recommended}
            print(json.dumps({"time": time.time(), **line, "replicas": decision.replicas}), flush=True)
            if decision.replicas != current:
                compose.scale(decision.replicas)
        time.sleep(max(0.0, rule.interval - (time.monotonic() - started)))


if __name__ == "__main__":
    main()
