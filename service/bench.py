"""`qkv bench`: load tests over the v2 protocol, with the raw onnxruntime ceiling in the same run.

    qkv bench --url 127.0.0.1:8001 --model g2p_encoder --lengths 4:256 --concurrency 1,8,32
    qkv bench --suite --out runs/bench        # every BENCHMARKS.md target, servers started here

Every served figure is a ratio to a figure measured in the same run on the same machine (the
in-process onnxruntime ceiling, or the same server with one setting changed), so the numbers
transfer between machines better than absolute ones. Results: JSON, PNG plots, a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from service import loadgen
from service.client import g2p_request
from service.process import ServerProcess, start_server, stop_server
from service.seq2seq import session_options

__all__ = ["in_process_latency", "main", "raw_ceiling", "suite"]

ROOT = Path(__file__).resolve().parents[1]


def _encoder_feeds(batch: int, length: int, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ids = rng.integers(4, vocab, size=(batch, length), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def raw_ceiling(model: Path, length: int, vocab: int, seconds: float = 1.5,
                batches: tuple[int, ...] = (1, 8, 32, 64)) -> dict[str, Any]:  # fmt: skip
    """Best sequences/s of in-process onnxruntime over batch sizes and sessions x threads (1x2, 2x1)."""
    rng = np.random.default_rng(0)
    table = {}
    for sessions, threads in ((1, 2), (2, 1)):
        pool = [ort.InferenceSession(str(model), session_options(threads), providers=["CPUExecutionProvider"])
                for _ in range(sessions)]  # fmt: skip
        for b in batches:
            feeds = _encoder_feeds(b, length, vocab, rng)
            pool[0].run(None, feeds)  # warm-up
            counts = [0] * sessions
            stop = time.perf_counter() + seconds

            def spin(
                k: int,
                feeds: dict[str, np.ndarray] = feeds,
                stop: float = stop,
                pool: list[ort.InferenceSession] = pool,
                counts: list[int] = counts,
            ) -> None:
                while time.perf_counter() < stop:
                    pool[k].run(None, feeds)
                    counts[k] += 1

            t0 = time.perf_counter()
            workers = [threading.Thread(target=spin, args=(k,)) for k in range(sessions)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            table[f"{sessions}x{threads} batch {b}"] = sum(counts) * b / (time.perf_counter() - t0)
    best = max(table, key=table.__getitem__)
    return {"best": table[best], "best_config": best, "table": table}


def in_process_latency(model: Path, length: int, vocab: int, n: int = 300) -> float:
    """p50 seconds of one batch-1 run with the served instance's settings (1 intra-op thread)."""
    sess = ort.InferenceSession(str(model), session_options(1), providers=["CPUExecutionProvider"])
    feeds = _encoder_feeds(1, length, vocab, np.random.default_rng(0))
    for _ in range(20):
        sess.run(None, feeds)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def scrape(metrics_url: str) -> dict[str, float]:
    """Prometheus text -> {series: value} (enough for counters)."""
    out = {}
    for line in urllib.request.urlopen(metrics_url, timeout=5).read().decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def padding_share(metrics_url: str, model: str) -> float:
    m = scrape(metrics_url)
    real = m.get(f'qkv_batch_tokens_total{{kind="real",model="{model}"}}', 0.0)
    pad = m.get(f'qkv_batch_tokens_total{{kind="padding",model="{model}"}}', 0.0)
    return pad / (real + pad) if real + pad else float("nan")


def _vocab(models: Path) -> int:
    return len(json.loads((models / "g2p" / "1" / "graphemes.json").read_text()))


def variant(models: Path, into: Path, changes: dict[str, dict[str, Any]]) -> Path:
    """A copy of the repository (graphs linked, not copied) with config.json settings changed."""
    for model_dir in models.iterdir():
        if not model_dir.is_dir():
            continue
        target = into / model_dir.name
        (target / "1").mkdir(parents=True)
        for f in (model_dir / "1").iterdir():
            (target / "1" / f.name).symlink_to(f.resolve())
        config = json.loads((model_dir / "config.json").read_text())
        for key, value in changes.get(model_dir.name, {}).items():
            if isinstance(value, dict):
                config.setdefault(key, {}).update(value)
            else:
                config[key] = value
        (target / "config.json").write_text(json.dumps(config))
    return into


class _Servers:
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


