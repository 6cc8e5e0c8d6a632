"""`qkv bench --zoo`: how well qkv serves models it did not train, with the batching it tunes itself.

The zoo (service/bench/zoo.py: encoders small to large, a decoder-only model, an MLP with no sequence
axis, random weights) is written as a repository and served twice, in turn: with the settings tuned
from each model's measured cost (service/tuning.py), and with the fixed defaults qkv had before
(`FIXED`). Each cell, a model at a sequence length and a concurrency, is set beside its in-process
onnxruntime ceiling from the same run: two single-thread sessions at their best batch size for c32, one
session's batch-1 latency for c1.
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

from service import loadgen, protocol
from service.bench.load import run_closed
from service.bench.servers import Servers
from service.bench.zoo import ZOO, ZooModel, feeds, write_zoo
from service.seq2seq import session_options

__all__ = ["FIXED", "zoo_benchmark", "zoo_table"]

FIXED = {"inline_max_tokens": 32, "max_queue_delay_ms": 2.0, "token_budget": 8192}  # the defaults before tuning
LENGTHS = (16, 64, 256)
CONCURRENCY = (1, 32)
POOL = 64  # distinct requests per cell, sent round-robin


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


def _ceiling(path: Path, model: ZooModel, length: int, seconds: float = 1.0) -> dict[str, float]:
    """Sequences/s of two single-thread sessions at their best batch (1, 8, 32), and one session's p50
    seconds for one sequence."""
    rng = np.random.default_rng(0)
    sessions = [
        ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"]) for _ in range(2)
    ]
    one = feeds(model, 1, length, rng)
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        sessions[0].run(None, one)
        times.append(time.perf_counter() - t0)
    best = 0.0
    for batch in (1, 8, 32):
        inputs = feeds(model, batch, length, rng)
        sessions[0].run(None, inputs)
        counts = [0, 0]
        stop = time.perf_counter() + seconds

        def spin(
            k: int, inputs: dict[str, np.ndarray] = inputs, stop: float = stop, counts: list[int] = counts
        ) -> None:
            while time.perf_counter() < stop:
                sessions[k].run(None, inputs)
                counts[k] += 1

        t0 = time.perf_counter()
        workers = [threading.Thread(target=spin, args=(k,)) for k in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, sum(counts) * batch / (time.perf_counter() - t0))
    return {"seq_per_s": best, "c1_compute_ms": float(np.median(times)) * 1e3}


def zoo_benchmark(out: Path, seconds: float = 4.0) -> dict[str, Any]:
    """Every zoo cell: in-process ceiling, served with tuned settings, served with FIXED; writes zoo.json."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="qkv-zoo-"))
    repo = write_zoo(scratch / "zoo")
    cells = [(m, n) for m in ZOO for n in (LENGTHS if m.sequence else (m.width,))]
    results: dict[str, Any] = {}
    for m, n in cells:
        results[f"{m.name} {n}"] = {
            "model": m.name,
            "length": n,
            "ceiling": _ceiling(repo / m.name / "1" / "model.onnx", m, n),
        }
    servers = Servers(repo, scratch)
    try:
        for kind, changes in (("tuned", None), ("fixed", {m.name: {"batching": FIXED} for m in ZOO})):
            s = servers.start(changes)
            for m, n in cells:
                for c in CONCURRENCY:
                    run = run_closed(
                        s.url, _maker(m, n), c, seconds if c > 1 else seconds / 2, f"{kind} {m.name} {n} c{c}"
                    )
                    results[f"{m.name} {n}"][f"{kind} c{c}"] = loadgen.summarise(run)
            results[f"settings {kind}"] = [line for line in s.output().splitlines() if "batching model" in line]
            servers.stop(s)
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
