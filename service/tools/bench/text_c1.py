"""`qkv bench --text-model DIR --text-c1`: concurrency 1 alone, a 20-word text from three clients (grpc.aio's,
as the full run's c1, a synchronous one, as tritonclient.grpc's, and /v1/embeddings), each run between two
in-process single calls, with the server's own account of where a request's time went (docs/text-models.md;
BENCHMARKS.md, "Text models")."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service import protocol
from service.tools import loadgen
from service.tools.bench.load import run_closed
from service.tools.bench.servers import scrape
from service.tools.bench.text_models import (
    MAX_TOKENS,
    ROUNDS,
    Ceiling,
    _request,
    _tokenizer,
    cut_texts,
    http_closed_loop,
    mixed_texts,
)
from service.tools.process import start_server, stop_server

__all__ = ["C1_RUNS", "STAGES", "text_c1_bench", "text_c1_table"]

# `text_c1_bench`'s runs: name -> what the table calls it
C1_RUNS = {
    "grpc": "qkv, v2 gRPC, text in, c1 (grpc.aio client, as the full run's c1)",
    "grpc_sync": "qkv, v2 gRPC, text in, c1 (synchronous client, as tritonclient.grpc)",
    "http": "qkv, OpenAI HTTP /v1/embeddings, c1",
}
# The server's own account of a request at c1 (`text_c1_bench`): histogram -> what it times
STAGES = {
    "qkv_tokenize_duration_seconds": "tokenizing",
    "qkv_queue_duration_seconds": "queued",
    "qkv_compute_duration_seconds": "computing (hand-off to an instance and back included)",
    "qkv_request_duration_seconds": "the whole request, in the server",
}


def _stage_sums(metrics_url: str, model: str) -> dict[str, tuple[float, float]]:
    """Each of STAGES' (sum, count) for `model` so far, over every label set (a request's `seq_len` among them)."""
    sums = dict.fromkeys(STAGES, (0.0, 0.0))
    for key, value in scrape(metrics_url).items():
        name, _, labels = key.partition("{")
        for stage in STAGES:
            if f'model="{model}"' in labels and name in (f"{stage}_sum", f"{stage}_count"):
                total, count = sums[stage]
                sums[stage] = (total + value, count) if name.endswith("_sum") else (total, count + value)
    return sums


def _stage_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    return {
        stage: (after[stage][0] - before[stage][0]) * 1e3 / max(1.0, after[stage][1] - before[stage][1])
        for stage in STAGES
    }


def _sync_loop(url: str, request: Any, seconds: float) -> loadgen.Run:
    """One request at a time from a synchronous stub, as tritonclient.grpc's client sends them (no asyncio:
    none of grpc.aio's hand-offs between its poller thread and an event loop on the client's side)."""
    import grpc

    run = loadgen.Run()
    cpu0, t0 = loadgen.own_cpu(), time.perf_counter()
    with grpc.insecure_channel(url) as channel:
        stub = protocol.Stub(channel)
        stub.ModelInfer(request, timeout=30)  # connected before the first sample
        while True:  # one request at least, as loadgen's closed loop
            s0 = time.perf_counter()
            try:
                stub.ModelInfer(request, timeout=30)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            run.samples.append(loadgen.Sample(0, time.perf_counter() - s0, code))
            if time.perf_counter() >= t0 + seconds:
                break
    run.wall, run.client_cpu = time.perf_counter() - t0, loadgen.own_cpu() - cpu0
    return run


def text_c1_bench(folder: Path, out: Path, seconds: float = 8.0) -> dict[str, Any]:
    """Concurrency 1 alone (`qkv bench --text-model DIR --text-c1`): ROUNDS rounds, each a 20-word text over
    v2 gRPC (from grpc.aio's client, as the full run, and from a synchronous one) and over /v1/embeddings,
    each run between two in-process single calls and compared with their mean; beside each run, the server's
    own mean time a request spent tokenizing, queued, computing and in the server, from its metrics, so that
    the time outside the server (client, transport) shows."""
    texts = cut_texts(mixed_texts(), _tokenizer(folder, None), MAX_TOKENS)
    single = " ".join(texts[0].split()[:20])
    ceiling = Ceiling(folder, MAX_TOKENS)
    results: dict[str, Any] = {"single_tokens": len(ceiling.tokenizer.encode(single).ids), "seconds_per_run": seconds}
    scratch = Path(tempfile.mkdtemp(prefix="qkv-text-c1-"))
    try:
        (scratch / "models" / "text").mkdir(parents=True)
        (scratch / "models" / "text" / "1").symlink_to(folder.resolve(), target_is_directory=True)
        server = start_server(["--model-repository", str(scratch / "models")], scratch / "server.log", timeout=300)
        try:
            run_closed(server.url, lambda i: (_request(single, "text"), 20, ""), 1, 2.0, "warm-up")
            body = {"model": "text", "input": single}
            runs: dict[str, Callable[[], loadgen.Run]] = {
                "grpc": lambda: run_closed(server.url, lambda i: (_request(single, "text"), 20, ""), 1, seconds, "c1"),
                "grpc_sync": lambda: _sync_loop(server.url, _request(single, "text"), seconds),
                "http": lambda: http_closed_loop(server.http_url, "/v1/embeddings", lambda i: body, 1, seconds),
            }
            for _ in range(ROUNDS):
                for name, run in runs.items():
                    before, stages = ceiling.single_p50_ms(single), _stage_sums(server.metrics_url, "text")
                    summary = loadgen.summarise(run())
                    means = _stage_means_ms(stages, _stage_sums(server.metrics_url, "text"))
                    in_process = (before + ceiling.single_p50_ms(single)) / 2
                    results.setdefault(name, []).append({**summary, "in_process_ms": in_process, "server_ms": means})
            results["log"] = [line for line in server.log.read_text().splitlines() if "model 'text'" in line]
        finally:
            stop_server(server)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for name in runs:
        results[f"{name}_p50_over_single"] = statistics.median(r["p50_ms"] / r["in_process_ms"] for r in results[name])
    (out / "text_c1.json").write_text(json.dumps(results, indent=2, default=float))
    return results


def text_c1_table(r: dict[str, Any]) -> str:
    median = statistics.median
    rows = ["| what | p50 ms | p99 ms | p50 / in-process, each round |", "|---|---|---|---|"]
    single = median(x["in_process_ms"] for name in C1_RUNS for x in r[name])
    rows.append(f"| in-process single call ({r['single_tokens']} tokens), beside each run | {single:.2f} | | |")
    for name, what in C1_RUNS.items():
        ratios = ", ".join(f"{x['p50_ms'] / x['in_process_ms']:.2f}" for x in r[name])
        rows.append(f"| {what} | {median(x['p50_ms'] for x in r[name]):.2f} | "
                    f"{median(x['p99_ms'] for x in r[name]):.2f} | {ratios} |")  # fmt: skip
    rows += ["", "| the server's mean, ms | " + " | ".join(STAGES.values()) + " |", "|---|" + "---|" * len(STAGES)]
    for name in C1_RUNS:
        cells = " | ".join(f"{median(x['server_ms'][stage] for x in r[name]):.2f}" for stage in STAGES)
        rows.append(f"| {name} | {cells} |")
    said = [f"\nc1 p50 / in-process single call: gRPC {r['grpc_p50_over_single']:.2f} (sync client "
            f"{r['grpc_sync_p50_over_single']:.2f}), HTTP {r['http_p50_over_single']:.2f}"]  # fmt: skip
    return "\n".join(rows + said + r.get("log", []))
