"""The deploy path for real: the image built by docker-compose.yml with no build arguments, the stack
of qkv and Prometheus started from it, and qkv answered, scraped, stopped, crashed and scaled out in
containers.

Needs a Docker engine (tests/deploy/docker_engine.sh starts one for `make test`). Base images that no
registry provides here are built by deploy/docker/offline-bases.sh under the very tags the Dockerfile
and the compose file name, so both are used unchanged. With CI=true a missing engine fails these
tests; elsewhere they skip, saying why. Figures (image size, build and start times, requests sent,
answered and lost) are printed in the test summary.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as g
from deploy_helpers import COMPOSE, PROMETHEUS, ROOT, RUN_LABEL, load_yaml, ok, run, run_name, tool

from tests.conftest import RunningServer
from tests.figures import FIGURES as ALL_FIGURES
from tests.service.test_protocol import encoder_inputs, text_input

pytestmark = pytest.mark.slow

FIGURES = ALL_FIGURES.setdefault("docker compose stack", {})  # printed in the run's summary
WORDS = ["attention", "is", "all", "you", "need", "docker", "compose", "replica", "prometheus"]
DRAINING = "shutting down"  # the server's UNAVAILABLE message while it drains
NO_SERVER = ("failed to connect to all addresses", "DNS resolution failed")  # never reached a server
LOAD_SCRIPT = ROOT / "tests" / "deploy" / "stack_load.py"


# Each an empty compose variable: a free host port, so that replicas and other stacks do not collide.
FREE_HOST_PORTS = ("QKV_HTTP_HOST_PORT", "QKV_GRPC_HOST_PORT", "QKV_METRICS_HOST_PORT", "PROMETHEUS_HOST_PORT")


def _engine() -> None:
    """The tests need a Docker engine: fail without one in CI, skip elsewhere."""
    docker = shutil.which("docker")
    if docker and run([docker, "info", "--format", "{{.ServerVersion}}"], timeout=30).returncode == 0:
        return
    why = "no Docker engine answers (`docker info` failed); tests/deploy/docker_engine.sh starts one"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI: {why}", pytrace=False)
    pytest.skip(why)


def _seconds(stamp: str) -> float:
    """Docker's RFC 3339 time (nanoseconds) as a Unix time."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0"))


@dataclass
class Stack:
    """One compose project of the repository's own docker-compose.yml, on ephemeral host ports."""

    project: str
    env: dict[str, str] = field(default_factory=dict)
    started: dict[str, Any] = field(default_factory=dict)  # each first container's state once qkv was healthy

    def compose(self, *args: str, timeout: float = 300) -> str:
        proc = run(
            [tool("docker-compose"), "-p", self.project, "-f", str(COMPOSE), *args], env=self.env, timeout=timeout
        )
        ok(proc)
        return proc.stdout

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        proc = run([tool("docker"), *args], timeout=timeout)
        if check:
            ok(proc)
        return proc.stdout

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def remove(self, *images: str) -> None:
        """This run's containers (by RUN_LABEL, none of anyone else's), the project, and `images`."""
        for c in self.docker("ps", "-aq", "--filter", f"label={RUN_LABEL}").split():
            self.docker("rm", "-f", c, check=False)
        self.compose("down", "-v", "--remove-orphans")
        for image in images:
            self.docker("image", "rm", image, check=False)

    def inspect(self, container: str) -> dict[str, Any]:
        return dict(json.loads(self.docker("inspect", container))[0])

    def address(self, service: str, port: int) -> str:
        """host:port where the service's container port is published."""
        return self.compose("port", service, str(port)).strip()

    def wait_healthy(self, service: str, replicas: int = 1, timeout: float = 120) -> float:
        """Seconds until `replicas` containers of `service` are healthy."""
        start = time.monotonic()
        while True:
            states = [self.inspect(c)["State"] for c in self.containers(service)]
            healthy = [s for s in states if s.get("Health", {}).get("Status") == "healthy"]
            if len(healthy) >= replicas:
                return time.monotonic() - start
            assert time.monotonic() - start < timeout, f"{service} not healthy after {timeout} s: {states}"
            time.sleep(0.5)

    def ensure_up(self) -> None:
        self.compose("up", "-d", "--no-recreate", "--scale", "qkv=1", "qkv", "prometheus")
        self.wait_healthy("qkv")

    def image(self) -> str:
        return f"qkv:{self.env['QKV_TAG']}"

    def start_load(self, *args: str) -> str:
        """The load script in a container of the qkv image on the stack's network; returns its id."""
        return self.docker(
            "run", "-d", "--label", "org.qkv.test=true", "--label", RUN_LABEL, "--network", f"{self.project}_default",
            "--entrypoint", "python", "-v", f"{LOAD_SCRIPT}:/stack_load.py:ro", self.image(),
            "/stack_load.py", *args,
        ).strip()  # fmt: skip

    def load_result(self, container: str, timeout: float = 120) -> dict[str, Any]:
        code = self.docker("wait", container, timeout=timeout).strip()
        out = self.docker("logs", container)
        err = run([tool("docker"), "logs", container]).stderr
        self.docker("rm", container)
        assert code == "0", f"load client exited {code}:\n{err[-3000:]}"
        return dict(json.loads(out))


