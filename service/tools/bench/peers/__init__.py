"""`qkv bench --peers`: qkv beside Triton, MLServer and a plain grpc.aio server, one model, one run.

The model is the zoo's `zoo_medium` (service/tools/bench/zoo.py: encoder, 4 layers, d 256, random weights, its
output mean-pooled), a model qkv did not train. Four servers serve it on 127.0.0.1, each from its own
process and environment:
- qkv, as `qkv bench --zoo` starts it (its batching tuned from the model's measured cost);
- Triton 2.51 as PyTriton bundles it: its dynamic batcher before a Python callback running onnxruntime;
- MLServer: its adaptive batching (max_batch_size, max_batch_time) before a custom onnxruntime runtime;
- a plain grpc.aio server: no batching, one session with every core, ModelInfer only.
The peers' code is in this folder (`*_peer.py`), run by their own environments' Python (`envs.py`); none
of it is imported by qkv. One load generator (service/tools/loadgen.py, raw v2 stubs) drives all four.

Each cell, seq 16, 64 and 256 at concurrency 32, and seq 64 at concurrency 1, is measured in slices
that alternate between the in-process ceiling and the servers, forwards then backwards, so that every
ratio compares figures measured in the same seconds. The ceiling at c32 is zoo_bench's, two
single-thread sessions at their best batch; at c1, the faster of one single-thread session and one
with every core, batch 1.
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.seq2seq.graphs import session_options
from service.tools import loadgen
from service.tools.bench.load import run_closed
from service.tools.bench.peers.envs import CACHE, PEERS, ensure, freeze
from service.tools.bench.peers.launch import Peer, start_peer, stop_peer, wait_ready
from service.tools.bench.servers import Servers, cpus
from service.tools.bench.zoo import ZOO, write_zoo
from service.tools.bench.zoo_bench import InProcess

__all__ = ["LENGTHS", "PEERS", "peers_benchmark", "peers_table"]

MODEL = next(m for m in ZOO if m.name == "zoo_medium")
LENGTHS = (16, 64, 256)
C1_LENGTH = 64
CONCURRENCY = 32
POOL = 64  # distinct requests a cell, sent round-robin


def _maker(length: int) -> loadgen.MakeRequest:
    rng = np.random.default_rng(0)
    pool = [loadgen.encoder_request(length, MODEL.vocab, rng, MODEL.name) for _ in range(POOL)]

    def make(i: int) -> tuple[Any, int, str]:
        return pool[i % POOL], length, ""

    return make


def _output(response: Any) -> np.ndarray:
    """The first output of a v2 answer as float32, whether sent raw or in typed contents (MLServer may)."""
    if response.raw_output_contents:
        return np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
    return np.asarray(response.outputs[0].contents.fp32_contents, dtype=np.float32)


def _latencies(session: ort.InferenceSession, length: int, seconds: float) -> list[float]:
    """Seconds of one batch-1 sequence on `session`, back to back for `seconds`."""
    ids = np.random.default_rng(0).integers(0, MODEL.vocab, size=(1, length), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    session.run(None, feeds)
    times: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return times


def _best_batch(ceiling: InProcess, seconds: float) -> int:
    rates = {b: n / t for b in (1, 8, 32) for n, t in [ceiling.throughput(b, seconds)]}
    return max(rates, key=lambda b: rates[b])


def _machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "avx512": bool(flags and "avx512f" in flags.group(1).split()),
        "cpus": cpus(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def _versions(freezes: dict[str, list[str]], logs: dict[str, str]) -> dict[str, dict[str, str]]:
    wanted = {"onnxruntime", "numpy", "grpcio", "protobuf", "nvidia-pytriton", "mlserver", "uvloop"}
    out = {"qkv": {p: metadata.version(p) for p in ("onnxruntime", "numpy", "grpcio", "protobuf")}}
    for name, lines in freezes.items():
        pinned = dict(line.split("==", 1) for line in lines if "==" in line)
        out[name] = {p: v for p, v in pinned.items() if p.lower() in wanted}
    server = re.search(r"server_version\s*\|\s*(\S+)", logs.get("triton", ""))
    if server:
        out["triton"]["tritonserver"] = server.group(1)
    return out


def peers_benchmark(
    out: Path,
    seconds: float = 6.0,
    peers: tuple[str, ...] = PEERS,
    lengths: tuple[int, ...] = LENGTHS,
    pythons: dict[str, Path] | None = None,
    cache: Path = CACHE,
    slices: int = 4,
) -> dict[str, Any]:
    """Every cell for qkv and each peer, beside the ceiling; writes peers.json and peers.md into `out`.

    `pythons` names an interpreter to run a peer with instead of making its environment (the tests run
    the plain peer with qkv's own, which has the same pins)."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="qkv-peers-"))
    repo = write_zoo(scratch / "zoo", [MODEL])
    graph = repo / MODEL.name / "1" / "model.onnx"
    python = {name: (pythons or {}).get(name) or ensure(name, cache) for name in peers}
    results: dict[str, Any] = {"model": f"{MODEL.name} ({MODEL.description}, output mean-pooled)"}
    results["machine"] = {**_machine(), "load_average_before": os.getloadavg()}
    servers = Servers(repo, scratch)
    started: list[Peer] = []
    try:
        for name in peers:
            started.append(start_peer(name, python[name], graph, MODEL.name, scratch, cpus()))
        # Every peer up (and idle) before qkv starts: qkv's warm-up times this machine, not the peers' start.
        parity = _parity({p.name: p.url for p in started}, graph, started)
        urls = {"qkv": servers.start(None).url, **{p.name: p.url for p in started}}
        results["parity"] = {**_parity({"qkv": urls["qkv"]}, graph, started), **parity}
        for name, url in urls.items():  # first batches, first shapes: not measured
            for n in (*lengths, C1_LENGTH):
                run_closed(url, _maker(n), CONCURRENCY, 0.3, f"warm {name} {n}")
        cells: dict[str, Any] = {}
        for n in lengths:
            cells[f"seq {n} c{CONCURRENCY}"] = _cell(urls, graph, n, CONCURRENCY, seconds, slices)
        cells[f"seq {C1_LENGTH} c1"] = _cell(urls, graph, C1_LENGTH, 1, seconds / 2, slices)
        results["cells"] = cells
        logs = {p.name: p.output() for p in started}
    finally:
        for peer in started:
            stop_peer(peer)
        servers.close()
    results["machine"]["load_average_after"] = os.getloadavg()
    results["seconds_per_cell_per_server"] = seconds
    results["versions"] = _versions({name: freeze(py) for name, py in python.items()}, logs)
    (out / "peers.json").write_text(json.dumps(results, indent=2, default=float))
    (out / "peers.md").write_text(peers_table(results))
    return results


def _parity(urls: dict[str, str], graph: Path, peers: list[Peer]) -> dict[str, float]:
    """Each server's answer to one request against onnxruntime in process: the largest difference."""
    request = loadgen.encoder_request(C1_LENGTH, MODEL.vocab, np.random.default_rng(1), MODEL.name)
    ids = np.frombuffer(request.raw_input_contents[0], dtype=np.int64).reshape(1, C1_LENGTH)
    ceiling = InProcess(graph, MODEL, C1_LENGTH)
    (expected,) = ceiling.sessions[0].run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    alive = {p.name: p for p in peers}
    diffs = {}
    for name, url in urls.items():
        peer = alive.get(name)
        try:
            answer = wait_ready(url, request, (lambda p=peer: p.process.poll() is None) if peer else None)
        except RuntimeError as e:
            log = peer.output()[-3000:] if peer else ""
            raise RuntimeError(f"peer {name} on {url}: {e}\n{log}") from None
        diffs[name] = float(np.max(np.abs(_output(answer) - expected.ravel())))
    return diffs


def _cell(
    urls: dict[str, str], graph: Path, length: int, concurrency: int, seconds: float, slices: int
) -> dict[str, Any]:
    """One cell: the ceiling and every server in `slices` alternating slices of `seconds` / `slices` each."""
    ceiling = InProcess(graph, MODEL, length)
    batch = _best_batch(ceiling, 0.3) if concurrency > 1 else 1
    # c1's best in process may be one session with every core (as the peers run) rather than one of
    # the single-thread sessions qkv runs side by side: both are measured, the faster is the ceiling.
    every_core = ort.InferenceSession(str(graph), session_options(cpus()), providers=["CPUExecutionProvider"])
    runs = {name: loadgen.Run() for name in urls}
    sequences, busy = 0, 0.0
    compute: dict[str, list[float]] = {"1 thread": [], f"{cpus()} threads": []}
    slice_s = seconds / slices
    for i in range(slices):  # ceiling, qkv, peers..., then peers..., qkv, ceiling, ...
        for kind in ["ceiling", *urls][:: 1 if i % 2 == 0 else -1]:
            if kind == "ceiling" and concurrency == 1:
                compute["1 thread"] += ceiling.latencies(slice_s / 2)
                compute[f"{cpus()} threads"] += _latencies(every_core, length, slice_s / 2)
            elif kind == "ceiling":
                done, took = ceiling.throughput(batch, slice_s)
                sequences, busy = sequences + done, busy + took
            else:
                label = f"{kind} seq {length} c{concurrency}"
                runs[kind].add(run_closed(urls[kind], _maker(length), concurrency, slice_s, label))
    cell: dict[str, Any] = {name: loadgen.summarise(run) for name, run in runs.items()}
    if concurrency == 1:
        p50 = {how: float(np.median(times)) * 1e3 for how, times in compute.items()}
        best = min(p50, key=lambda how: p50[how])
        cell["ceiling"] = {"p50_ms": p50[best], "best": best, "p50_ms_by_threads": p50}
    else:
        cell["ceiling"] = {"seq_per_s": sequences / busy, "batch": batch}
    return cell


def peers_table(results: dict[str, Any]) -> str:
    """Servers down, cells across: served / ceiling at c32 (req/s), p50 at c1; then qkv / best peer."""
    cells = results["cells"]
    throughput = [k for k in cells if not k.endswith(" c1")]
    latency = [k for k in cells if k.endswith(" c1")]
    servers = [k for k in next(iter(cells.values())) if k != "ceiling"]
    header = [*(f"{k}: served / ceiling (req/s)" for k in throughput), *(f"{k}: p50 ms" for k in latency)]
    lines = ["| server | " + " | ".join(header) + " | not OK |", "|---|" + "---|" * (len(header) + 1)]
    row = [f"{cells[k]['ceiling']['seq_per_s']:.0f} seq/s (batch {cells[k]['ceiling']['batch']})" for k in throughput]
    row += [f"{cells[k]['ceiling']['p50_ms']:.2f} (compute, {cells[k]['ceiling']['best']})" for k in latency]
    lines.append("| ceiling, in process | " + " | ".join(row) + " | |")
    for s in servers:
        row = [
            f"{cells[k][s]['rps'] / cells[k]['ceiling']['seq_per_s']:.2f} ({cells[k][s]['rps']:.0f})"
            for k in throughput
        ]
        row += [f"{cells[k][s]['p50_ms']:.2f}" for k in latency]
        bad = sum(n for k in cells for code, n in cells[k][s]["codes"].items() if code != "OK")
        lines.append(f"| {s} | " + " | ".join(row) + f" | {bad} |")
    peers = [s for s in servers if s != "qkv"]
    if peers:
        verdict = [f"{cells[k]['qkv']['rps'] / max(cells[k][p]['rps'] for p in peers):.2f}" for k in throughput]
        verdict += [f"{min(cells[k][p]['p50_ms'] for p in peers) / cells[k]['qkv']['p50_ms']:.2f}" for k in latency]
        lines.append("| qkv / best peer (above 1: qkv ahead) | " + " | ".join(verdict) + " | |")
    return "\n".join(lines) + "\n"
