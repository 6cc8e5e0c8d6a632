"""The shipped Python client (sync, asyncio, retry) and the qkv commands against a real server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from service.tools.client import AsyncClient, Client, health_check
from tests.conftest import ROOT, RunningServer, start_server, stop_server


def qkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_sync_and_async_clients_agree(server: RunningServer) -> None:
    with Client(server.url, timeout=10) as c:
        sync = c.g2p(["hello", "world"])
        assert c.ready()

    async def run() -> list[str]:
        async with AsyncClient(server.url, timeout=10) as c:
            return await c.g2p(["hello", "world"])

    assert asyncio.run(run()) == sync and len(sync) == 2


def test_deadline_is_enforced(server: RunningServer) -> None:
    with Client(server.url) as c, pytest.raises(grpc.RpcError) as e:
        c.g2p(["supercalifragilistic"] * 60, timeout=0.001, lexicon=False)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_client_retries_until_a_restarting_server_is_back(tmp_path: Path) -> None:
    """UNAVAILABLE (nothing listening yet) is retried with backoff within the deadline."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    holder: list[RunningServer] = []

    def start_late() -> None:
        time.sleep(1.0)
        holder.append(start_server(["--grpc-port", str(port)], tmp_path / "log"))

    t = threading.Thread(target=start_late)
    t.start()
    try:
        # a deadline far beyond a server's start on a loaded machine: only a client that stops retrying fails
        with Client(f"127.0.0.1:{port}", timeout=300) as c:
            assert len(c.g2p(["hello"])) == 1
    finally:
        t.join()
        for s in holder:
            stop_server(s)


def test_qkv_infer_health_and_attention(server: RunningServer, tmp_path: Path) -> None:
    out = qkv("infer", "--url", server.url, "--model", "g2p", "hello", "world")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["hello", "world"]
    js = qkv("infer", "--url", server.url, "--json", "hello world")
    assert json.loads(js.stdout)[0]["phonemes"].count(" | ") == 1
    assert json.loads(js.stdout)[0]["model_version"] == "2"  # the newest, unless one is named
    one = qkv("infer", "--url", server.url, "--json", "--model-version", "1", "hello")
    assert json.loads(one.stdout)[0]["model_version"] == "1"
    gone = qkv("infer", "--url", server.url, "--model-version", "7", "hello")
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr and "version '7'" in gone.stderr
    bad = qkv("infer", "--url", server.url, "h\x1bllo")  # a control character: not text a person writes
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    assert qkv("health", "--url", server.url).stdout.strip() == "SERVING"
    assert qkv("health", "--url", server.url, "--service", "g2p").returncode == 0
    nope = qkv("health", "--url", server.url, "--service", "nope")
    assert nope.returncode == 1 and nope.stderr.strip() == "qkv health: NOT_FOUND: the server has no service 'nope'"
    png = tmp_path / "attention.png"
    att = qkv("attention", "attention", "--url", server.url, "--out", str(png))
    assert att.returncode == 0, att.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert health_check(server.url) == "SERVING"


def test_serve_flags_and_environment(tmp_path: Path) -> None:
    s = start_server([], tmp_path / "log", env={"QKV_GRACE_PERIOD": "3.5", "QKV_ACCESS_LOG": "1"})
    try:
        with Client(s.url) as c:
            c.g2p(["hello"])
    finally:
        stop_server(s)
    text = s.output()
    assert "grace_period=3.5" in text and "access_log=True" in text
    line = next(json.loads(x) for x in text.splitlines() if x.startswith("{"))
    assert line["model"] == "g2p" and line["code"] == "OK" and line["seq_len"] == 5


def test_client_retries_refusals_that_carry_a_pushback_hint(tmp_path: Path) -> None:
    """A tiny queue refuses most of a burst; the client waits out the hint and every call succeeds."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from service import protocol
    from service.tools.client import g2p_request
    from tests.conftest import MODELS

    repo = tmp_path / "models"
    shutil.copytree(MODELS, repo)
    config = json.loads((repo / "g2p" / "config.json").read_text())
    config["batching"] = {"max_queue_requests": 2}
    (repo / "g2p" / "config.json").write_text(json.dumps(config))
    s = start_server(["--model-repository", str(repo)], tmp_path / "log")
    try:
        with grpc.insecure_channel(s.url) as ch:  # saturate once, so the server has measured its rate
            stub = protocol.Stub(ch)
            decoded = g2p_request(["transformer"] * 8, lexicon=False)  # decoded, not looked up: work to queue
            futures = [stub.ModelInfer.future(decoded, timeout=30) for _ in range(30)]
            codes = {f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures}
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        with Client(s.url, timeout=60) as c, ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: c.g2p(["transformer"] * 8, lexicon=False), range(40)))
        assert len(results) == 40 and all(len(r) == 8 for r in results)
    finally:
        stop_server(s)
