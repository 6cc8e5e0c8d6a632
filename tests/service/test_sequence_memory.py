"""Abandoned sequences leave nothing behind: 10,000 sequences started over gRPC and never ended, each
holding 8 KiB of implicit state, are freed by the reaper once idle (no request comes after the last of
them), the live-sequence and state metrics return to 0, and the server's resident memory returns to
within 10 % of what it was after a warm-up of the same kind."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcsync
import tritonclient.grpc.aio as grpcclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service.tools.bench.servers import scrape
from tests.conftest import RunningServer, start_server, stop_server

MODEL = "abandoned"
STATE = 2048  # FP32 elements of state a sequence: 8 KiB (10,000 kept would be 80 MiB)
IDLE_US = 200_000
CLIENTS = 32
WARM_UP, SEQUENCES = 2_000, 10_000


def _model(root: Path) -> None:
    """STATE_OUT = STATE_IN + INPUT (broadcast over the state), OUTPUT its largest element."""
    nodes = [
        helper.make_node("Add", ["STATE_IN", "INPUT"], ["STATE_OUT"]),
        helper.make_node("ReduceMax", ["STATE_OUT"], ["OUTPUT"], axes=[1], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        MODEL,
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, ["batch", STATE]),
        ],
        [
            helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("STATE_OUT", TensorProto.FLOAT, ["batch", STATE]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    (root / MODEL / "1").mkdir(parents=True)
    onnx.save(model, str(root / MODEL / "1" / "model.onnx"))
    config = {
        "max_batch_size": 32,
        "instances": 1,
        "sequence_batching": {
            "max_sequence_idle_microseconds": IDLE_US,
            "max_sequences": 4096,
            "oldest": {},
            "state": [{"input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "TYPE_FP32",
                       "dims": [STATE]}],
        },
    }  # fmt: skip
    (root / MODEL / "config.json").write_text(json.dumps(config))


async def _abandon(url: str, ids: range) -> dict[str, int]:
    """Start one sequence per id (its first step only: never ended), CLIENTS at a time; their outcomes.
    A sequence refused for the bounds (RESOURCE_EXHAUSTED) is started again after the wait it was told."""
    codes: dict[str, int] = {}
    todo = iter(ids)
    x = grpcclient.InferInput("INPUT", [1, 1], "FP32")
    x.set_data_from_numpy(np.ones((1, 1), np.float32))
    async with grpcclient.InferenceServerClient(url) as client:

        async def worker() -> None:
            for sid in todo:
                while True:
                    try:
                        r = await client.infer(MODEL, [x], sequence_id=sid, sequence_start=True, client_timeout=60)
                    except InferenceServerException as e:
                        if e.status() == "StatusCode.RESOURCE_EXHAUSTED":
                            await asyncio.sleep(IDLE_US / 1e6)
                            continue
                        codes[str(e.status())] = codes.get(str(e.status()), 0) + 1
                        break
                    assert r.as_numpy("OUTPUT")[0, 0] == 1.0  # a new sequence's state: zeros, plus 1
                    codes["OK"] = codes.get("OK", 0) + 1
                    break

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    return codes


def _series(server: RunningServer) -> dict[str, float]:
    m = scrape(server.metrics_url)
    labels = f'{{model="{MODEL}",version="1"}}'
    names = ("qkv_live_sequences", "qkv_sequence_state_bytes", "qkv_expired_sequences_total")
    return {name: m.get(name + labels, 0.0) for name in names}


def _rss_kib(server: RunningServer) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/<pid>/status")


def _all_freed(server: RunningServer, expired: int) -> dict[str, float]:
    """Waits (no request sent: only the metrics read) until every sequence started has been freed."""
    for _ in range(1200):  # bounds only a hang: 10,000 sequences idle out within IDLE_US of the last one
        s = _series(server)
        if s["qkv_expired_sequences_total"] >= expired:
            return s
        time.sleep(0.1)
    raise AssertionError(f"sequences never freed: {s}")


def test_ten_thousand_abandoned_sequences_are_freed_and_memory_returns(tmp_path: Path) -> None:
    _model(tmp_path / "models")
    server = start_server(["--model-repository", str(tmp_path / "models")], tmp_path / "server.log")
    try:
        assert asyncio.run(_abandon(server.url, range(1, WARM_UP + 1))) == {"OK": WARM_UP}
        after_warm_up = _all_freed(server, WARM_UP)
        before = _rss_kib(server)
        assert asyncio.run(_abandon(server.url, range(WARM_UP + 1, WARM_UP + SEQUENCES + 1))) == {"OK": SEQUENCES}
        during = _series(server)
        done = _all_freed(server, WARM_UP + SEQUENCES)
        after = _rss_kib(server)
        print(
            f"\n{SEQUENCES} abandoned sequences of {STATE * 4} state bytes: RSS {before / 1024:.1f} MiB after the "
            f"warm-up, {after / 1024:.1f} MiB after they were freed ({after / before - 1:+.1%}); "
            f"{during['qkv_live_sequences']:.0f} live ({during['qkv_sequence_state_bytes'] / 2**20:.1f} MiB of state) "
            f"as the last was sent; expired {done['qkv_expired_sequences_total']:.0f}"
        )
        for s in (after_warm_up, done):
            assert s["qkv_live_sequences"] == 0 and s["qkv_sequence_state_bytes"] == 0, s
        assert done["qkv_expired_sequences_total"] == WARM_UP + SEQUENCES
        assert after <= before * 1.10, (before, after)
        # a freed sequence is gone: its next step is refused, naming it
        client = grpcsync.InferenceServerClient(server.url)
        x = grpcsync.InferInput("INPUT", [1, 1], "FP32")
        x.set_data_from_numpy(np.ones((1, 1), np.float32))
        with pytest.raises(InferenceServerException, match=f"sequence {WARM_UP + SEQUENCES} is not live") as e:
            client.infer(MODEL, [x], sequence_id=WARM_UP + SEQUENCES)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        client.close()
    finally:
        stop_server(server)
    assert "Traceback" not in server.output()
