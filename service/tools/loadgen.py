"""A light asyncio load generator over the v2 protocol (raw stubs on one grpc.aio channel).

Closed loop: `concurrency` workers, each sending its next request when the last is answered.
Open loop: requests sent at a fixed rate whatever the answers, so overload shows as refusals.
Each sample records its sequence length, latency and gRPC status; `summarise` turns samples
into rates and percentiles.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from service import protocol
from service.tools.client import g2p_request

__all__ = [
    "Run", "Sample", "closed_loop", "encoder_request", "g2p_word_request", "machine_cpu", "open_loop", "own_cpu",
    "summarise",
]  # fmt: skip

MakeRequest = Callable[[int], tuple[Any, int, str]]  # i -> (request, seq_len, tag)


@dataclass
class Sample:
    seq_len: int
    seconds: float
    code: str
    tag: str = ""


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    client_cpu: float = 0.0  # CPU seconds the load generator itself used
    machine_cpu: float = 0.0  # CPU seconds the whole machine was busy (every process), where measured

    def ok(self, tag: str | None = None) -> list[Sample]:
        return [s for s in self.samples if s.code == "OK" and (tag is None or s.tag == tag)]

    def add(self, other: Run) -> None:
        """`other`'s samples, time and CPU added to this run's: one run measured in slices."""
        self.samples += other.samples
        self.wall += other.wall
        self.client_cpu += other.client_cpu
        self.machine_cpu += other.machine_cpu


def encoder_request(length: int, vocab: int, rng: np.random.Generator, model: str = "g2p_encoder") -> Any:
    ids = rng.integers(4, vocab, size=(1, length), dtype=np.int64)
    req = protocol.ModelInferRequest(model_name=model)
    req.inputs.add(name="input_ids", datatype="INT64", shape=[1, length])
    req.inputs.add(name="attention_mask", datatype="INT64", shape=[1, length])
    req.raw_input_contents.extend([ids.tobytes(), np.ones_like(ids).tobytes()])
    return req


def g2p_word_request(word: str, model: str = "g2p") -> Any:
    """One word, decoded by the model (not answered by its lexicon): load on the decoder."""
    return g2p_request([word], model, lexicon=False)


def machine_cpu() -> float:
    """CPU seconds the machine has been busy so far, every core and process (Linux /proc/stat: all but idle
    and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU seconds this process (the load generator) has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _one(stub: Any, request: Any, seq_len: int, tag: str, timeout: float, run: Run) -> None:
    t0 = time.perf_counter()
    try:
        await stub.ModelInfer(request, timeout=timeout)
        code = "OK"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    run.samples.append(Sample(seq_len, time.perf_counter() - t0, code, tag))


async def closed_loop(
    url: str,
    make: MakeRequest,
    concurrency: int,
    seconds: float,
    timeout: float = 30.0,
    progress: Callable[[int], None] | None = None,
) -> Run:
    run = Run()
    cpu0, t0 = own_cpu(), time.perf_counter()
    stop = t0 + seconds
    async with grpc.aio.insecure_channel(url) as channel:
        stub = protocol.Stub(channel)
        counter = iter(range(1 << 62))

        async def worker() -> None:
            while True:  # one request at least: a slice shorter than connecting still measures something
                request, seq_len, tag = make(next(counter))
                await _one(stub, request, seq_len, tag, timeout, run)
                if progress:
                    progress(1)
                if time.perf_counter() >= stop:
                    return

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall, run.client_cpu = time.perf_counter() - t0, own_cpu() - cpu0
    return run


async def open_loop(
    url: str,
    make: MakeRequest,
    rate: float,
    seconds: float,
    timeout: float = 30.0,
    progress: Callable[[int], None] | None = None,
) -> Run:
    """Send `rate` requests/s for `seconds` (Poisson-free: evenly spaced), then wait for answers."""
    run = Run()
    cpu0, t0 = own_cpu(), time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    async with grpc.aio.insecure_channel(url) as channel:
        stub = protocol.Stub(channel)
        n = int(rate * seconds)
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            request, seq_len, tag = make(i)
            tasks.append(asyncio.create_task(_one(stub, request, seq_len, tag, timeout, run)))
            if progress:
                progress(1)
        await asyncio.gather(*tasks)
    run.wall, run.client_cpu = time.perf_counter() - t0, own_cpu() - cpu0
    return run


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarise(run: Run, tag: str | None = None) -> dict[str, Any]:
    ok = run.ok(tag)
    lat = [s.seconds for s in ok]
    codes: dict[str, int] = {}
    for s in run.samples:
        if tag is None or s.tag == tag:
            codes[s.code] = codes.get(s.code, 0) + 1
    return {
        "requests": sum(codes.values()),
        "codes": codes,
        "rps": len(ok) / run.wall if run.wall else 0.0,
        "p50_ms": _pct(lat, 50) * 1e3,
        "p95_ms": _pct(lat, 95) * 1e3,
        "p99_ms": _pct(lat, 99) * 1e3,
        "wall_s": run.wall,
        "client_cpu_share": run.client_cpu / run.wall if run.wall else 0.0,
        "machine_cpu_share": run.machine_cpu / run.wall if run.wall else 0.0,  # in cores
    }
