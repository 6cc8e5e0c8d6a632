"""Reliability on a real server: overload, SIGKILL and restart, file descriptors, and a model that fails at run time.

One temporary repository for the module: the shipped `g2p_encoder` graph with a small
`max_queue_wait_ms` (so overload is refused early), and `gather`, a user tensor model whose graph
fails inside onnxruntime for some inputs (a Gather whose indices come from the request).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from service import protocol
from service.tools.client import Client
from service.tools.loadgen import closed_loop, encoder_request, open_loop, summarise
from tests.conftest import MODELS, start_server, stop_server

SEQ = 256
WAIT = 60.0  # the longest a call or a restart is waited for
VOCAB = 33
GATHER_TABLE = [10.0 * k for k in range(10)]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reliability") / "models"
    encoder = root / "g2p_encoder"
    encoder.mkdir(parents=True)
    (encoder / "1").symlink_to(MODELS / "g2p_encoder" / "1", target_is_directory=True)
    config = json.loads((MODELS / "g2p_encoder" / "config.json").read_text())
    config["batching"] = {"max_queue_wait_ms": 50}
    (encoder / "config.json").write_text(json.dumps(config))
    # gather: out[b, k] = table[idx[b, k]]; an index outside [-10, 9] fails inside onnxruntime
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, ["batch", "k"])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "k"])
    table = helper.make_tensor("table", TensorProto.FLOAT, [10], GATHER_TABLE)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "idx"], ["out"])], "gather", [idx], [out], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (root / "gather" / "1").mkdir(parents=True)
    onnx.save(model, str(root / "gather" / "1" / "model.onnx"))
    (root / "gather" / "config.json").write_text(json.dumps({"batching": {"enabled": False}}))  # a batch = a request
    return root


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fixed_input() -> tuple[object, np.ndarray]:
    """A fixed seq-256 encoder request and its expected last_hidden_state from onnxruntime directly."""
    request = encoder_request(SEQ, VOCAB, np.random.default_rng(1234))
    ids = np.frombuffer(request.raw_input_contents[0], np.int64).reshape(1, SEQ)
    session = ort.InferenceSession(str(MODELS / "g2p_encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (expected,) = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    return request, expected


def hidden_state(reply: object) -> np.ndarray:
    tensor = reply.outputs[0]  # type: ignore[attr-defined]
    assert tensor.name == "last_hidden_state" and tensor.datatype == "FP32"
    return np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(tuple(tensor.shape))  # type: ignore[attr-defined]


# --- (a) overload ----------------------------------------------------------------------------------


def test_overload_is_refused_cleanly_and_admitted_requests_are_correct(repo: Path, tmp_path: Path) -> None:
    s = start_server(["--model-repository", str(repo)], tmp_path / "log")
    try:
        pid = s.process.pid
        request, expected = fixed_input()
        rng = np.random.default_rng(7)
        big = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(s.url, options=big) as ch:  # warm-up: each batch size the load forms
            stub = protocol.Stub(ch)
            for rows in (1, 2, 4, 8, 16, 32, 1, 32):
                ids = rng.integers(4, VOCAB, size=(rows, SEQ), dtype=np.int64)
                warm = protocol.ModelInferRequest(model_name="g2p_encoder")
                warm.inputs.add(name="input_ids", datatype="INT64", shape=[rows, SEQ])
                warm.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, SEQ])
                warm.raw_input_contents.extend([ids.tobytes(), np.ones_like(ids).tobytes()])
                assert hidden_state(stub.ModelInfer(warm, timeout=30)).shape == (rows, SEQ, 192)
            assert np.abs(hidden_state(stub.ModelInfer(request, timeout=30)) - expected).max() < 1e-4
        make = lambda i: (encoder_request(SEQ, VOCAB, np.random.default_rng(i)), SEQ, "load")  # noqa: E731
        # Overload is relative to what this machine serves: four times its capacity, measured here by a
        # closed loop of 4, which keeps both instances busy and never waits the 50 ms objective. (A closed
        # loop of 16 did on a slower VM: refused, it spun, and its 11-22 OK/s were a third of capacity.)
        capacity = summarise(asyncio.run(closed_loop(s.url, make, 4, 1.5)))["rps"]
        rate = 4 * capacity
        time.sleep(0.5)
        baseline = rss_kb(pid)

        checked: Counter[str] = Counter()
        refusals: set[str] = set()  # what the refusals of the fixed input said, up to its colon
        worst = [0.0]

        async def verify(rate: float, seconds: float) -> None:
            """The fixed input at `rate`/s alongside the load; every admitted answer is compared."""
            async with grpc.aio.insecure_channel(s.url) as channel:
                stub = protocol.Stub(channel)

                async def one() -> None:
                    try:
                        reply = await stub.ModelInfer(request, timeout=30)
                    except grpc.aio.AioRpcError as e:
                        checked[e.code().name] += 1
                        refusals.add((e.details() or "").split(":")[0])
                        return
                    worst[0] = max(worst[0], float(np.abs(hidden_state(reply) - expected).max()))
                    checked["OK"] += 1

                t0, tasks = time.perf_counter(), []
                for i in range(int(rate * seconds)):
                    await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                    tasks.append(asyncio.create_task(one()))
                await asyncio.gather(*tasks)

        async def load() -> dict[str, object]:
            run, _ = await asyncio.gather(open_loop(s.url, make, rate=rate, seconds=4.0), verify(40, 4.0))
            return summarise(run)

        # Two rounds: the first grows the allocator's arenas to the overload's peak (by how much varies
        # from run to run); a leak would grow again in the second, an allocator that has settled does not.
        summary = asyncio.run(load())
        time.sleep(1.0)  # let the load settle
        first = rss_kb(pid)
        checked.clear()
        summary = asyncio.run(load())
        codes = dict(summary["codes"])  # type: ignore[call-overload]
        time.sleep(1.0)
        after = rss_kb(pid)
        print(
            f"\noverload: capacity {capacity:.0f}/s, offered {rate:.0f}/s: {codes}, ok {summary['rps']:.0f}/s, "
            f"p99 {summary['p99_ms']:.0f} ms;"
            f" verified {dict(checked)}, max |diff| {worst[0]:.2e};"
            f" RSS {baseline / 1024:.0f} -> {first / 1024:.0f} -> {after / 1024:.0f} MiB"
        )
        # Every request was admitted and answered within its 30 s deadline, or refused at once: nothing
        # sat in a queue until its deadline. (How long answers took is a figure, printed above.)
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert set(checked) <= {"OK", "RESOURCE_EXHAUSTED"}, checked
        assert codes.get("RESOURCE_EXHAUSTED", 0) > 0 and codes.get("OK", 0) > 0  # over capacity: refuses, serves
        # refused by the admission's rule for this model, with its message
        assert refusals <= {"model 'g2p_encoder' is overloaded"}, refusals
        assert checked["OK"] > 0 and worst[0] < 1e-4
        assert after - baseline < 192 * 1024, (baseline, first, after)  # kB: bounded by the overload's peak
        assert after - first < 32 * 1024, (baseline, first, after)  # and no growth once the arenas have settled
        assert s.process.poll() is None
    finally:
        stop_server(s)


# --- (b) SIGKILL and restart -----------------------------------------------------------------------


def test_the_client_rides_out_a_sigkill_and_restart(repo: Path, tmp_path: Path) -> None:
    s = start_server(["--model-repository", str(repo)], tmp_path / "log1")
    port = s.url.rsplit(":", 1)[1]
    request = encoder_request(8, VOCAB, np.random.default_rng(3))
    calls: list[tuple[float, float, str]] = []  # (start, end, outcome)
    stop = threading.Event()

    def worker() -> None:
        with Client(s.url, timeout=WAIT) as client:  # the retries ride out a restart however long it takes
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    reply = client.infer(request)
                    outcome = "OK" if hidden_state(reply).shape == (1, 8, 192) else "WRONG"
                except grpc.RpcError as e:
                    outcome = e.code().name
                calls.append((t0, time.monotonic(), outcome))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    restarted = None
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        killed = time.monotonic()
        s.process.kill()  # SIGKILL: no drain, connections cut mid-call
        s.process.wait()
        stop_server(s)
        # while it is down, a call without retries fails at once: the retries below are what carries the client
        with grpc.insecure_channel(s.url) as ch:
            with pytest.raises(grpc.RpcError) as e:
                protocol.Stub(ch).ModelInfer(request, timeout=WAIT)  # refused at once: nothing listens
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        time.sleep(0.5)
        restarted = start_server(["--model-repository", str(repo), "--grpc-port", port], tmp_path / "log2")
        back = time.monotonic()
        assert restarted.url == s.url
        deadline = time.monotonic() + WAIT
        while not any(c[0] > back for c in calls):  # and the client goes on calling afterwards
            assert time.monotonic() < deadline, f"no call started after the restart within {WAIT:g} s"
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT + 5)
        if restarted is not None:
            stop_server(restarted)
        else:
            stop_server(s)
    outcomes = Counter(c[2] for c in calls)
    interrupted = [c for c in calls if c[0] < killed and c[1] > back]  # in flight at the kill, done after restart
    print(f"\nkill/restart: {dict(outcomes)}, {len(interrupted)} calls spanned the outage of {back - killed:.1f} s")
    assert set(outcomes) == {"OK"}, outcomes
    assert len(interrupted) >= 1
    assert sum(1 for c in calls if c[0] > back) > 0  # and it keeps going afterwards


# --- (c) file descriptors --------------------------------------------------------------------------


def test_no_file_descriptor_leak_over_thousands_of_requests(tmp_path: Path) -> None:
    # The encoder with a queue objective no burst here can reach: every request is computed or refused as
    # bad, whatever this machine's speed (overload refusals are the test above's subject).
    repo = tmp_path / "models"
    (repo / "g2p_encoder").mkdir(parents=True)
    (repo / "g2p_encoder" / "1").symlink_to(MODELS / "g2p_encoder" / "1", target_is_directory=True)
    config = json.loads((MODELS / "g2p_encoder" / "config.json").read_text())
    config["batching"] = {"max_queue_wait_ms": 600_000}
    (repo / "g2p_encoder" / "config.json").write_text(json.dumps(config))
    s = start_server(["--model-repository", str(repo)], tmp_path / "log")
    pid = s.process.pid
    good = encoder_request(4, VOCAB, np.random.default_rng(5))
    bad = encoder_request(4, VOCAB, np.random.default_rng(5))
    bad.inputs[1].shape[1] = 5  # type: ignore[attr-defined]  # INVALID_ARGUMENT

    async def burst(n: int) -> Counter[tuple[str, str]]:
        """`n` requests on a fresh connection (opened and closed), mixed good and bad, some cancelled by deadline."""
        out: Counter[tuple[str, str]] = Counter()
        async with grpc.aio.insecure_channel(s.url) as channel:
            stub = protocol.Stub(channel)

            async def one(i: int) -> None:
                kind = "bad" if i % 5 == 0 else "good"
                try:
                    await stub.ModelInfer(bad if i % 5 == 0 else good, timeout=0.001 if i % 50 == 1 else WAIT)
                    out[kind, "OK"] += 1
                except grpc.aio.AioRpcError as e:
                    out[kind, e.code().name] += 1

            await asyncio.gather(*(one(i) for i in range(n)))
        return out

    async def many(connections: int, per: int) -> Counter[tuple[str, str]]:
        total: Counter[tuple[str, str]] = Counter()
        for _ in range(connections):
            total += await burst(per)
        return total

    try:
        asyncio.run(many(3, 50))  # warm-up: threads, epoll, the first connections
        time.sleep(0.5)
        before = fds(pid)
        codes = asyncio.run(many(30, 100))
        time.sleep(1.0)  # closed connections are reaped
        after = fds(pid)
        print(f"\nfds: {before} before, {after} after {sum(codes.values())} requests on 30 connections {dict(codes)}")
        # Each request had its designed answer: a bad one refused as bad, a good one computed, unless it
        # was one of the 60 given a 1 ms deadline (those may also run out of time).
        assert codes["bad", "INVALID_ARGUMENT"] == 600 and codes["good", "OK"] >= 2400 - 60, codes
        designed = {("good", "OK"), ("good", "DEADLINE_EXCEEDED"), ("bad", "INVALID_ARGUMENT")}
        assert sum(codes.values()) == 3000 and set(codes) <= designed, codes
        assert after <= before + 3, (before, after)
    finally:
        stop_server(s)


# --- fault isolation -------------------------------------------------------------------------------


def _gather(indices: list[int]) -> object:
    req = protocol.ModelInferRequest(model_name="gather")
    req.inputs.add(name="idx", datatype="INT64", shape=[1, len(indices)])
    req.raw_input_contents.append(np.array([indices], np.int64).tobytes())
    return req


def test_a_runtime_failure_fails_only_its_batch_and_the_server_keeps_serving(repo: Path, tmp_path: Path) -> None:
    s = start_server(["--model-repository", str(repo)], tmp_path / "log")
    try:
        with grpc.insecure_channel(s.url) as ch:
            stub = protocol.Stub(ch)
            reply = stub.ModelInfer(_gather([1, 2, 9]), timeout=10)
            assert gathered(reply).tolist() == [[10.0, 20.0, 90.0]]
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(_gather([1, 20]), timeout=10)  # index 20 of a 10-entry table: onnxruntime fails
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # it fails alone: its inputs are at fault
            assert "model 'gather' cannot run on this request's inputs: " in e.value.details()
            assert gathered(stub.ModelInfer(_gather([3]), timeout=10)).tolist() == [[30.0]]

        async def mixed() -> list[str]:
            async with grpc.aio.insecure_channel(s.url) as channel:
                stub = protocol.Stub(channel)

                async def one(i: int) -> str:
                    try:
                        r = await stub.ModelInfer(_gather([99] if i % 4 == 0 else [i % 10]), timeout=10)
                        return "OK" if gathered(r).tolist() == [[GATHER_TABLE[i % 10]]] else "WRONG"
                    except grpc.aio.AioRpcError as e:
                        return e.code().name

                return list(await asyncio.gather(*(one(i) for i in range(40))))

        outcomes = asyncio.run(mixed())
        assert [o for i, o in enumerate(outcomes) if i % 4 == 0] == ["INVALID_ARGUMENT"] * 10
        assert [o for i, o in enumerate(outcomes) if i % 4] == ["OK"] * 30  # a batch-mate's failure: retried apart
        with grpc.insecure_channel(s.url) as ch:  # the other models never noticed
            request, expected = fixed_input()
            assert np.abs(hidden_state(protocol.Stub(ch).ModelInfer(request, timeout=30)) - expected).max() < 1e-4
        assert s.process.poll() is None
        log = s.output()
        assert log.count("model 'gather': a request failed alone") == 11, log[-2000:]
    finally:
        stop_server(s)


def gathered(reply: object) -> np.ndarray:
    tensor = reply.outputs[0]  # type: ignore[attr-defined]
    return np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(tuple(tensor.shape))  # type: ignore[attr-defined]
