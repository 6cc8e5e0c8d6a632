"""`qkv bench --zoo`: how well qkv serves models it did not train, with the batching it tunes itself.

The zoo (service/tools/bench/zoo.py: encoders small to large, a decoder-only model, an MLP with no sequence
axis, random weights) is written as a repository and served by two servers at once: one with the
settings tuned from each model's measured cost (service/scheduling/tuning.py), one with the fixed defaults qkv had
before (`FIXED`). Each cell, a model at a sequence length and a concurrency, is set beside its
in-process onnxruntime ceiling: two single-thread sessions at their best batch size for c32, one
session's batch-1 latency (back to back) for c1. The two servers and the ceiling are measured in
slices that alternate within each cell, so that every ratio compares figures from the same seconds.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service import protocol
from service.seq2seq.graphs import session_options
from service.tools import loadgen
from service.tools.bench.load import run_closed
from service.tools.bench.servers import Servers
from service.tools.bench.zoo import ZOO, ZooModel, feeds, write_zoo

__all__ = ["FIXED", "zoo_benchmark", "zoo_table"]

FIXED = {"inline_max_tokens": 32, "max_queue_delay_ms": 2.0, "token_budget": 8192}  # the defaults before tuning
LENGTHS = (16, 64, 256)
CONCURRENCY = (1, 32)
POOL = 64  # distinct requests per cell, sent round-robin
SLICES = 4  # each cell's time on a server, in slices alternating between the servers and the ceiling


def _request(name: str, inputs: dict[str, np.ndarray]) -> Any:
    req = protocol.ModelInferRequest(model_name=name)
    for key, a in inputs.items():
        datatype = "INT64" if a.dtype == np.int64 else "FP32"
        req.inputs.add(name=key, datatype=datatype, shape=list(a.shape))
        req.raw_input_contents.append(a.tobytes())
    return req


def _maker(model: ZooModel, length: int) -> loadgen.MakeRequest:
    rng = np.random.default_rng(0)
    pool = [_request(model.name, feeds(model, 1, length, rng)) for _ in range(POOL)]

    def make(i: int) -> tuple[Any, int, str]:
        return pool[i % POOL], length, ""

    return make


class InProcess:
    """The ceiling: one zoo model's graph on two single-thread onnxruntime sessions, in this process."""

    def __init__(self, path: Path, model: ZooModel, length: int) -> None:
        self.model, self.length = model, length
        self.rng = np.random.default_rng(0)
        self.sessions = [
            ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"]) for _ in range(2)
        ]

    def throughput(self, batch: int, seconds: float) -> tuple[int, float]:
        """(sequences, seconds) of both sessions running batches of `batch` for `seconds`."""
        inputs = feeds(self.model, batch, self.length, self.rng)
        self.sessions[0].run(None, inputs)
        counts = [0, 0]
        stop = time.perf_counter() + seconds

        def spin(k: int) -> None:
            while time.perf_counter() < stop:
                self.sessions[k].run(None, inputs)
                counts[k] += 1

        t0 = time.perf_counter()
        workers = [threading.Thread(target=spin, args=(k,)) for k in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return sum(counts) * batch, time.perf_counter() - t0

    def latencies(self, seconds: float) -> list[float]:
        """Seconds of one sequence on one session, back to back for `seconds`."""
        one = feeds(self.model, 1, self.length, self.rng)
        self.sessions[0].run(None, one)
        times: list[float] = []
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            self.sessions[0].run(None, one)
            times.append(time.perf_counter() - t0)
        return times


def _best_batch(ceiling: InProcess, seconds: float = 0.5) -> int:
    """The batch (1, 8 or 32) at which the in-process sessions reach the most sequences/s."""
    rates = {b: n / t for b in (1, 8, 32) for n, t in [ceiling.throughput(b, seconds)]}
    return max(rates, key=lambda b: rates[b])


def zoo_benchmark(
    out: Path, seconds: float = 4.0, models: tuple[ZooModel, ...] = ZOO, lengths: tuple[int, ...] = LENGTHS
) -> dict[str, Any]:
    """Every zoo cell: in-process ceiling, served with tuned settings, served with FIXED; writes zoo.json
    and zoo.md."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="qkv-zoo-"))
    repo = write_zoo(scratch / "zoo", models)
    cells = [(m, n) for m in models for n in (lengths if m.sequence else (m.width,))]
    results: dict[str, Any] = {}
    servers = Servers(repo, scratch)
    try:
        # Both servers up at once, and the in-process ceiling, each cell measured on the three in slices
        # that alternate: on this kind of machine, speed drifts more in minutes than the settings differ
        # (BENCHMARKS.md, "Noise"), so each ratio is of figures measured within the same seconds.
        running = {
            "tuned": servers.start(None),
            "fixed": servers.start({m.name: {"batching": FIXED} for m in models}),
        }
        for m, n in cells:
            ceiling = InProcess(repo / m.name / "1" / "model.onnx", m, n)
            batch = _best_batch(ceiling)
            sequences, busy, compute = 0, 0.0, []
            cell: dict[str, Any] = {"model": m.name, "length": n}
            for c in CONCURRENCY:
                runs = {kind: loadgen.Run() for kind in running}
                slice_s = (seconds if c > 1 else seconds / 2) / SLICES
                for i in range(SLICES):  # ceiling, tuned, fixed, then fixed, tuned, ceiling, ...
                    for kind in ["ceiling", *running][:: 1 if i % 2 == 0 else -1]:
                        if kind == "ceiling" and c == 1:
                            compute += ceiling.latencies(slice_s)
                        elif kind == "ceiling":
                            done, took = ceiling.throughput(batch, slice_s)
                            sequences, busy = sequences + done, busy + took
                        else:
                            label = f"{kind} {m.name} {n} c{c}"
                            runs[kind].add(run_closed(running[kind].url, _maker(m, n), c, slice_s, label))
                for kind, run in runs.items():
                    cell[f"{kind} c{c}"] = loadgen.summarise(run)
            cell["ceiling"] = {
                "seq_per_s": sequences / busy,
                "batch": batch,
                "c1_compute_ms": float(np.median(compute)) * 1e3,
            }
            results[f"{m.name} {n}"] = cell
        for kind, s in running.items():
            results[f"settings {kind}"] = [line for line in s.output().splitlines() if "batching model" in line]
    finally:
        servers.close()
    (out / "zoo.json").write_text(json.dumps(results, indent=2, default=float))
    (out / "zoo.md").write_text(zoo_table(results))
    return results


def zoo_table(results: dict[str, Any]) -> str:
    """The cells against the targets: served / ceiling at c32, tuned / fixed, and c1's overhead."""
    lines = [
        "| model | length | ceiling seq/s | c32 tuned / ceiling | c32 fixed / ceiling | c32 tuned / fixed "
        "| c1 tuned / fixed | c1 p50 served - compute (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in results.values():
        if not isinstance(cell, dict) or "ceiling" not in cell:
            continue
        ceiling = cell["ceiling"]["seq_per_s"]
        t32, f32, t1, f1 = (cell[k]["rps"] for k in ("tuned c32", "fixed c32", "tuned c1", "fixed c1"))
        overhead = cell["tuned c1"]["p50_ms"] - cell["ceiling"]["c1_compute_ms"]
        lines.append(
            f"| {cell['model']} | {cell['length']} | {ceiling:.0f} | {t32 / ceiling:.2f} | {f32 / ceiling:.2f} "
            f"| {t32 / f32:.2f} | {t1 / f1:.2f} | {overhead:.2f} |"
        )
    return "\n".join(lines) + "\n"
