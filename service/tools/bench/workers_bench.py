"""`qkv bench --workers`: one server process against 2 and `auto` worker processes (`qkv serve --workers`), on
the small and medium zoo encoders at sequence lengths 16 and 64, and on g2p (one word a request).

The three servers run at once on one repository; each cell is measured in slices that alternate between them,
so that every ratio compares figures from the same seconds. The load comes over CONNECTIONS gRPC connections
(a connection stays with the worker it reached, so one connection would measure one worker): c32 requests/s,
and c1's p50 over the same connections. The RSS, PSS and USS of each server's processes (a worker's, or the
one process's) are read from /proc/PID/smaps_rollup once the servers are up.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from service import protocol
from service.tools import loadgen
from service.tools.bench.load import held_out_words, words_maker
from service.tools.bench.servers import Servers
from service.tools.bench.zoo import ZOO, write_zoo
from service.tools.bench.zoo_bench import _maker

__all__ = ["workers_benchmark", "workers_table"]

WORKERS = ("1", "2", "auto")
MODELS = ("zoo_small", "zoo_medium")
LENGTHS = (16, 64)
CONCURRENCY = (1, 32)
CONNECTIONS = 8  # at least a few a worker: the kernel spreads connections, not requests
SLICES = 4


async def _closed_loop(url: str, make: loadgen.MakeRequest, concurrency: int, seconds: float) -> loadgen.Run:
    """`concurrency` callers, each sending its next request once answered, over CONNECTIONS connections."""
    run = loadgen.Run()
    t0 = time.perf_counter()
    stop = t0 + seconds
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection each, not one shared by the channels
    channels = [grpc.aio.insecure_channel(url, options=options) for _ in range(min(CONNECTIONS, concurrency * 8))]
    stubs = [protocol.Stub(c) for c in channels]
    counter = iter(range(1 << 62))

    async def caller(k: int) -> None:
        stub = stubs[k % len(stubs)]
        while True:
            request, seq_len, tag = make(next(counter))
            started = time.perf_counter()
            try:
                await stub.ModelInfer(request, timeout=30.0)
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            run.samples.append(loadgen.Sample(seq_len, time.perf_counter() - started, code, tag))
            if time.perf_counter() >= stop:
                return

    client, machine = loadgen.own_cpu(), loadgen.machine_cpu()
    try:
        await asyncio.gather(*(caller(k) for k in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    run.wall = time.perf_counter() - t0
    run.client_cpu, run.machine_cpu = loadgen.own_cpu() - client, loadgen.machine_cpu() - machine
    return run


def _memory(pid: int) -> dict[str, float]:
    """MiB of RSS, PSS and USS (private clean + dirty) of process `pid`."""
    values: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        parts = line.split()
        values[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return {"rss": values["Rss"], "pss": values["Pss"], "uss": values["Private_Clean"] + values["Private_Dirty"]}


def _processes(pid: int) -> list[int]:
    """A server's serving processes: its workers (a supervisor's children), or itself."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(p) for p in children.read_text().split()] if children.exists() else []
    return found or [pid]


def workers_benchmark(models: Path, out: Path, seconds: float = 4.0) -> dict[str, Any]:
    """Every cell on 1, 2 and auto workers; writes workers.json and workers.md."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="qkv-workers-bench-"))
    zoo = [m for m in ZOO if m.name in MODELS]
    repo = write_zoo(scratch / "repo", zoo)
    shutil.copytree(models / "g2p", repo / "g2p")
    words = held_out_words()
    cells: list[tuple[str, int, loadgen.MakeRequest]] = [(m.name, n, _maker(m, n)) for m in zoo for n in LENGTHS]
    cells.append(("g2p", 0, words_maker(words, 1)))
    servers = Servers(repo, scratch)
    results: dict[str, Any] = {}
    try:
        running = {w: servers.start(None, ["--workers", w]) for w in WORKERS}
        results["memory"] = {w: [_memory(p) for p in _processes(s.process.pid)] for w, s in running.items()}
        for name, length, make in cells:
            cell: dict[str, Any] = {"model": name, "length": length}
            for c in CONCURRENCY:
                runs = {w: loadgen.Run() for w in running}
                slice_s = (seconds if c > 1 else seconds / 2) / SLICES
                for i in range(SLICES):
                    for w in list(running)[:: 1 if i % 2 == 0 else -1]:
                        runs[w].add(asyncio.run(_closed_loop(running[w].url, make, c, slice_s)))
                for w, run in runs.items():
                    cell[f"{w} c{c}"] = loadgen.summarise(run)
            results[f"{name} {length}"] = cell
    finally:
        servers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    (out / "workers.json").write_text(json.dumps(results, indent=2, default=float))
    (out / "workers.md").write_text(workers_table(results))
    return results


def _each(values: list[float], spec: str) -> str:
    """One figure for each worker count: "a / b / c"."""
    return " / ".join(format(v, spec) for v in values)


def workers_table(results: dict[str, Any]) -> str:
    """c32 requests/s and c1 p50 on each worker count, and the ratios to one process; then memory."""
    cells = [c for c in results.values() if isinstance(c, dict) and "model" in c]
    lines = [
        "| model | length | c32 req/s 1 / 2 / auto | c32 2 vs 1 | c32 auto vs 1 | c1 p50 ms 1 / 2 / auto |",
        "|---|---|---|---|---|---|",
    ]
    for cell in cells:
        rps = [cell[f"{w} c32"]["rps"] for w in WORKERS]
        p50 = [cell[f"{w} c1"]["p50_ms"] for w in WORKERS]
        lines.append(
            f"| {cell['model']} | {cell['length'] or '-'} | {_each(rps, '.0f')} "
            f"| {rps[1] / rps[0]:.2f}x | {rps[2] / rps[0]:.2f}x | {_each(p50, '.2f')} |"
        )
    lines += [
        "",
        "At c32: the cores the machine was busy (every process, the load generator's included), the load"
        " generator's share of them, and the machine's CPU a request (busy cores over requests/s).",
        "",
        "| model | length | busy cores 1 / 2 / auto | load generator cores 1 / 2 / auto "
        "| CPU ms a request 1 / 2 / auto |",
        "|---|---|---|---|---|",
    ]
    for cell in cells:
        runs = [cell[f"{w} c32"] for w in WORKERS]
        busy = [r.get("machine_cpu_share", 0.0) for r in runs]
        client = [r.get("client_cpu_share", 0.0) for r in runs]
        per_request = [b / r["rps"] * 1e3 if r["rps"] else 0.0 for b, r in zip(busy, runs, strict=True)]
        lines.append(
            f"| {cell['model']} | {cell['length'] or '-'} | {_each(busy, '.2f')} | {_each(client, '.2f')} "
            f"| {_each(per_request, '.2f')} |"
        )
    lines += ["", "| workers | process | RSS MiB | PSS MiB | USS MiB |", "|---|---|---|---|---|"]
    for w, processes in results.get("memory", {}).items():
        for i, m in enumerate(processes):
            lines.append(f"| {w} | {i} | {m['rss']:.0f} | {m['pss']:.0f} | {m['uss']:.0f} |")
    return "\n".join(lines) + "\n"