BEAM_SIZE = 4  # the beam section's beam width
ROUNDS = 3  # the sections that compare two settings run each this many times, alternating
Measure = Callable[[ServerProcess, str, str], dict[str, Any]]  # (server, variant, label) -> figures


def _take_turns(
    servers: _Servers,
    variants: dict[str, tuple[dict[str, dict[str, Any]] | None, list[str] | None]],
    measure: Measure,
    rounds: int = ROUNDS,
) -> dict[str, dict[str, Any]]:
    """Each variant's server `rounds` times, the variants alternating; per variant, the median of each
    figure over its rounds (the rounds themselves under "rounds"). This VM's speed drifts within
    minutes, so one run of A then one of B compares two moments as much as two settings: compare
    with `_paired_ratio`."""
    by: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, (changes, extra) in variants.items():
            s = servers.start(changes, extra)
            try:
                by[name].append(measure(s, name, f"{name} {r + 1}/{rounds}"))
            finally:
                servers.stop(s)
    return {name: _median_of(runs) for name, runs in by.items()}


def _paired_ratio(turns: dict[str, dict[str, Any]], a: str, b: str, figure: str) -> float:
    """The median over rounds of a's figure / b's: each pair ran back to back, so a drift of the VM's
    speed between rounds cancels in the ratio."""
    pairs = zip(turns[a]["rounds"], turns[b]["rounds"], strict=True)
    return float(np.median([x[figure] / y[figure] for x, y in pairs]))


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    numbers = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {**{k: float(np.median([x[k] for x in runs])) for k in numbers}, "rounds": runs}


def _run(coro_factory: Callable[[Callable[[int], None]], Any], label: str, total: int) -> Any:
    with tqdm(total=total, desc=label, unit="req", leave=False, dynamic_ncols=True) as bar:
        return asyncio.run(coro_factory(bar.update))


def _encoder_maker(lengths: Callable[[random.Random], int], vocab: int, seed: int = 0) -> loadgen.MakeRequest:
    rng, nprng = random.Random(seed), np.random.default_rng(seed)

    def make(i: int) -> tuple[Any, int, str]:
        n = lengths(rng)
        return loadgen.encoder_request(n, vocab, nprng), n, ""

    return make


def _words_maker(words: list[str], per_request: int) -> loadgen.MakeRequest:
    def make(i: int) -> tuple[Any, int, str]:
        chunk = [words[(i * per_request + k) % len(words)] for k in range(per_request)]
        return g2p_request(chunk), max(map(len, chunk)), ""

    return make


def _word_maker(words: list[str], tag: Callable[[str], str] = lambda w: "", beam_size: int = 1) -> loadgen.MakeRequest:
    def make(i: int) -> tuple[Any, int, str]:
        w = words[i % len(words)]
        return g2p_request([w], beam_size=beam_size), len(w), tag(w)

    return make


def _closed(url: str, make: loadgen.MakeRequest, concurrency: int, seconds: float, label: str) -> loadgen.Run:
    return _run(lambda p: loadgen.closed_loop(url, make, concurrency, seconds, progress=p), label, 0)  # type: ignore[no-any-return]


def _open(url: str, make: loadgen.MakeRequest, rate: float, seconds: float, label: str) -> loadgen.Run:
    return _run(lambda p: loadgen.open_loop(url, make, rate, seconds, progress=p), label, int(rate * seconds))  # type: ignore[no-any-return]


def _test_words() -> list[str]:
    path = ROOT / "export" / "data" / "split" / "test.txt"
    words = [w for w in path.read_text().split() if re.fullmatch(r"[a-z']+", w)]
    random.Random(0).shuffle(words)
    return words


OVERLOAD_QUEUE_WAIT_MS = 25.0
THROUGHPUT_QUEUE_WAIT_MS = 10_000.0
SECTIONS = ("ceiling", "mixed", "overload", "g2p", "beam", "continuous", "metrics", "kv")


