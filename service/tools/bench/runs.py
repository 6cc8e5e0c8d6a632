"""What `qkv bench` runs whole: the suite of BENCHMARKS.md targets, the soak, the perf_analyzer check.

Each starts its own servers on loopback (port 0) and writes its results under `out`.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from service.tools import loadgen
from service.tools.bench.ceilings import kv_cache
from service.tools.bench.load import encoder_maker, held_out_words, run_closed, vocab_size, word_maker
from service.tools.bench.report import plots, targets_table
from service.tools.bench.sections import (
    beam_section,
    ceiling_section,
    continuous_section,
    g2p_section,
    metrics_section,
    mixed_section,
    overload_section,
    tracing_section,
)
from service.tools.bench.servers import Servers, cpus
from service.tools.process import start_server, stop_server

__all__ = ["SECTIONS", "perf_analyzer_crosscheck", "soak", "suite"]

# In the order they run.
SECTIONS = ("ceiling", "mixed", "overload", "g2p", "beam", "continuous", "metrics", "tracing", "kv")


def suite(models: Path, out: Path, seconds: float = 8.0, only: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """Every target of BENCHMARKS.md in one run (or the `only` sections); returns and writes the figures."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size(models)
    encoder = models / "g2p_encoder" / "1" / "model.onnx"
    words = held_out_words()
    results: dict[str, Any] = {"machine": f"{cpus()} CPUs", "seconds_per_run": seconds}
    scratch = Path(tempfile.mkdtemp(prefix="qkv-bench-"))
    servers = Servers(models, scratch)
    served: dict[str, Callable[[], None]] = {  # the sections that start servers, in SECTIONS' order
        "ceiling": partial(ceiling_section, servers, encoder, vocab, seconds, results),
        "mixed": partial(mixed_section, servers, vocab, seconds, results),
        "overload": partial(overload_section, servers, vocab, seconds, results),
        "g2p": partial(g2p_section, servers, words, seconds, results),
        "beam": partial(beam_section, servers, words, seconds, results),
        "continuous": partial(continuous_section, servers, words, seconds, results),
        "metrics": partial(metrics_section, servers, vocab, seconds, results),
        "tracing": partial(tracing_section, servers, vocab, seconds, results),
    }
    try:
        for name, run in served.items():
            if name in only:
                run()
    finally:
        servers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    if "kv" in only:
        results["kv_cache"] = kv_cache(models)
    (out / "bench.json").write_text(json.dumps(results, indent=2, default=float))
    plots(results, out)
    (out / "targets.md").write_text(targets_table(results))
    return results


def _rss_and_fds(pid: int) -> tuple[int, int]:
    """Resident memory (bytes) and open file descriptors of a process (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def soak(models: Path, out: Path, requests: int, concurrency: int = 16) -> dict[str, Any]:
    """`requests` requests of mixed lengths (encoder 4..256, g2p test words); memory and fds before/after."""
    vocab, words = vocab_size(models), held_out_words()
    enc = encoder_maker(lambda r: r.randint(4, 256), vocab, 3)
    g2p = word_maker(words)

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
    """Triton's perf_analyzer (C++) and `qkv bench` on the same server: g2p_encoder, seq 64, c32;
    perf_analyzer both over ModelInfer and over the ModelStreamInfer stream (`--streaming`).

    perf_analyzer ships in the tritonclient==2.41.0 wheel; on a CPU-only machine it needs
    `apt-get install libb64-0d` and libcudart.so.12 (the nvidia-cuda-runtime-cu12 wheel) on
    LD_LIBRARY_PATH. It is given valid token ids with --input-data.
    """
    vocab, rng = vocab_size(models), random.Random(0)
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
        rps: dict[str, float | None] = {}  # infer/s perf_analyzer reports, by mode
        for mode, extra in (("unary", []), ("streaming", ["--streaming"])):
            text = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=300).stdout
            (out / f"perf_analyzer_{mode}.txt").write_text(text)
            found = re.search(r"Concurrency: 32, throughput: ([\d.]+) infer/sec", text)
            rps[mode] = float(found.group(1)) if found else None
        ours = loadgen.summarise(run_closed(s.url, encoder_maker(lambda r: 64, vocab), 32, seconds, "qkv bench c32"))
    finally:
        stop_server(s)
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "perf_analyzer_rps": rps["unary"],
        "perf_analyzer_streaming_rps": rps["streaming"],
        "qkv_bench_rps": ours["rps"],
        "qkv_bench_client_cpu_share": ours["client_cpu_share"],
    }
