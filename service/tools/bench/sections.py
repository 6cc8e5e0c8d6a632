"""The sections of `qkv bench --suite`, one function each, named as `--only` names them.

Each starts the servers it needs (through `Servers`), measures, and writes its figures into
`results` under its own keys.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.tools import loadgen
from service.tools.bench.ceilings import g2p_compute_bound, in_process_latency, raw_ceiling
from service.tools.bench.load import by_length, encoder_maker, run_closed, run_open, word_maker, words_maker
from service.tools.bench.servers import Servers, bare_rpc, cpus, padding_share, paired_ratio, process_cpu, take_turns
from service.tools.process import ServerProcess

__all__ = [
    "beam_section",
    "ceiling_section",
    "continuous_section",
    "g2p_section",
    "metrics_section",
    "mixed_section",
    "overload_section",
    "tracing_section",
]

BEAM_SIZE = 4  # the beam section's beam width
G2P_VERSION = "1"  # the g2p version the batching sections measure (their history in BENCHMARKS.md is version 1's)
OVERLOAD_QUEUE_WAIT_MS = 25.0
THROUGHPUT_QUEUE_WAIT_MS = 10_000.0


def ceiling_section(servers: Servers, encoder: Path, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    # 1. g2p_encoder seq 64, concurrency 32, against the raw onnxruntime ceiling.
    ceiling = raw_ceiling(encoder, 64, vocab)
    s = servers.start()
    server_cpu0 = process_cpu(s.process.pid)
    fixed = run_closed(s.url, encoder_maker(lambda r: 64, vocab), 32, seconds, "encoder seq64 c32")
    served = loadgen.summarise(fixed)
    per_request_ms = (process_cpu(s.process.pid) - server_cpu0) / max(1, served["requests"]) * 1e3
    floor = bare_rpc(s.url, s.process.pid)
    # What served throughput could be if the server added nothing to a request but the bare RPC's CPU:
    # the cores split between the raw compute per sequence and the floor, server and load generator.
    cores = cpus()
    compute_ms = cores / ceiling["best"] * 1e3
    bound = cores / (compute_ms + (floor["server_cpu_us"] + floor["client_cpu_us"]) / 1e3) * 1e3
    results["encoder_seq64_c32"] = {"served": served, "ceiling": ceiling,
                                    "ratio": served["rps"] / ceiling["best"],
                                    "server_cpu_per_request_ms": per_request_ms,
                                    "compute_cpu_per_sequence_ms": compute_ms,
                                    "bare_rpc": floor,
                                    "ratio_bound_from_bare_rpc": bound / ceiling["best"]}  # fmt: skip
    # 7. concurrency 1, seq 16: served p50 minus in-process p50.
    lone = loadgen.summarise(run_closed(s.url, encoder_maker(lambda r: 16, vocab), 1, seconds / 2, "c1 seq16"))
    compute = in_process_latency(encoder, 16, vocab)
    results["encoder_seq16_c1"] = {"served_p50_ms": lone["p50_ms"], "compute_p50_ms": compute * 1e3,
                                   "overhead_ms": lone["p50_ms"] - compute * 1e3,
                                   "bare_grpc_round_trip_p50_ms": floor["round_trip_p50_ms"]}  # fmt: skip
    # Concurrency sweep for the throughput plot.
    sweep = {}
    for c in (1, 4, 16, 64):
        sweep[c] = loadgen.summarise(run_closed(s.url, encoder_maker(lambda r: 64, vocab), c, seconds / 2, f"c{c}"))
    results["encoder_seq64_sweep"] = sweep
    servers.stop(s)


def mixed_section(servers: Servers, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    # 2-3. mixed lengths 4..256: length-aware vs plain FIFO (pad to longest), the same lengths each round.
    aware_runs: list[loadgen.Run] = []

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        run = run_closed(s.url, encoder_maker(lambda r: r.randint(4, 256), vocab, 1), 32, seconds, label)
        if name == "length_aware":
            aware_runs.append(run)
        return {**loadgen.summarise(run), "padding_share": padding_share(s.metrics_url, "g2p_encoder")}

    fifo = {"g2p_encoder": {"batching": {"length_aware": False}}}
    turns = take_turns(servers, {"length_aware": (None, None), "fifo": (fifo, None)}, measure)
    results["latency_by_seq_len"] = by_length(loadgen.Run([x for run in aware_runs for x in run.samples]))
    results["encoder_mixed"] = {**turns, "ratio": paired_ratio(turns, "length_aware", "fifo", "rps")}


def overload_section(servers: Servers, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    # 8-9. overload: capacity at seq 256, then 10x and 80 % of it, open loop. The latency objective is
    # the model's max_queue_wait_ms: work predicted to wait longer is refused at once.
    # Capacity comes from a server with the default (loose) objective: behind the tight one, a
    # closed loop would spin on instant refusals and measure how fast it can be refused instead.
    s = servers.start()
    cap = loadgen.summarise(run_closed(s.url, encoder_maker(lambda r: 256, vocab), 32, seconds / 2, "capacity"))
    servers.stop(s)
    capacity = cap["rps"]
    s = servers.start({"g2p_encoder": {"batching": {"max_queue_wait_ms": OVERLOAD_QUEUE_WAIT_MS}}})
    over = run_open(s.url, encoder_maker(lambda r: 256, vocab), 10 * capacity, seconds, "10x overload")
    over_s = loadgen.summarise(over)
    time.sleep(1.0)
    calm = loadgen.summarise(run_open(s.url, encoder_maker(lambda r: 256, vocab), 0.8 * capacity, seconds, "80%"))
    servers.stop(s)
    # The RPC layer's own bound: a server that refuses everything (no queue room at all, nothing
    # computed), at the same rate. Its refusal p99 is the least this machine allows at that rate.
    s = servers.start({"g2p_encoder": {"batching": {"max_queue_requests": 0}}})
    cpu0 = process_cpu(s.process.pid)
    bare = run_open(s.url, encoder_maker(lambda r: 256, vocab), 10 * capacity, seconds, "10x, refusing all")
    bare_server_cpu = (process_cpu(s.process.pid) - cpu0) / bare.wall
    servers.stop(s)
    results["overload"] = {
        "capacity_rps": capacity, "offered_rps": 10 * capacity, "codes": over_s["codes"],
        "refusal_p99_ms": _refusal_p99_ms(over),
        "admitted_p99_ms": over_s["p99_ms"], "p99_at_80pct_ms": calm["p99_ms"],
        "ratio": over_s["p99_ms"] / calm["p99_ms"], "client_cpu_share": over_s["client_cpu_share"],
        "refusing_all": {"refusal_p99_ms": _refusal_p99_ms(bare), "server_cpu_share": bare_server_cpu,
                         "client_cpu_share": bare.client_cpu / bare.wall},
    }  # fmt: skip


def _refusal_p99_ms(run: loadgen.Run) -> float:
    refused = [x.seconds for x in run.samples if x.code == "RESOURCE_EXHAUSTED"]
    return float(np.percentile(refused, 99)) * 1e3 if refused else float("nan")


def g2p_section(servers: Servers, words: list[str], seconds: float, results: dict[str, Any]) -> None:
    # 4. g2p test words, concurrency 64: batched vs batching off; one word a request, and eight.
    # Throughput, not admission, is measured here: 64 x 8 words queued is about a second of work on
    # two cores, at the default 1 s objective, and a closed loop refused there spins instead of waiting.
    loose = {"max_queue_wait_ms": THROUGHPUT_QUEUE_WAIT_MS}
    off = {"g2p": {"batching": {"enabled": False, **loose}}}
    for per_request, key in ((1, "g2p_c64"), (8, "g2p_c64_8words")):
        make = words_maker(words, per_request, G2P_VERSION)

        def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
            return loadgen.summarise(run_closed(s.url, make, 64, seconds, f"g2p x{per_request} {label}"))  # noqa: B023

        turns = take_turns(servers, {"batched": ({"g2p": {"batching": loose}}, None), "unbatched": (off, None)},
                           measure)  # fmt: skip
        batched, alone = turns["batched"], turns["unbatched"]
        results[key] = {"words_per_request": per_request, "batched": batched, "unbatched": alone,
                        "words_per_s": {"batched": batched["rps"] * per_request,
                                        "unbatched": alone["rps"] * per_request},
                        "ratio": paired_ratio(turns, "batched", "unbatched", "rps")}  # fmt: skip
    results["g2p_c64"]["compute_only"] = g2p_compute_bound(servers.models, words)


def beam_section(servers: Servers, words: list[str], seconds: float, results: dict[str, Any]) -> None:
    """Beam search (4 beams), one test word a request, concurrency 16: waiting requests decoded in one
    batch vs one request at a time (batching off)."""

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        make = word_maker(words, beam_size=BEAM_SIZE, version=G2P_VERSION)
        run = run_closed(s.url, make, 16, seconds / 2, f"beam {label}")
        return loadgen.summarise(run)

    off = {"g2p": {"batching": {"enabled": False}}}
    turns = take_turns(servers, {"batched": (None, None), "unbatched": (off, None)}, measure)
    results["g2p_beam_c16"] = {**turns, "beam_size": BEAM_SIZE,
                               "ratio": paired_ratio(turns, "batched", "unbatched", "rps")}  # fmt: skip


def continuous_section(servers: Servers, words: list[str], seconds: float, results: dict[str, Any]) -> None:
    # 6. short words' p99 amid long ones: continuous vs static batching.
    short = [w for w in words if len(w) <= 5][:500]
    long_ = [w for w in words if len(w) >= 12][:500]
    mix = [w for pair in zip(short, long_, strict=False) for w in pair]

    def kind(w: str) -> str:
        return "short" if len(w) <= 5 else "long"

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        make = word_maker(mix, kind, version=G2P_VERSION)
        return loadgen.summarise(run_closed(s.url, make, 32, seconds, label), "short")

    static = {"g2p": {"batching": {"continuous": False}}}
    turns = take_turns(servers, {"continuous": (None, None), "static": (static, None)}, measure)
    results["g2p_short_p99"] = {**turns, "ratio": paired_ratio(turns, "continuous", "static", "p99_ms")}


def metrics_section(servers: Servers, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    """Requests/s with metrics recorded vs not, short requests (where recording weighs most)."""

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        return loadgen.summarise(run_closed(s.url, encoder_maker(lambda r: 16, vocab), 16, seconds, label))

    turns = take_turns(servers, {"on": (None, None), "off": (None, ["--no-metrics"])}, measure)
    results["metrics_overhead"] = {**turns, "overhead": 1 - paired_ratio(turns, "on", "off", "rps")}


def tracing_section(servers: Servers, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    """Requests/s with every request traced (sampling 1.0, exported over OTLP/gRPC to a receiver in this
    process, as to a collector on the same machine) vs tracing off; short requests (seq 16, c16), where
    tracing weighs most."""
    try:
        from service.tools.bench.collector import Collector  # the trace extra: imported only for this section
    except ModuleNotFoundError as e:
        results["tracing_overhead"] = {"skipped": f"needs the trace extra ({e.name})"}
        return

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        return loadgen.summarise(run_closed(s.url, encoder_maker(lambda r: 16, vocab), 16, seconds, label))

    with Collector(keep=False) as collector:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector.endpoint  # the servers started here inherit it
        try:
            turns = take_turns(servers, {"on": (None, ["--trace-sample-ratio", "1"]), "off": (None, None)}, measure)
        finally:
            del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        spans = collector.count
    traced = sum(r["requests"] for r in turns["on"]["rounds"])
    results["tracing_overhead"] = {**turns, "overhead": 1 - paired_ratio(turns, "on", "off", "rps"),
                                   "p50_ratio": paired_ratio(turns, "on", "off", "p50_ms"),
                                   "spans_received": spans, "spans_per_request": spans / max(1, traced)}  # fmt: skip
