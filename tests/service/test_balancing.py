"""gRPC load balancing across server processes: client-side round_robin, and max connection age."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import grpc

from service import protocol
from service.client import g2p_request
from tests.conftest import start_server, stop_server


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
            grpc.channel_ready_future(ch).result(timeout=10)
            stub = protocol.Stub(ch)
            for _ in range(60):
                stub.ModelInfer(g2p_request(["hello"]), timeout=10)
        counts = [served_requests(s.metrics_url) for s in servers]
        assert sum(counts) == 60
        assert all(c >= 10 for c in counts), counts
    finally:
        for s in servers:
            stop_server(s)


def test_max_connection_age_makes_clients_reconnect(tmp_path: Path) -> None:
    s = start_server(["--max-connection-age", "1", "--grace-period", "1"], tmp_path / "log")
    try:
        states: list[grpc.ChannelConnectivity] = []
        with grpc.insecure_channel(s.url) as ch:
            ch.subscribe(states.append, try_to_connect=True)
            stub = protocol.Stub(ch)
            end = time.monotonic() + 4.5
            answered = 0
            while time.monotonic() < end:
                stub.ModelInfer(g2p_request(["hello"]), timeout=10, wait_for_ready=True)
                answered += 1
                time.sleep(0.05)
            ch.unsubscribe(states.append)
        ready = states.count(grpc.ChannelConnectivity.READY)
        assert answered > 20  # the reconnections cost no request
        assert ready >= 3, states  # a fresh connection about every second
    finally:
        stop_server(s)
