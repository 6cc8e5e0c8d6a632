"""`qkv bench --sequences`: a stateful model's steps, 64 sequences at once against one at a time.

The model is a GRU-style recurrent step built here with onnx.helper (`gru_step`: h' = tanh(x W + h U + b),
h kept as implicit state between the requests of a sequence), so small that a step's cost is the
request's own: decoding, scheduling, handing the row to an instance, answering. That is the case of
real stateful models (streaming speech, incremental decoding), whose steps are small and many.

One server; clients send each step with tritonclient's sequence parameters (`sequence_id`,
`sequence_start`, `sequence_end`), SEQUENCE_STEPS steps a sequence, over either transport Triton's
sequence clients use: "stream", each client's steps on one ModelStreamInfer stream (as
simple_grpc_sequence_stream_infer_client does), or "unary", a ModelInfer call a step (as
simple_grpc_sequence_sync_infer_client does). "one at a time": one sequence, step after step, then the
next. "64 at once": 64 sequences, each step after step, so the sequence batcher can put a step of each
into one batch. Within a round every transport and mode runs back to back on the same server, ROUNDS
rounds; each transport's ratio of steps/s is the median of the rounds' ratios (the machine's drift
cancels). Beside each: the server's mean batch size and its CPU per step (from its metrics and /proc).
Last, the same server's bare RPC (ServerLive, no model, no decoding) at 64 concurrent calls: Python
gRPC's own cost per unary call, which every unary step pays however it is batched, so its calls/s over
one-at-a-time unary steps/s bounds the ratio any batching can reach through unary calls on this machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.tools import loadgen
from service.tools.bench.servers import Servers, bare_rpc, cpus, median_of, paired_ratio, process_cpu, scrape

__all__ = [
    "CONCURRENT",
    "MODEL",
    "SEQUENCE_STEPS",
    "TRANSPORTS",
    "gru_step_model",
    "sequences_bench",
    "sequences_table",
]

MODEL = "gru_step"
FEATURES, HIDDEN = 16, 64  # x: (B, FEATURES), h: (B, HIDDEN)
CONCURRENT = 64  # sequences at once, and the model's max_batch_size
SEQUENCE_STEPS = 32  # requests in a sequence, its start and end included
ROUNDS = 3
TARGET = 4.0  # BENCHMARKS.md: 64 concurrent sequences, steps batched, >= 4x one sequence at a time
MAX_QUEUE_DELAY_US = 500  # a partial batch waits this long for company, only while an instance computes


def gru_step_model(root: Path, instances: int = 1) -> Path:
    """`root/gru_step`: one recurrent step as an ONNX graph, its state kept by the sequence batcher."""
    import onnx  # the serving install has no onnx: imported where used
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {
        "W": rng.normal(0, 0.3, (FEATURES, HIDDEN)).astype(np.float32),
        "U": rng.normal(0, 0.1, (HIDDEN, HIDDEN)).astype(np.float32),
        "b": np.zeros(HIDDEN, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["INPUT", "W"], ["xw"]),  # (B, F) x (F, H) -> (B, H)
        helper.make_node("MatMul", ["STATE_IN", "U"], ["hu"]),  # (B, H) x (H, H) -> (B, H)
        helper.make_node("Add", ["xw", "hu"], ["pre"]),
        helper.make_node("Add", ["pre", "b"], ["biased"]),
        helper.make_node("Tanh", ["biased"], ["STATE_OUT"]),
        helper.make_node("Identity", ["STATE_OUT"], ["OUTPUT"]),
    ]
    graph = helper.make_graph(
        nodes,
        MODEL,
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", FEATURES]),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, ["batch", HIDDEN]),
        ],
        [
            helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", HIDDEN]),
            helper.make_tensor_value_info("STATE_OUT", TensorProto.FLOAT, ["batch", HIDDEN]),
        ],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    directory = root / MODEL
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    config = {
        "max_batch_size": CONCURRENT,
        "instances": instances,
        "sequence_batching": {
            "max_sequence_idle_microseconds": 5_000_000,
            "oldest": {"max_candidate_sequences": CONCURRENT, "max_queue_delay_microseconds": MAX_QUEUE_DELAY_US},
            "state": [{"input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "TYPE_FP32",
                       "dims": [HIDDEN]}],
        },
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@dataclass
class _Tally:
    steps: int = 0  # answered OK within the window
    codes: dict[str, int] | None = None

    def count(self, code: str) -> None:
        self.codes = self.codes or {}
        self.codes[code] = self.codes.get(code, 0) + 1


class _Unary:
    """A client's steps as ModelInfer calls, one a step."""

    def __init__(self, client: Any, step_input: Any) -> None:
        self.client, self.x = client, step_input

    async def step(self, sid: int, start: bool, end: bool) -> str | None:
        """None when answered OK, else the error's status."""
        from tritonclient.utils import InferenceServerException

        try:
            await self.client.infer(
                MODEL, [self.x], sequence_id=sid, sequence_start=start, sequence_end=end, client_timeout=60
            )
        except InferenceServerException as e:
            return str(e.status())
        return None

    async def close(self) -> None:
        return None


