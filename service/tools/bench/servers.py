"""Servers for `qkv bench`: repository variants, servers taking turns, and what they cost.

`variant` copies the repository with settings changed, `Servers` starts and stops servers on such
copies, `take_turns` alternates them and `paired_ratio` compares them round by round. Then what a
server reports or spends: its metrics (`scrape`, `padding_share`), its CPU time, and the bare
RPC's own cost on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from service import protocol
from service.repository.layout import available_versions
from service.tools import loadgen
from service.tools.process import ServerProcess, start_server, stop_server

__all__ = [
    "ROUNDS",
    "Measure",
    "Servers",
    "bare_rpc",
    "cpus",
    "median_of",
    "padding_share",
    "paired_ratio",
    "process_cpu",
    "scrape",
    "take_turns",
    "variant",
]


def scrape(metrics_url: str) -> dict[str, float]:
    """Prometheus text -> {series: value} (enough for counters)."""
    out = {}
    for line in urllib.request.urlopen(metrics_url, timeout=30).read().decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def padding_share(metrics_url: str, model: str) -> float:
    """The padded share of the tokens `model`'s batches computed so far, from the server's metrics."""
    m = scrape(metrics_url)
    real = m.get(f'qkv_batch_tokens_total{{kind="real",model="{model}"}}', 0.0)
    pad = m.get(f'qkv_batch_tokens_total{{kind="padding",model="{model}"}}', 0.0)
    return pad / (real + pad) if real + pad else float("nan")


def variant(models: Path, into: Path, changes: dict[str, dict[str, Any]]) -> Path:
    """A copy of the repository (graphs linked, not copied) with config.json settings changed."""
    for model_dir in models.iterdir():
        if not model_dir.is_dir():
            continue
        target = into / model_dir.name
        for version in map(str, available_versions(model_dir)):
            (target / version).mkdir(parents=True)
            for f in (model_dir / version).iterdir():
                (target / version / f.name).symlink_to(f.resolve())
        config = json.loads((model_dir / "config.json").read_text())
        for key, value in changes.get(model_dir.name, {}).items():
            if isinstance(value, dict) and key != "version_policy":  # a policy is one of three: replaced
                config.setdefault(key, {}).update(value)
            else:
                config[key] = value
        (target / "config.json").write_text(json.dumps(config))
    return into


class Servers:
    """Start servers on repository variants; stop them all at the end."""

    def __init__(self, models: Path, scratch: Path) -> None:
        self.models, self.scratch = models, scratch
        self.running: list[ServerProcess] = []
        self.count = 0

    def start(self, changes: dict[str, dict[str, Any]] | None = None, extra: list[str] | None = None) -> ServerProcess:
        self.count += 1
        repo = self.models if not changes else variant(self.models, self.scratch / f"repo{self.count}", changes)
        s = start_server(["--model-repository", str(repo), *(extra or [])], self.scratch / f"server{self.count}.log")
        self.running.append(s)
        return s

    def stop(self, s: ServerProcess) -> None:
        stop_server(s)
        self.running.remove(s)

    def close(self) -> None:
        for s in list(self.running):
            self.stop(s)


ROUNDS = 3  # the sections that compare two settings run each this many times, alternating
Measure = Callable[[ServerProcess, str, str], dict[str, Any]]  # (server, variant, label) -> figures


def take_turns(
    servers: Servers,
    variants: dict[str, tuple[dict[str, dict[str, Any]] | None, list[str] | None]],
    measure: Measure,
    rounds: int = ROUNDS,
) -> dict[str, dict[str, Any]]:
    """Each variant's server `rounds` times, the variants alternating; per variant, the median of each
    figure over its rounds (the rounds themselves under "rounds"). This VM's speed drifts within
    minutes, so one run of A then one of B compares two moments as much as two settings: compare
    with `paired_ratio`."""
    by: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, (changes, extra) in variants.items():
            s = servers.start(changes, extra)
            try:
                by[name].append(measure(s, name, f"{name} {r + 1}/{rounds}"))
            finally:
                servers.stop(s)
    return {name: median_of(runs) for name, runs in by.items()}


def paired_ratio(turns: dict[str, dict[str, Any]], a: str, b: str, figure: str) -> float:
    """The median over rounds of a's figure / b's: each pair ran back to back, so a drift of the VM's
    speed between rounds cancels in the ratio."""
    pairs = zip(turns[a]["rounds"], turns[b]["rounds"], strict=True)
    return float(np.median([x[figure] / y[figure] for x, y in pairs]))


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number of the runs' figures, its median over them; the runs themselves under "rounds"."""
    numbers = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {**{k: float(np.median([x[k] for x in runs])) for k in numbers}, "rounds": runs}


def process_cpu(pid: int) -> float:
    """CPU seconds a process has used so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bare_rpc(url: str, pid: int, concurrency: int = 16, n: int = 4000) -> dict[str, float]:
    """ServerLive, Python gRPC's own floor (no decoding, no model), which every served request pays on
    top of its compute: the p50 round trip one call at a time, then CPU per call, server and load
    generator, at `concurrency`."""

    async def run() -> dict[str, float]:
        async with grpc.aio.insecure_channel(url) as ch:
            stub, request = protocol.Stub(ch), protocol.ServerLiveRequest()

            async def worker(calls: int, times: list[float] | None = None) -> None:
                for _ in range(calls):
                    t0 = time.perf_counter()
                    await stub.ServerLive(request, timeout=5)
                    if times is not None:
                        times.append(time.perf_counter() - t0)

            await worker(200)  # warm
            alone: list[float] = []
            await worker(500, alone)
            server0, client0, t0 = process_cpu(pid), loadgen.own_cpu(), time.perf_counter()
            await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
            calls = n // concurrency * concurrency
            return {
                "round_trip_p50_ms": float(np.median(alone)) * 1e3,
                "server_cpu_us": (process_cpu(pid) - server0) / calls * 1e6,
                "client_cpu_us": (loadgen.own_cpu() - client0) / calls * 1e6,
                "rps": calls / (time.perf_counter() - t0),
            }

    return asyncio.run(run())


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))