def offline_start() -> tuple[str, list[str]]:
    """The README's one-line offline start: the stand-in script, and docker-compose's arguments."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    [line] = [x for x in readme.splitlines() if x.startswith("deploy/docker/offline-bases.sh && docker-compose ")]
    bases, compose = (part.strip() for part in line.split("#")[0].split("&&"))
    return bases, compose.split()[1:]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    _engine()
    s = Stack(
        run_name("qkvt"),
        {
            "DOCKER_BUILDKIT": "0",  # the classic builder: BuildKit's frontend image comes from a registry
            "COMPOSE_DOCKER_CLI_BUILD": "0",
            "QKV_TAG": run_name("test"),
            **{
                v: ""
                for v in ("QKV_HTTP_HOST_PORT", "QKV_GRPC_HOST_PORT", "QKV_METRICS_HOST_PORT", "PROMETHEUS_HOST_PORT")
            },
        },
    )
    # The README's offline start, as written: the stand-in base images, then `docker-compose up ...`.
    bases, up = offline_start()
    start = time.monotonic()
    ok(run(["bash", str(ROOT / bases)], timeout=900))
    FIGURES["stand-in base images"] = f"{time.monotonic() - start:.1f} s"
    try:
        start = time.monotonic()
        s.compose(*up, timeout=900)
        s.wait_healthy("qkv")
        # Docker keeps a container's last five health checks: the first ones are read now, not when a test runs.
        s.started = {service: s.inspect(c)["State"] for service in ("qkv", "prometheus") for c in s.containers(service)}
        FIGURES["build and up -> qkv healthy"] = f"{time.monotonic() - start:.1f} s"
        size = int(s.docker("image", "inspect", "-f", "{{.Size}}", s.image()).strip())
        FIGURES["image size"] = f"{size / 1e6:.0f} MB"
        yield s
    finally:
        s.remove(s.image())


def test_image_builds_with_no_build_arguments(stack: Stack) -> None:
    config = stack.inspect(stack.image())["Config"]
    assert config["User"] == "10001:10001"
    assert not any(e.startswith("SOURCE_DATE_EPOCH") for e in config["Env"]), config["Env"]
    assert config["Entrypoint"] == ["qkv"] and config["Cmd"] == ["serve"]
    assert "qkv health" in " ".join(config["Healthcheck"]["Test"])


def test_stack_starts_in_health_gated_order(stack: Stack) -> None:
    stack.ensure_up()
    stack.wait_healthy("prometheus")
    health = stack.started["qkv"]["Health"]
    assert health["Status"] == "healthy"
    # Prometheus was started only after qkv's own HEALTHCHECK first passed.
    first_pass = min(_seconds(h["End"]) for h in health["Log"] if h["ExitCode"] == 0)
    assert _seconds(stack.started["prometheus"]["StartedAt"]) >= first_pass


def _answers(url: str) -> dict[str, Any]:
    """What a server answers over gRPC: g2p and the encoder, unary, and g2p on one stream."""
    client = g.InferenceServerClient(url)
    out: dict[str, Any] = {}
    result = client.infer("g2p", [text_input(WORDS)], outputs=[g.InferRequestedOutput("PHONEMES")])
    out["unary"] = list(result.as_numpy("PHONEMES"))
    ids = np.arange(4, 4 + 3 * 17, dtype=np.int64).reshape(3, 17) % 33
    out["encoder"] = client.infer("g2p_encoder", encoder_inputs(ids)).as_numpy("last_hidden_state")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, word in enumerate(WORDS):
            client.async_stream_infer("g2p", [text_input([word])], request_id=str(i))
        got = [answers.get(timeout=30) for _ in WORDS]
    finally:
        client.stop_stream()
    assert [e for _, e in got if e is not None] == []
    by_id = {r.get_response().id: r.as_numpy("PHONEMES")[0] for r, _ in got}
    out["stream"] = [by_id[str(i)] for i in range(len(WORDS))]
    client.close()
    return out


def test_answers_through_the_published_port_equal_a_local_servers(stack: Stack, server: RunningServer) -> None:
    stack.ensure_up()
    served, local = _answers(stack.address("qkv", 8001)), _answers(server.url)
    assert served["unary"] == local["unary"] and served["stream"] == local["unary"], (served, local)
    np.testing.assert_allclose(served["encoder"], local["encoder"], atol=1e-5)
    metrics = urllib.request.urlopen(f"http://{stack.address('qkv', 8002)}/metrics", timeout=10).read().decode()
    assert 'qkv_requests_total{code="OK",model="g2p",version="2"}' in metrics
    generate = urllib.request.Request(
        f"http://{stack.address('qkv', 8000)}/v2/models/g2p/generate",
        data=json.dumps({"text_input": f"{WORDS[0]} {WORDS[1]}"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(generate, timeout=10) as answer:  # HTTP/REST through its published port
        assert json.loads(answer.read())["text_output"] == b" | ".join(served["unary"][:2]).decode()


def _exec(stack: Stack, container: str, script: str) -> tuple[int, str]:
    proc = run([tool("docker"), "exec", container, "sh", "-c", script])
    return proc.returncode, proc.stdout + proc.stderr


def test_container_is_unprivileged_and_read_only(stack: Stack) -> None:
    stack.ensure_up()
    [qkv] = stack.containers("qkv")
    host = stack.inspect(qkv)["HostConfig"]
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert "no-new-privileges:true" in host["SecurityOpt"]
    assert _exec(stack, qkv, "id -u; id -g") == (0, "10001\n10001\n")
    # The server itself (PID 1) holds no capability at all.
    code, status = _exec(stack, qkv, "grep -E '^Cap(Eff|Prm)' /proc/1/status")
    assert code == 0 and status.split() == ["CapPrm:", "0" * 16, "CapEff:", "0" * 16], status
    for path in ["/x", "/opt/qkv/models/g2p/x", "/opt/qkv/venv/x", "/etc/x", "/var/tmp/x"]:
        code, out = _exec(stack, qkv, f"touch {path}")
        assert code != 0 and ("Read-only file system" in out or "Permission denied" in out), (path, out)
    assert _exec(stack, qkv, "touch /tmp/x && rm /tmp/x")[0] == 0


def _prometheus(stack: Stack, path: str, **params: str) -> Any:
    url = f"http://{stack.address('prometheus', 9090)}{path}?{urllib.parse.urlencode(params)}"
    return json.load(urllib.request.urlopen(url, timeout=10))["data"]


def _until(what: str, check: Any, timeout: float = 90) -> Any:
    """Poll check() until it returns something true (Prometheus scrapes every 15 s in compose)."""
    end = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except OSError:  # not listening yet
            value = None
        if value:
            return value
        assert time.monotonic() < end, f"{what}: not within {timeout} s"
        time.sleep(1)


def test_prometheus_scrapes_qkv_and_loads_every_rule(stack: Stack) -> None:
    stack.ensure_up()
    stack.wait_healthy("prometheus")
    client = g.InferenceServerClient(stack.address("qkv", 8001))
    for length in (5, 40, 200):  # three seq_len buckets
        ids = np.full((1, length), 7, dtype=np.int64)
        client.infer("g2p_encoder", encoder_inputs(ids))
    client.close()

    def up() -> Any:
        return _prometheus(stack, "/api/v1/query", query='up{job="qkv"} == 1')["result"]

    _until("up{job=qkv} == 1", up)

    def seq_lens() -> set[str]:
        query = 'count by (seq_len) (qkv_request_duration_seconds_bucket{model="g2p_encoder"})'
        found = {r["metric"]["seq_len"] for r in _prometheus(stack, "/api/v1/query", query=query)["result"]}
        return found if {"8", "64", "256"} <= found else set()

    _until("latency histograms by seq_len", seq_lens)
    expected = {
        r.get("record") or r["alert"] for grp in load_yaml(PROMETHEUS / "rules.yml")["groups"] for r in grp["rules"]
    }

    def healthy_rules() -> dict[str, str]:
        rules = {r["name"]: r["health"] for grp in _prometheus(stack, "/api/v1/rules")["groups"] for r in grp["rules"]}
        return rules if set(rules) == expected and set(rules.values()) == {"ok"} else {}

    _until("every rule loaded and evaluated without error", healthy_rules)


def _classify(records: list[list[Any]]) -> Counter[str]:
    """answered / refused (the server's drain refusal, or no server to connect to) / lost."""
    out: Counter[str] = Counter()
    for _, _, code, details in records:
        if code == "OK":
            out["answered"] += 1
        elif code == "UNAVAILABLE" and any(m in details for m in (DRAINING, *NO_SERVER)):
            out["refused"] += 1
        else:
            out["lost"] += 1
            out[f"lost: {code} {details[:80]}"] += 1
    return out


def _until_served(stack: Stack, container: str, requests: int, timeout: float) -> None:
    """Wait until `container` has answered `requests` more g2p requests than now: a load client is sending.
    Its callers run the client at least 5 s longer than `timeout`: whatever the machine's speed, it is still
    sending after."""
    before = _served(stack, container)
    what = f"{requests} g2p requests answered by the load client"
    _until(what, lambda: _served(stack, container) - before >= requests, timeout=timeout)


def test_compose_stop_under_load_answers_or_refuses_every_request(stack: Stack) -> None:
    stack.ensure_up()
    [qkv] = stack.containers("qkv")
    # Each thread stops at its first refusal: the drain (which waits for its clients to go quiet, up to the
    # grace period) then ends with the client, not with the grace period.
    client = stack.start_load("--target", "qkv:8001", "--seconds", "60", "--threads", "4", "--until-refused")
    _until_served(stack, qkv, 100, timeout=45)  # then stopped while the client sends: draining refuses some
    stop_at = time.time()
    stack.compose("stop", "qkv")
    stop_seconds = time.time() - stop_at
    result = stack.load_result(client)
    records = result["records"]
    outcomes = _classify(records)
    in_flight = [r for r in records if r[0] < stop_at < r[1]]
    FIGURES["compose stop under load"] = (
        f"{len(records)} sent, {outcomes['answered']} answered, {outcomes['refused']} refused UNAVAILABLE, "
        f"{outcomes['lost']} lost; {len(in_flight)} in flight at the stop; stop took {stop_seconds:.1f} s"
    )
    assert outcomes["lost"] == 0, outcomes
    assert all(r[2] == "OK" or DRAINING in r[3] for r in in_flight), in_flight
    assert outcomes["answered"] >= 100 and outcomes["refused"] > 0, outcomes
    state = stack.inspect(qkv)["State"]
    assert state["ExitCode"] == 0 and not state["OOMKilled"], state
    grace = float(load_yaml(COMPOSE)["services"]["qkv"]["stop_grace_period"].rstrip("s"))
    assert stop_seconds < grace, f"the stop took {stop_seconds:.1f} s: the engine had to kill the server"

    # With qkv stopped, Prometheus' target-down condition (QkvTargetDown's expression) becomes true.
    [down] = [
        r["expr"]
        for grp in load_yaml(PROMETHEUS / "rules.yml")["groups"]
        for r in grp["rules"]
        if r.get("alert") == "QkvTargetDown"
    ]
    _until("the target-down condition", lambda: _prometheus(stack, "/api/v1/query", query=down)["result"])


def _crash(stack: Stack, container: str) -> None:
    """SIGKILL the container's server from outside, as the kernel's OOM killer would. (`docker kill`
    is an operator's stop: the engine never restarts a container after it.)"""
    os.kill(stack.inspect(container)["State"]["Pid"], signal.SIGKILL)


def test_a_crashed_server_comes_back_and_retrying_clients_lose_nothing(stack: Stack) -> None:
    stack.ensure_up()
    [qkv] = stack.containers("qkv")
    restarts = stack.inspect(qkv)["RestartCount"]
    client = stack.start_load("--target", "qkv:8001", "--seconds", "20", "--threads", "4", "--retry")
    _until_served(stack, qkv, 100, timeout=15)  # then crashed while the client sends
    crashed_at = time.monotonic()
    _crash(stack, qkv)
    _until("the engine restarting qkv", lambda: stack.inspect(qkv)["RestartCount"] > restarts, timeout=30)
    stack.wait_healthy("qkv")
    back = time.monotonic() - crashed_at
    records = stack.load_result(client)["records"]
    codes = Counter(r[2] for r in records)
    FIGURES["crash (SIGKILL) under load"] = (
        f"{len(records)} sent, {codes['OK']} answered, {len(records) - codes['OK']} lost; "
        f"healthy again {back:.1f} s after the kill"
    )
    assert codes == {"OK": len(records)}, codes
    assert len(records) >= 100


def _served(stack: Stack, container: str) -> float:
    """g2p requests a replica answered, from its own /metrics (reached on the bridge network)."""
    ip = next(iter(stack.inspect(container)["NetworkSettings"]["Networks"].values()))["IPAddress"]
    text = urllib.request.urlopen(f"http://{ip}:8002/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("qkv_requests_total{") and 'model="g2p"' in line and 'code="OK"' in line
    )


def test_scale_out_spreads_load_over_replicas_and_survives_a_crash(stack: Stack) -> None:
    stack.ensure_up()
    stack.compose("up", "-d", "--no-recreate", "--scale", "qkv=3", "qkv")
    stack.wait_healthy("qkv", replicas=3)
    replicas = stack.containers("qkv")
    assert len(replicas) == 3
    before = [_served(stack, c) for c in replicas]
    client = stack.start_load(
        "--target", "dns:///qkv:8001", "--seconds", "8", "--threads", "3", "--retry", "--round-robin"
    )
    records = stack.load_result(client)["records"]
    taken = [_served(stack, c) - b for c, b in zip(replicas, before, strict=True)]
    shares = [t / sum(taken) for t in taken]
    FIGURES["scale-out, 3 replicas"] = f"{len(records)} requests; shares " + " / ".join(f"{s:.2f}" for s in shares)
    assert sum(taken) == len(records) and all(r[2] == "OK" for r in records)
    assert all(0.2 <= s <= 0.47 for s in shares), shares

    client = stack.start_load(
        "--target", "dns:///qkv:8001", "--seconds", "12", "--threads", "3", "--retry", "--round-robin"
    )
    time.sleep(4)
    _crash(stack, replicas[1])
    records = stack.load_result(client)["records"]
    codes = Counter(r[2] for r in records)
    FIGURES["scale-out, one replica crashed under load"] = (
        f"{len(records)} sent, {codes['OK']} answered, {len(records) - codes['OK']} lost"
    )
    assert codes == {"OK": len(records)}, codes
    stack.compose("up", "-d", "--no-recreate", "--scale", "qkv=1", "qkv")