class _Stream:
    """A client's steps on one ModelStreamInfer stream, each sent once the previous one is answered."""

    def __init__(self, client: Any, step_input: Any) -> None:
        self.x = step_input
        self.requests: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.answers = client.stream_infer(self._sent(), stream_timeout=600).__aiter__()

    async def _sent(self) -> Any:
        while (request := await self.requests.get()) is not None:
            yield request

    async def step(self, sid: int, start: bool, end: bool) -> str | None:
        self.requests.put_nowait(
            {"model_name": MODEL, "inputs": [self.x], "sequence_id": sid, "sequence_start": start, "sequence_end": end}
        )
        _, error = await self.answers.__anext__()
        return None if error is None else str(error.status() or "stream error")

    async def close(self) -> None:
        self.requests.put_nowait(None)  # the client is done sending: the stream ends once answered
        async for _ in self.answers:
            pass


SENDERS: dict[str, type[_Stream | _Unary]] = {"stream": _Stream, "unary": _Unary}
TRANSPORTS = tuple(SENDERS)


async def _sequences(url: str, concurrency: int, seconds: float, ids: itertools.count[int], transport: str) -> _Tally:
    """`concurrency` clients, each sending sequences of SEQUENCE_STEPS steps, step after step, for
    `seconds` over `transport`; a sequence cut by the window is ended by one more step (not counted)."""
    import tritonclient.grpc.aio as grpcclient

    tally = _Tally()
    x = grpcclient.InferInput("INPUT", [1, FEATURES], "FP32")
    x.set_data_from_numpy(np.full((1, FEATURES), 0.1, np.float32))
    async with grpcclient.InferenceServerClient(url) as client:
        stop = time.perf_counter() + seconds

        async def client_loop() -> None:
            sender = SENDERS[transport](client, x)
            try:
                while time.perf_counter() < stop:
                    sid = next(ids)
                    for i in range(SEQUENCE_STEPS):
                        late = time.perf_counter() >= stop
                        failed = await sender.step(sid, i == 0, late or i == SEQUENCE_STEPS - 1)
                        if failed is not None:
                            tally.count(failed)
                            break  # the sequence cannot go on: a new one
                        if late:
                            break
                        tally.steps += 1
                        tally.count("OK")
            finally:
                await sender.close()

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return tally


def _batch_counts(metrics_url: str) -> tuple[float, float]:
    """Rows and batches the model has run so far (qkv_batch_size's sum and count)."""
    m = scrape(metrics_url)
    rows = sum(v for k, v in m.items() if k.startswith("qkv_batch_size_sum{") and f'model="{MODEL}"' in k)
    batches = sum(v for k, v in m.items() if k.startswith("qkv_batch_size_count{") and f'model="{MODEL}"' in k)
    return rows, batches


def _slice(server: Any, transport: str, concurrency: int, seconds: float, ids: itertools.count[int]) -> dict[str, Any]:
    rows0, batches0 = _batch_counts(server.metrics_url)
    cpu0, client0, t0 = process_cpu(server.process.pid), loadgen.own_cpu(), time.perf_counter()
    tally = asyncio.run(_sequences(server.url, concurrency, seconds, ids, transport))
    wall = time.perf_counter() - t0
    server_cpu, client_cpu = process_cpu(server.process.pid) - cpu0, loadgen.own_cpu() - client0
    rows, batches = (a - b for a, b in zip(_batch_counts(server.metrics_url), (rows0, batches0), strict=True))
    steps = max(1, tally.steps)
    return {
        "steps": tally.steps,
        "steps_per_s": tally.steps / wall,
        "codes": tally.codes or {},
        "mean_batch": rows / batches if batches else 0.0,
        "server_cpu_us_per_step": server_cpu / steps * 1e6,
        "client_cpu_us_per_step": client_cpu / steps * 1e6,
    }


