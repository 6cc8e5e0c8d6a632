"""gRPC load balancing across server processes: client-side round_robin, and max connection age."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import grpc

from service import protocol
from service.tools.client import g2p_request
from tests.conftest import start_server, stop_server

WAIT = 60.0  # the longest a connection or an answer is waited for


def served_requests(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("qkv_requests_total{") and 'model="g2p"' in line
    )


def test_round_robin_client_spreads_over_several_servers(tmp_path: Path) -> None:
    servers = [start_server([], tmp_path / f"log{i}") for i in range(3)]
    try:
        target = "ipv4:" + ",".join(s.url for s in servers)
        config = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
        with grpc.insecure_channel(target, options=[("grpc.service_config", config)]) as ch:
            grpc.channel_ready_future(ch).result(timeout=WAIT)
            stub = protocol.Stub(ch)
            # round_robin uses a server once its connection is up: until then the others take its turns
            deadline = time.monotonic() + WAIT
            while min(served_requests(s.metrics_url) for s in servers) == 0:
                assert time.monotonic() < deadline, f"round_robin did not reach all 3 servers within {WAIT:g} s"
                stub.ModelInfer(g2p_request(["hello"]), timeout=WAIT)
            before = [served_requests(s.metrics_url) for s in servers]
            for _ in range(60):
                stub.ModelInfer(g2p_request(["hello"]), timeout=WAIT)
        counts = [served_requests(s.metrics_url) - b for s, b in zip(servers, before, strict=True)]
        assert sum(counts) == 60
        assert all(c >= 10 for c in counts), counts
    finally:
        for s in servers:
            stop_server(s)


def test_max_connection_age_makes_clients_reconnect(tmp_path: Path) -> None:
    # A connection is closed at 1 s of age; the calls on it have the grace period to finish (a busy machine
    # may take seconds over one).
    s = start_server(["--max-connection-age", "1", "--grace-period", "30"], tmp_path / "log")
    try:
        states: list[grpc.ChannelConnectivity] = []
        answered = after_two_reconnections = 0
        with grpc.insecure_channel(s.url) as ch:
            ch.subscribe(states.append, try_to_connect=True)
            stub = protocol.Stub(ch)
            deadline = time.monotonic() + WAIT
            # Requests until one is answered after the client's third connection came up: each connection is
            # closed at its age (1 s) and the client reconnects; every request is answered (one that failed
            # would raise here), whichever connection it started or ended on.
            while not after_two_reconnections:
                assert time.monotonic() < deadline, f"no third connection within {WAIT:g} s: {states}"
                stub.ModelInfer(g2p_request(["hello"]), timeout=WAIT, wait_for_ready=True)
                answered += 1
                after_two_reconnections += states.count(grpc.ChannelConnectivity.READY) >= 3
                time.sleep(0.05)
            ch.unsubscribe(states.append)
        assert states.count(grpc.ChannelConnectivity.READY) >= 3 and answered >= 2, (answered, states)
    finally:
        stop_server(s)