def suite(models: Path, out: Path, seconds: float = 8.0, only: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """Every target of BENCHMARKS.md in one run (or the `only` sections); returns and writes the figures."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = _vocab(models)
    encoder = models / "g2p_encoder" / "1" / "model.onnx"
    words = _test_words()
    results: dict[str, Any] = {"machine": f"{_cpus()} CPUs", "seconds_per_run": seconds}
    scratch = Path(tempfile.mkdtemp(prefix="qkv-bench-"))
    servers = _Servers(models, scratch)
    try:
        if "ceiling" in only:
            _ceiling_section(servers, encoder, vocab, seconds, results)
        if "mixed" in only:
            _mixed_section(servers, vocab, seconds, results)
        if "overload" in only:
            _overload_section(servers, vocab, seconds, results)
        if "g2p" in only:
            _g2p_section(servers, words, seconds, results)
        if "beam" in only:
            _beam_section(servers, words, seconds, results)
        if "continuous" in only:
            _continuous_section(servers, words, seconds, results)
        if "metrics" in only:
            _metrics_section(servers, vocab, seconds, results)
    finally:
        servers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    if "kv" in only:
        results["kv_cache"] = _kv_cache(models)
    (out / "bench.json").write_text(json.dumps(results, indent=2, default=float))
    _plots(results, out)
    (out / "targets.md").write_text(targets_table(results))
    return results


def _process_cpu(pid: int) -> float:
    """CPU seconds a process has used so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bare_rpc(url: str, pid: int, concurrency: int = 16, n: int = 4000) -> dict[str, float]:
    """ServerLive, Python gRPC's own floor (no decoding, no model), which every served request pays on
    top of its compute: the p50 round trip one call at a time, then CPU per call, server and load
    generator, at `concurrency`."""
    import grpc

    from service import protocol

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
            server0, client0, t0 = _process_cpu(pid), loadgen.own_cpu(), time.perf_counter()
            await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
            calls = n // concurrency * concurrency
            return {
                "round_trip_p50_ms": float(np.median(alone)) * 1e3,
                "server_cpu_us": (_process_cpu(pid) - server0) / calls * 1e6,
                "client_cpu_us": (loadgen.own_cpu() - client0) / calls * 1e6,
                "rps": calls / (time.perf_counter() - t0),
            }

    return asyncio.run(run())


def _ceiling_section(servers: _Servers, encoder: Path, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    # 1. g2p_encoder seq 64, concurrency 32, against the raw onnxruntime ceiling.
    ceiling = raw_ceiling(encoder, 64, vocab)
    s = servers.start()
    server_cpu0 = _process_cpu(s.process.pid)
    fixed = _closed(s.url, _encoder_maker(lambda r: 64, vocab), 32, seconds, "encoder seq64 c32")
    served = loadgen.summarise(fixed)
    per_request_ms = (_process_cpu(s.process.pid) - server_cpu0) / max(1, served["requests"]) * 1e3
    floor = _bare_rpc(s.url, s.process.pid)
    # What served throughput could be if the server added nothing to a request but the bare RPC's CPU:
    # the cores split between the raw compute per sequence and the floor, server and load generator.
    cores = _cpus()
    compute_ms = cores / ceiling["best"] * 1e3
    bound = cores / (compute_ms + (floor["server_cpu_us"] + floor["client_cpu_us"]) / 1e3) * 1e3
    results["encoder_seq64_c32"] = {"served": served, "ceiling": ceiling,
                                    "ratio": served["rps"] / ceiling["best"],
                                    "server_cpu_per_request_ms": per_request_ms,
                                    "compute_cpu_per_sequence_ms": compute_ms,
                                    "bare_rpc": floor,
                                    "ratio_bound_from_bare_rpc": bound / ceiling["best"]}  # fmt: skip
    # 7. concurrency 1, seq 16: served p50 minus in-process p50.
    lone = loadgen.summarise(_closed(s.url, _encoder_maker(lambda r: 16, vocab), 1, seconds / 2, "c1 seq16"))
    compute = in_process_latency(encoder, 16, vocab)
    results["encoder_seq16_c1"] = {"served_p50_ms": lone["p50_ms"], "compute_p50_ms": compute * 1e3,
                                   "overhead_ms": lone["p50_ms"] - compute * 1e3,
                                   "bare_grpc_round_trip_p50_ms": floor["round_trip_p50_ms"]}  # fmt: skip
    # Concurrency sweep for the throughput plot.
    sweep = {}
    for c in (1, 4, 16, 64):
        sweep[c] = loadgen.summarise(_closed(s.url, _encoder_maker(lambda r: 64, vocab), c, seconds / 2, f"c{c}"))
    results["encoder_seq64_sweep"] = sweep
    servers.stop(s)


def _mixed_section(servers: _Servers, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    # 2-3. mixed lengths 4..256: length-aware vs plain FIFO (pad to longest), the same lengths each round.
    aware_runs: list[loadgen.Run] = []

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        run = _closed(s.url, _encoder_maker(lambda r: r.randint(4, 256), vocab, 1), 32, seconds, label)
        if name == "length_aware":
            aware_runs.append(run)
        return {**loadgen.summarise(run), "padding_share": padding_share(s.metrics_url, "g2p_encoder")}

    fifo = {"g2p_encoder": {"batching": {"length_aware": False}}}
    turns = _take_turns(servers, {"length_aware": (None, None), "fifo": (fifo, None)}, measure)
    results["latency_by_seq_len"] = _by_length(loadgen.Run([x for run in aware_runs for x in run.samples]))
    results["encoder_mixed"] = {**turns, "ratio": _paired_ratio(turns, "length_aware", "fifo", "rps")}


def _overload_section(servers: _Servers, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    # 8-9. overload: capacity at seq 256, then 10x and 80 % of it, open loop. The latency objective is
    # the model's max_queue_wait_ms: work predicted to wait longer is refused at once.
    # Capacity comes from a server with the default (loose) objective: behind the tight one, a
    # closed loop would spin on instant refusals and measure how fast it can be refused instead.
    s = servers.start()
    cap = loadgen.summarise(_closed(s.url, _encoder_maker(lambda r: 256, vocab), 32, seconds / 2, "capacity"))
    servers.stop(s)
    capacity = cap["rps"]
    s = servers.start({"g2p_encoder": {"batching": {"max_queue_wait_ms": OVERLOAD_QUEUE_WAIT_MS}}})
    over = _open(s.url, _encoder_maker(lambda r: 256, vocab), 10 * capacity, seconds, "10x overload")
    over_s = loadgen.summarise(over)
    time.sleep(1.0)
    calm = loadgen.summarise(_open(s.url, _encoder_maker(lambda r: 256, vocab), 0.8 * capacity, seconds, "80%"))
    servers.stop(s)
    # The RPC layer's own bound: a server that refuses everything (no queue room at all, nothing
    # computed), at the same rate. Its refusal p99 is the least this machine allows at that rate.
    s = servers.start({"g2p_encoder": {"batching": {"max_queue_requests": 0}}})
    cpu0 = _process_cpu(s.process.pid)
    bare = _open(s.url, _encoder_maker(lambda r: 256, vocab), 10 * capacity, seconds, "10x, refusing all")
    bare_server_cpu = (_process_cpu(s.process.pid) - cpu0) / bare.wall
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


def _g2p_section(servers: _Servers, words: list[str], seconds: float, results: dict[str, Any]) -> None:
    # 4. g2p test words, concurrency 64: batched vs batching off; one word a request, and eight.
    # Throughput, not admission, is measured here: 64 x 8 words queued is about a second of work on
    # two cores, at the default 1 s objective, and a closed loop refused there spins instead of waiting.
    loose = {"max_queue_wait_ms": THROUGHPUT_QUEUE_WAIT_MS}
    off = {"g2p": {"batching": {"enabled": False, **loose}}}
    for per_request, key in ((1, "g2p_c64"), (8, "g2p_c64_8words")):
        make = _words_maker(words, per_request)

        def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
            return loadgen.summarise(_closed(s.url, make, 64, seconds, f"g2p x{per_request} {label}"))  # noqa: B023

        turns = _take_turns(servers, {"batched": ({"g2p": {"batching": loose}}, None), "unbatched": (off, None)},
                            measure)  # fmt: skip
        batched, alone = turns["batched"], turns["unbatched"]
        results[key] = {"words_per_request": per_request, "batched": batched, "unbatched": alone,
                        "words_per_s": {"batched": batched["rps"] * per_request,
                                        "unbatched": alone["rps"] * per_request},
                        "ratio": _paired_ratio(turns, "batched", "unbatched", "rps")}  # fmt: skip
    results["g2p_c64"]["compute_only"] = _g2p_compute_bound(servers.models, words)


def _g2p_compute_bound(models: Path, words: list[str], n: int = 256) -> dict[str, float]:
    """Words/s of in-process greedy decoding on one thread, a word at a time and 32 together (what
    c64 gives each of two instances): the batched / off ratio compute alone allows, before any serving
    cost. Static batches sorted by length, so an upper bound on what continuous batching gets."""
    from service.generation import greedy_decode
    from service.models import normalize_word
    from service.seq2seq import GRAPHEMES_FILE, OnnxSeq2Seq
    from service.vocab import Vocabulary

    version = models / "g2p" / "1"
    graphemes, model = Vocabulary.load(version / GRAPHEMES_FILE), OnnxSeq2Seq(version, session_options(1))
    sources = [graphemes.encode(w) for w in map(normalize_word, words[:n]) if w]
    greedy_decode(model, sources[:32], 40, batch_size=32)  # warm-up
    rates = {}
    for batch in (1, 32):
        t0 = time.perf_counter()
        greedy_decode(model, sources, 40, batch_size=batch)
        rates[batch] = len(sources) / (time.perf_counter() - t0)
    return {"words_per_s_batch1": rates[1], "words_per_s_batch32": rates[32], "ratio": rates[32] / rates[1]}


def _g2p_floor_bound(compute: dict[str, float], floor: dict[str, float] | None) -> str:
    """The batched / off ratio allowed by compute plus the gRPC floor each one-word request pays (server
    and load generator CPU on the same cores): (1/r1 + f) / (1/r32 + f)."""
    if not floor:
        return ""
    f = (floor["server_cpu_us"] + floor["client_cpu_us"]) / 1e6
    ratio = (1 / compute["words_per_s_batch1"] + f) / (1 / compute["words_per_s_batch32"] + f)
    return (f" With the gRPC floor above added to every one-word request ({f * 1e3:.2f} ms of CPU), "
            f"at most {ratio:.2f}.")  # fmt: skip


def _beam_section(servers: _Servers, words: list[str], seconds: float, results: dict[str, Any]) -> None:
    """Beam search (4 beams), one test word a request, concurrency 16: waiting requests decoded in one
    batch vs one request at a time (batching off)."""

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        run = _closed(s.url, _word_maker(words, beam_size=BEAM_SIZE), 16, seconds / 2, f"beam {label}")
        return loadgen.summarise(run)

    off = {"g2p": {"batching": {"enabled": False}}}
    turns = _take_turns(servers, {"batched": (None, None), "unbatched": (off, None)}, measure)
    results["g2p_beam_c16"] = {**turns, "beam_size": BEAM_SIZE,
                               "ratio": _paired_ratio(turns, "batched", "unbatched", "rps")}  # fmt: skip


def _continuous_section(servers: _Servers, words: list[str], seconds: float, results: dict[str, Any]) -> None:
    # 6. short words' p99 amid long ones: continuous vs static batching.
    short = [w for w in words if len(w) <= 5][:500]
    long_ = [w for w in words if len(w) >= 12][:500]
    mix = [w for pair in zip(short, long_, strict=False) for w in pair]

    def kind(w: str) -> str:
        return "short" if len(w) <= 5 else "long"

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        return loadgen.summarise(_closed(s.url, _word_maker(mix, kind), 32, seconds, label), "short")

    static = {"g2p": {"batching": {"continuous": False}}}
    turns = _take_turns(servers, {"continuous": (None, None), "static": (static, None)}, measure)
    results["g2p_short_p99"] = {**turns, "ratio": _paired_ratio(turns, "continuous", "static", "p99_ms")}


def _metrics_section(servers: _Servers, vocab: int, seconds: float, results: dict[str, Any]) -> None:
    """Requests/s with metrics recorded vs not, short requests (where recording weighs most)."""

    def measure(s: ServerProcess, name: str, label: str) -> dict[str, Any]:
        return loadgen.summarise(_closed(s.url, _encoder_maker(lambda r: 16, vocab), 16, seconds, label))

    turns = _take_turns(servers, {"on": (None, None), "off": (None, ["--no-metrics"])}, measure)
    results["metrics_overhead"] = {**turns, "overhead": 1 - _paired_ratio(turns, "on", "off", "rps")}


def _rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def soak(models: Path, out: Path, requests: int, concurrency: int = 16) -> dict[str, Any]:
    """`requests` requests of mixed lengths (encoder 4..256, g2p test words); memory and fds before/after."""
    vocab, words = _vocab(models), _test_words()
    enc = _encoder_maker(lambda r: r.randint(4, 256), vocab, 3)
    g2p = _word_maker(words)

    def make(i: int) -> tuple[Any, int, str]:
        return enc(i) if i % 2 else g2p(i)

    scratch = Path(tempfile.mkdtemp(prefix="qkv-soak-"))
    s = start_server(["--model-repository", str(models)], scratch / "server.log")
    try:
        warm = asyncio.run(loadgen.closed_loop(s.url, make, concurrency, 15.0))
        before = _rss_and_fds(s.process.pid)
        done: list[loadgen.Run] = []
        series = []  # (requests so far, RSS MB): a leak keeps climbing, an allocator settles
        with tqdm(total=requests, desc="soak", unit="req") as bar:
            while sum(len(r.samples) for r in done) < requests:
                done.append(asyncio.run(loadgen.closed_loop(s.url, make, concurrency, 10.0, progress=bar.update)))
                series.append((sum(len(r.samples) for r in done), _rss_and_fds(s.process.pid)[0] / 2**20))
        after = _rss_and_fds(s.process.pid)
    finally:
        stop_server(s)
        shutil.rmtree(scratch, ignore_errors=True)
    codes: dict[str, int] = {}
    for r in done:
        for x in r.samples:
            codes[x.code] = codes.get(x.code, 0) + 1
    result = {"requests": sum(codes.values()), "codes": codes, "warm_up_requests": len(warm.samples),
              "rss_before_mb": before[0] / 2**20, "rss_after_mb": after[0] / 2**20,
              "rss_growth": after[0] / before[0] - 1, "fds_before": before[1], "fds_after": after[1],
              "rss_series_mb": series}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    return result


def perf_analyzer_crosscheck(binary: Path, models: Path, out: Path, seconds: float = 6.0) -> dict[str, Any]:
    """Triton's perf_analyzer (C++) and `qkv bench` on the same server: g2p_encoder, seq 64, c32.

    perf_analyzer ships in the tritonclient==2.41.0 wheel; on a CPU-only machine it needs
    `apt-get install libb64-0d` and libcudart.so.12 (the nvidia-cuda-runtime-cu12 wheel) on
    LD_LIBRARY_PATH. It is given valid token ids with --input-data.
    """
    import subprocess

    vocab, rng = _vocab(models), random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    data = {"data": [{"input_ids": {"content": [rng.randrange(4, vocab) for _ in range(64)], "shape": [64]},
                      "attention_mask": {"content": [1] * 64, "shape": [64]}} for _ in range(16)]}  # fmt: skip
    (out / "perf_analyzer_input.json").write_text(json.dumps(data))
    scratch = Path(tempfile.mkdtemp(prefix="qkv-pa-"))
    s = start_server(["--model-repository", str(models)], scratch / "server.log")
    try:
        cmd = [
            str(binary),
            "-m",
            "g2p_encoder",
            "-i",
            "grpc",
            "-u",
            s.url,
            "-b",
            "1",
            "--concurrency-range",
            "32",
            "--input-data",
            str(out / "perf_analyzer_input.json"),
            "--measurement-interval",
            str(int(seconds * 1000)),
        ]
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
        (out / "perf_analyzer.txt").write_text(text)
        found = re.search(r"Concurrency: 32, throughput: ([\d.]+) infer/sec", text)
        ours = loadgen.summarise(_closed(s.url, _encoder_maker(lambda r: 64, vocab), 32, seconds, "qkv bench c32"))
    finally:
        stop_server(s)
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "perf_analyzer_rps": float(found.group(1)) if found else None,
        "qkv_bench_rps": ours["rps"],
        "qkv_bench_client_cpu_share": ours["client_cpu_share"],
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _by_length(run: loadgen.Run) -> dict[str, dict[str, float]]:
    edges = [4, 32, 64, 96, 128, 160, 192, 224, 257]
    table = {}
    for lo, hi in itertools.pairwise(edges):
        lat = [x.seconds for x in run.ok() if lo <= x.seq_len < hi]
        if lat:
            table[f"{lo}-{hi - 1}"] = {q: float(np.percentile(lat, int(q[1:]))) * 1e3 for q in ("p50", "p95", "p99")}
    return table


def _kv_cache(models: Path) -> dict[str, Any]:
    try:
        from export.bench_kv import kv_cache_speedup
    except ImportError as e:  # needs torch: the export extra
        return {"skipped": f"needs the export extra: {e}"}
    card = json.loads((models / "g2p" / "config.json").read_text())["model_card"]
    return kv_cache_speedup(card["config"], steps=20)


def _plots(results: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install '.[plot]'): no PNG plots")
        return
    if "latency_by_seq_len" not in results or "encoder_seq64_sweep" not in results:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    table = results["latency_by_seq_len"]
    names = list(table)
    for q in ("p50", "p95", "p99"):
        ax[0].plot(names, [table[n][q] for n in names], marker="o", label=q)
    ax[0].set(xlabel="sequence length (tokens)", ylabel="latency (ms)",
              title="g2p_encoder, mixed lengths, concurrency 32")  # fmt: skip
    ax[0].tick_params(axis="x", rotation=45)
    ax[0].legend()
    sweep = results["encoder_seq64_sweep"]
    cs = sorted(sweep, key=int)
    ax[1].plot(cs, [sweep[c]["rps"] for c in cs], marker="o", label="served")
    ax[1].axhline(results["encoder_seq64_c32"]["ceiling"]["best"], color="gray", ls="--", label="onnxruntime ceiling")
    ax[1].set(xlabel="concurrency", ylabel="requests/s", title="g2p_encoder, seq 64", xscale="log")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)


def targets_table(r: dict[str, Any]) -> str:
    """The BENCHMARKS.md table for the sections that ran."""
    rows = ["| what | target | measured | |", "|---|---|---|---|"]

    def row(section: str, what: str, target: str, get: Callable[[dict[str, Any]], float],
            ok: Callable[[float], bool], fmt: str = "{:.2f}") -> None:  # fmt: skip
        if section in r and "skipped" not in r[section]:
            x = get(r[section])
            rows.append(f"| {what} | {target} | {fmt.format(x)} | {'met' if ok(x) else 'NOT met'} |")

    row(
        "encoder_seq64_c32",
        "g2p_encoder seq 64 c32: served / raw onnxruntime ceiling",
        ">= 0.8",
        lambda v: v["ratio"],
        lambda x: x >= 0.8,
    )
    row(
        "encoder_mixed",
        "g2p_encoder mixed 4..256: padded share of computed tokens",
        "<= 15 %",
        lambda v: 100 * v["length_aware"]["padding_share"],
        lambda x: x <= 15,
        "{:.1f} %",
    )
    row(
        "encoder_mixed",
        "same: length-aware / pad-to-longest FIFO throughput",
        ">= 1.5",
        lambda v: v["ratio"],
        lambda x: x >= 1.5,
    )
    row("g2p_c64", "g2p test words c64: words/s batched / batching off", ">= 4", lambda v: v["ratio"], lambda x: x >= 4)
    row(
        "kv_cache",
        "g2p decode, 20 tokens, batch 32: with kv cache vs without (speed-up)",
        ">= 2x",
        lambda v: v["speedup"],
        lambda x: x >= 2,
        "{:.2f}x",
    )
    row(
        "g2p_short_p99",
        "g2p short words p99: continuous / static batching",
        "<= 0.6",
        lambda v: v["ratio"],
        lambda x: x <= 0.6,
    )
    row(
        "encoder_seq16_c1",
        "c1 seq 16: p50 served - p50 in-process compute",
        "<= 1 ms",
        lambda v: v["overhead_ms"],
        lambda x: x <= 1.0,
        "{:.2f} ms",
    )
    row(
        "overload",
        "10x overload: p99 time to RESOURCE_EXHAUSTED",
        "<= 5 ms",
        lambda v: v["refusal_p99_ms"],
        lambda x: x <= 5.0,
        "{:.2f} ms",
    )
    row("overload", "10x overload: admitted p99 / p99 at 80 % load", "<= 2", lambda v: v["ratio"], lambda x: x <= 2)
    row(
        "metrics_overhead",
        "metrics recording: requests/s lost (seq 16, c16)",
        "< 3 %",
        lambda v: 100 * v["overhead"],
        lambda x: x < 3,
        "{:.1f} %",
    )
    notes = []
    c32 = r.get("encoder_seq64_c32", {})
    if "bare_rpc" in c32:
        b = c32["bare_rpc"]
        notes.append(
            f"\nPython gRPC's floor here: a bare ServerLive costs {b['server_cpu_us']:.0f} us of server CPU and "
            f"{b['client_cpu_us']:.0f} us in the load generator (c16); a served seq-64 request cost "
            f"{c32['server_cpu_per_request_ms']:.2f} ms of server CPU against "
            f"{c32['compute_cpu_per_sequence_ms']:.2f} ms of raw compute per sequence. With nothing but that "
            f"floor added, served / ceiling could reach at most "
            f"{c32['ratio_bound_from_bare_rpc']:.2f}."
        )
    bound = r.get("g2p_c64", {}).get("compute_only")
    if bound:
        notes.append(
            f"\ng2p decoding in process, one thread, no server: {bound['words_per_s_batch1']:.0f} words/s a word "
            f"at a time, {bound['words_per_s_batch32']:.0f} with 32 together, so compute alone allows a "
            f"batched / off ratio of {bound['ratio']:.2f}." + _g2p_floor_bound(bound, c32.get("bare_rpc"))
        )
    bare = r.get("overload", {}).get("refusing_all")
    if bare:
        o = r["overload"]
        notes.append(
            f"\nAt 10x ({o['offered_rps']:.0f} requests/s), a server that refuses everything and computes nothing "
            f"has a refusal p99 of {bare['refusal_p99_ms']:.1f} ms, using {bare['server_cpu_share']:.2f} of a core "
            f"while the load generator uses {bare['client_cpu_share']:.2f}: the RPC layer's own bound at that rate."
        )
    beam = r.get("g2p_beam_c16")
    if beam:
        notes.append(
            f"\ng2p beam search ({beam['beam_size']} beams), one word a request, c16: {beam['batched']['rps']:.0f} "
            f"words/s with waiting requests decoded together, {beam['unbatched']['rps']:.0f} one request at a "
            f"time ({beam['ratio']:.2f}x, median of paired rounds)."
        )
    short = r.get("g2p_short_p99", {})
    if "rounds" in short.get("continuous", {}):
        by_round = {k: ", ".join(f"{x['p99_ms']:.1f}" for x in short[k]["rounds"]) for k in ("continuous", "static")}
        notes.append(
            f"\ng2p short-word p99 by round (ms), continuous: {by_round['continuous']}; static: {by_round['static']}."
        )
    return "\n".join(rows + notes) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="qkv bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--suite", action="store_true", help="run every BENCHMARKS.md target (starts its own servers)")
    parser.add_argument("--perf-analyzer", type=Path, metavar="BIN", help="cross-check with Triton's perf_analyzer")
    parser.add_argument("--soak", type=int, default=0, metavar="N", help="N mixed requests: memory and fd growth")
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="g2p_encoder", choices=("g2p_encoder", "g2p"))
    parser.add_argument("--lengths", default="64", help="N, or LO:HI uniform (tensor model)")
    parser.add_argument("--concurrency", default="1,8,32", help="closed loop: comma-separated")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop at this many requests/s instead")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"suite sections: {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.perf_analyzer:
        r = perf_analyzer_crosscheck(args.perf_analyzer, args.model_repository, args.out, args.seconds)
        print(json.dumps(r))
        return 0
    if args.soak:
        r = soak(args.model_repository, args.out, args.soak)
        print(
            f"soak: {r['requests']} requests {r['codes']}; RSS {r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f} MB "
            f"({r['rss_growth']:+.1%}); fds {r['fds_before']} -> {r['fds_after']}"
        )
        return 0
    if args.suite:
        results = suite(args.model_repository, args.out, args.seconds, tuple(args.only.split(",")))
        print(targets_table(results))
        print(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.png'}, {args.out / 'targets.md'}")
        return 0
    vocab = _vocab(args.model_repository)
    if args.model == "g2p":
        make = _word_maker(_test_words())
    else:
        lo, _, hi = args.lengths.partition(":")
        make = _encoder_maker(lambda r: r.randint(int(lo), int(hi or lo)), vocab)
    report: dict[str, Any] = {}
    if args.rate:
        report[f"rate {args.rate:g}"] = loadgen.summarise(_open(args.url, make, args.rate, args.seconds, "open loop"))
    else:
        for c in (int(x) for x in args.concurrency.split(",")):
            run = _closed(args.url, make, c, args.seconds, f"concurrency {c}")
            report[f"concurrency {c}"] = {**loadgen.summarise(run), "by_seq_len": _by_length(run)}
    for name, r in report.items():
        print(f"{name}: {r['rps']:.1f} req/s  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  codes {r['codes']}  "
              f"load generator CPU {r['client_cpu_share']:.0%}")  # fmt: skip
    (args.out / "bench.json").write_text(json.dumps(report, indent=2, default=float))
    return 0