def sequences_bench(out: Path, seconds: float, instances: int = 1) -> dict[str, Any]:
    """Steps/s one sequence at a time and CONCURRENT at once, over each transport, alternating on one server;
    writes sequences.json. `seconds`: each transport's and mode's share of the run, over all rounds."""
    scratch = out / "sequences-scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    models = scratch / f"models-{time.time_ns()}"
    gru_step_model(models, instances)
    servers = Servers(models, scratch)
    ids = itertools.count(1)
    modes = {"one at a time": 1, f"{CONCURRENT} at once": CONCURRENT}
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {t: {m: [] for m in modes} for t in TRANSPORTS}
    try:
        server = servers.start()
        for transport in TRANSPORTS:  # warm: the first requests of each pattern pay for connections and allocations
            for c in modes.values():
                _slice(server, transport, c, min(0.5, seconds / 4), ids)
        for _ in range(ROUNDS):
            for transport in TRANSPORTS:
                for mode, c in modes.items():
                    rounds[transport][mode].append(_slice(server, transport, c, seconds / ROUNDS, ids))
        live = scrape(server.metrics_url).get(f'qkv_live_sequences{{model="{MODEL}",version="1"}}', 0.0)
        bare = bare_rpc(server.url, server.process.pid, CONCURRENT)
    finally:
        servers.close()
    result: dict[str, Any] = {
        "machine": {"cpus": cpus(), "instances": instances, "max_batch_size": CONCURRENT,
                    "max_queue_delay_us": MAX_QUEUE_DELAY_US, "steps_per_sequence": SEQUENCE_STEPS},
        "target": TARGET,
        "live_sequences_after": live,
        "bare_rpc": bare,
    }  # fmt: skip
    one, many = modes
    for transport, by_mode in rounds.items():
        summary = {mode: {**median_of(runs), "codes": _codes(runs)} for mode, runs in by_mode.items()}
        result[transport] = {"ratio": paired_ratio(summary, many, one, "steps_per_s"), **summary}
    result["bare_rpc_bound"] = bare["rps"] / result["unary"]["one at a time"]["steps_per_s"]
    (out / "sequences.json").write_text(json.dumps(result, indent=2))
    return result


def _codes(runs: list[dict[str, Any]]) -> dict[str, int]:
    """The answers' status codes, counted over all the runs."""
    return dict(sum((Counter(r["codes"]) for r in runs), Counter()))


def sequences_table(r: dict[str, Any]) -> str:
    """The figures as BENCHMARKS.md shows them."""
    lines = [
        "| transport | sequences | steps/s | mean batch | server CPU per step | client CPU per step |",
        "|---|---|---|---|---|---|",
    ]
    for transport in TRANSPORTS:
        for mode in ("one at a time", f"{CONCURRENT} at once"):
            m = r[transport][mode]
            lines.append(
                f"| {transport} | {mode} | {m['steps_per_s']:.0f} | {m['mean_batch']:.1f} | "
                f"{m['server_cpu_us_per_step']:.0f} us | {m['client_cpu_us_per_step']:.0f} us |"
            )
    b = r["bare_rpc"]
    lines.append(
        f"| unary | bare RPC (ServerLive), {CONCURRENT} at once | {b['rps']:.0f} calls/s | | "
        f"{b['server_cpu_us']:.0f} us | {b['client_cpu_us']:.0f} us |"
    )
    lines.append("")
    for transport in TRANSPORTS:
        ratio = r[transport]["ratio"]
        verdict = "meets" if ratio >= r["target"] else "misses"
        lines.append(
            f"{transport}: {CONCURRENT} at once / one at a time: {ratio:.2f}x ({verdict} the {r['target']:g}x target)"
        )
    lines.append(
        f"unary bound: bare RPC calls/s / one-at-a-time unary steps/s: {r['bare_rpc_bound']:.2f}x, the most any "
        "batching of unary steps reaches through this front end here"
    )
    return "\n".join(lines)
