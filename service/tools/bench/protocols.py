"""`qkv bench --protocols`: HTTP/REST against gRPC on one server, the same model and requests, one run.

The c1 latency (what a protocol adds to one request) and the throughput at a concurrency, for gRPC
(`grpc.aio`, the load generator of every other bench), HTTP with Triton's binary tensor extension
(what `tritonclient.http` sends by default) and HTTP with JSON tensors. The HTTP load comes from a
minimal keep-alive HTTP/1.1 client on asyncio streams, so that the client's own cost stays near the
gRPC one's (both share this machine's cores with the server). The runs alternate, one protocol after
the other at each concurrency, so a drift of the machine's speed falls on all of them alike.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.tools import loadgen
from service.tools.bench.load import encoder_maker, run_closed, vocab_size
from service.tools.bench.sections import THROUGHPUT_QUEUE_WAIT_MS
from service.tools.bench.servers import Servers

__all__ = ["http_body", "protocols", "protocols_table"]

HEADER = "Inference-Header-Content-Length"


def http_body(request: Any, binary: bool) -> tuple[bytes, dict[str, str]]:
    """A ModelInferRequest of INT64 tensors as tritonclient.http would send it: binary, or JSON data."""
    inputs = []
    for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if binary:
            entry["parameters"] = {"binary_data_size": len(raw)}
        else:
            entry["data"] = np.frombuffer(raw, dtype="<i8").tolist()
        inputs.append(entry)
    doc = {"inputs": inputs, "parameters": {"binary_data_output": binary}}
    head = json.dumps(doc).encode()
    if not binary:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(request.raw_input_contents), {HEADER: str(len(head))}


async def _http_closed_loop(
    url: str, make: loadgen.MakeRequest, binary: bool, concurrency: int, seconds: float
) -> loadgen.Run:
    run = loadgen.Run()
    cpu0, t0 = loadgen.own_cpu(), time.perf_counter()
    stop, counter = t0 + seconds, iter(range(1 << 62))
    host, port = url.rsplit(":", 1)

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.perf_counter() < stop:
                request, seq_len, tag = make(next(counter))
                body, headers = http_body(request, binary)
                lines = [f"POST /v2/models/{request.model_name}/infer HTTP/1.1", f"Host: {url}",
                         f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
                start = time.perf_counter()
                writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                length = next(
                    int(x.split(b":")[1]) for x in head.lower().split(b"\r\n") if x.startswith(b"content-length:")
                )
                await reader.readexactly(length)
                code = "OK" if status == 200 else str(status)
                run.samples.append(loadgen.Sample(seq_len, time.perf_counter() - start, code, tag))
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall, run.client_cpu = time.perf_counter() - t0, loadgen.own_cpu() - cpu0
    return run


def protocols(models: Path, out: Path, seconds: float = 4.0, length: int = 64, concurrency: int = 16) -> dict[str, Any]:
    """g2p_encoder at sequence length `length`: c1 and c`concurrency`, over gRPC, HTTP binary, HTTP JSON.

    Throughput is measured, not admission: the queue-wait objective is loosened, as in `--versions`.
    At the default 1 s, a slow moment of a busy machine (c16 x 64 tokens queued) had refused most of
    one protocol's run, and the protocols no longer compared like for like."""
    scratch = Path(tempfile.mkdtemp(prefix="qkv-protocols-"))
    servers = Servers(models, scratch)
    s = servers.start({"g2p_encoder": {"batching": {"max_queue_wait_ms": THROUGHPUT_QUEUE_WAIT_MS}}})
    make = encoder_maker(lambda r: length, vocab_size(models))
    results: dict[str, Any] = {"model": "g2p_encoder", "seq_len": length, "seconds_per_run": seconds}
    try:
        run_closed(s.url, make, 4, 1.0, "warm-up")  # onnxruntime's and the batcher's first batches
        for c in (1, concurrency):
            results[f"grpc c{c}"] = loadgen.summarise(run_closed(s.url, make, c, seconds, f"grpc c{c}"))
            for name, binary in (("http binary", True), ("http json", False)):
                run = asyncio.run(_http_closed_loop(s.http_url, make, binary, c, seconds))
                results[f"{name} c{c}"] = loadgen.summarise(run)
    finally:
        servers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    results["concurrency"] = concurrency
    out.mkdir(parents=True, exist_ok=True)
    (out / "protocols.json").write_text(json.dumps(results, indent=2, default=float))
    return results


def protocols_table(r: dict[str, Any]) -> str:
    c = r["concurrency"]
    base = r["grpc c1"]["p50_ms"], r[f"grpc c{c}"]["rps"]
    rows = [
        f"g2p_encoder, seq {r['seq_len']}, {r['seconds_per_run']:g} s a run",
        "",
        f"| protocol | c1 p50 ms | c1 p99 ms | over gRPC at c1 | c{c} req/s | / gRPC | c{c} p99 ms | codes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("grpc", "http binary", "http json"):
        one, many = r[f"{name} c1"], r[f"{name} c{c}"]
        codes = {k: one["codes"].get(k, 0) + many["codes"].get(k, 0) for k in {*one["codes"], *many["codes"]}}
        rows.append(
            f"| {name} | {one['p50_ms']:.2f} | {one['p99_ms']:.2f} | {one['p50_ms'] - base[0]:+.2f} ms | "
            f"{many['rps']:.0f} | {many['rps'] / base[1]:.2f} | {many['p99_ms']:.2f} | {codes} |"
        )
    return "\n".join(rows)
