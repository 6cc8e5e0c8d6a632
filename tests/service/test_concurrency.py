"""Concurrency when things go wrong: a client that leaves mid-load or mid-unload, the last request of a
leaving version, statistics updated from many threads, a scheduler loop that dies.

A load is held deterministically by a graph file that is a named pipe: onnxruntime's read of it blocks
until the test writes the graph into it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g
from onnx import TensorProto, helper

from service import protocol
from service.config import ServerSettings
from service.errors import Unavailable
from service.models.common import ModelStats
from service.models.tensor.model import TensorModel
from service.observability.metrics import Metrics
from service.scheduling.admission import WorkItem
from service.scheduling.batching import DynamicBatcher, select_batch
from service.scheduling.config import BatchingConfig
from service.scheduling.continuous import GenerationScheduler, WordsRequest
from service.serving.registry import ModelRegistry
from tests.conftest import RunningServer, start_server
from tests.service.queue_helpers import until

Explicit = tuple[RunningServer, g.InferenceServerClient, Path]


def _graph_bytes(factor: float) -> bytes:
    """y = x * factor, x and y FP32 [batch, 3]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [3], [factor] * 3)
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "scale", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _version(model_dir: Path, version: int, factor: float) -> None:
    (model_dir / str(version)).mkdir(parents=True)
    (model_dir / str(version) / "model.onnx").write_bytes(_graph_bytes(factor))


class HeldGraph:
    """Version `version` of a model whose model.onnx is a named pipe: loading it blocks until `release`."""

    def __init__(self, model_dir: Path, version: int, factor: float) -> None:
        (model_dir / str(version)).mkdir(parents=True)
        self.path = model_dir / str(version) / "model.onnx"
        os.mkfifo(self.path)
        self.data = _graph_bytes(factor)
        self.released = False

    def release(self, timeout: float = 60) -> None:
        """Write the graph (once) to the reader the load opened: it goes on. Without a reader, what is
        written would be dropped at close, so the write waits for one (and gives up after `timeout`)."""
        if self.released:
            return
        self.released = True
        end = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no one reads
                break
            except OSError:
                if time.monotonic() > end:
                    return  # the load never opened the graph: the test fails on what it waits for
                time.sleep(0.01)
        try:
            os.set_blocking(fd, True)
            os.write(fd, self.data)
        finally:
            os.close(fd)  # the reader sees the end of the file


def _index(client: g.InferenceServerClient) -> dict[tuple[str, str], tuple[str, str]]:
    rows = client.get_model_repository_index(as_json=True).get("models", [])
    return {(r["name"], r.get("version", "")): (r.get("state", ""), r.get("reason", "")) for r in rows}


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Bounds a test whose condition never comes (and says which); asserts nothing about speed."""
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def _infer(client: g.InferenceServerClient) -> tuple[float, str]:
    x = g.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), np.float32))
    result = client.infer("scale", [x])
    return float(result.as_numpy("y")[0, 0]), result.get_response().model_version


@pytest.fixture
def explicit(tmp_path: Path) -> Iterator[Explicit]:
    repo = tmp_path / "repo"
    (repo / "scale").mkdir(parents=True)
    # one session (and no lone one): one read of a held graph
    (repo / "scale" / "config.json").write_text('{"instances": 1, "lone_request_threads": 0}')
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit"]
    with start_server(args, tmp_path / "log") as server, g.InferenceServerClient(server.url) as client:
        yield server, client, repo


def _leave_early(server: RunningServer, call: str, request: Any) -> None:
    """`call` from a client that gives up after half a second (while the change is held)."""
    with grpc.insecure_channel(server.url) as channel:
        with pytest.raises(grpc.RpcError) as e:
            getattr(protocol.Stub(channel), call)(request, timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


# -- 1. loads and unloads survive a client that leaves ---------------------------------------------


def test_a_load_whose_client_left_still_completes(explicit: Explicit) -> None:
    server, client, repo = explicit
    held = HeldGraph(repo / "scale", 1, 2.0)
    try:
        _leave_early(server, "RepositoryModelLoad", protocol.RepositoryModelLoadRequest(model_name="scale"))
        assert _index(client)[("scale", "1")][0] == "LOADING"
        held.release()
        _wait_for(lambda: _index(client).get(("scale", "1"), ("",))[0] == "READY", "the load finishing READY")
    finally:
        held.release()
    assert client.is_model_ready("scale")
    assert _infer(client) == (2.0, "1")
    assert _index(client) == {("scale", "1"): ("READY", "")}


def test_two_loads_of_one_model_at_once_both_answer_and_build_it_once(explicit: Explicit) -> None:
    server, client, repo = explicit
    held = HeldGraph(repo / "scale", 1, 3.0)
    answers: list[str] = []

    def load() -> None:
        with g.InferenceServerClient(server.url) as c:
            c.load_model("scale")
        answers.append("ok")

    threads = [threading.Thread(target=load) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        _wait_for(lambda: _index(client).get(("scale", "1"), ("",))[0] == "LOADING", "the first load building")
        held.release()  # one write: a second build would wait on the pipe for ever
        for t in threads:
            t.join(60)
    finally:
        held.release()
    assert answers == ["ok", "ok"]
    assert _infer(client) == (3.0, "1")
    assert server.log.read_text().count("model 'scale' version 1 built") == 1


def test_an_unload_whose_client_left_still_happens(explicit: Explicit) -> None:
    server, client, repo = explicit
    _version(repo / "scale", 1, 1.0)
    client.load_model("scale")
    held = HeldGraph(repo / "scale", 2, 2.0)  # the next load builds version 2 and holds the model's changes
    loaded: list[str] = []

    def load() -> None:
        with g.InferenceServerClient(server.url) as c:
            c.load_model("scale")
        loaded.append("ok")

    loading = threading.Thread(target=load)
    try:
        loading.start()
        _wait_for(lambda: _index(client).get(("scale", "2"), ("",))[0] == "LOADING", "version 2 building")
        _leave_early(server, "RepositoryModelUnload", protocol.RepositoryModelUnloadRequest(model_name="scale"))
        held.release()
        loading.join(60)
    finally:
        held.release()
    assert loaded == ["ok"]
    _wait_for(lambda: _index(client) == {("scale", ""): ("UNAVAILABLE", "unloaded")}, "the unload done")
    assert not client.is_model_ready("scale")
    held.path.unlink()
    held.path.write_bytes(held.data)  # a plain file now: a load reads it at once
    client.load_model("scale")
    assert _infer(client) == (2.0, "2")


def _registry(tmp_path: Path) -> ModelRegistry:
    repo = tmp_path / "repo"
    _version(repo / "scale", 1, 2.0)
    settings = ServerSettings(model_repository=repo, model_control_mode="explicit", load_model=("scale",))
    return ModelRegistry(settings, Metrics(enabled=False))


async def _turns(n: int) -> None:
    """`n` turns of the event loop, no timer involved."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_an_unload_cancelled_while_a_request_holds_the_version_frees_it_once_the_request_ends(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        registry = _registry(tmp_path)
        await registry.start()
        model = registry.get("scale")
        assert isinstance(model, TensorModel)
        lease = model.in_flight.lease()  # a request between its lookup and its answer
        lease.__enter__()
        unload = asyncio.create_task(registry.unload("scale"))
        await until(lambda: registry.index()[0].state == "UNLOADING", "the version leaving")
        unload.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await unload
        assert registry.index()[0].state == "UNLOADING"  # still waiting for the request, not abandoned
        lease.__exit__(None, None, None)
        # The last lease wakes the unload: it ends within a few turns of the loop, without a timer.
        await _turns(20)
        assert [(r.state, r.reason) for r in registry.index()] == [("UNAVAILABLE", "unloaded")]
        assert model.runtime.sessions == []  # freed
        await registry.load("scale")
        served = registry.get("scale")
        result = await served.infer({"x": np.ones((1, 3), np.float32)}, [], {}, None)
        assert result.outputs["y"].tolist() == [[2.0, 2.0, 2.0]]
        await registry.close()

    asyncio.run(run())


# -- 2. leases, not sleeps -----------------------------------------------------------------------------


class Gated:
    """run_batch: each payload times two, the first batch held until `gate` opens."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.batches = 0

    def __call__(self, items: list[WorkItem], instance: int) -> list[Any]:
        self.batches += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return [x.payload * 2 for x in items]


def _item(payload: Any, length: int = 40) -> WorkItem:
    return WorkItem(1, length, payload, asyncio.get_running_loop().create_future())


NOT_INLINE = BatchingConfig(inline_max_tokens=0)  # every request through the dispatcher


def test_a_batcher_closes_as_its_last_batch_is_answered() -> None:
    async def run() -> None:
        model = Gated()
        b = DynamicBatcher("m", NOT_INLINE, model, instances=1)
        b.start()
        first = asyncio.create_task(b.submit(_item(1)))
        await until(lambda: model.batches == 1, "the first batch computing")
        second = asyncio.create_task(b.submit(_item(2)))
        await until(lambda: len(b.queue) == 1, "a request queued behind it")
        closing = asyncio.create_task(b.close())
        await _turns(20)
        assert not closing.done()  # queued and running requests are still answered
        model.gate.set()
        assert await first == 2 and await second == 4
        await _turns(20)  # woken by the batch's end, not by a timer
        assert closing.done()
        await closing
        with pytest.raises(Unavailable, match="'m' is shutting down"):
            await b.submit(_item(3))

    asyncio.run(run())


# -- 3. statistics -------------------------------------------------------------------------------------


def test_statistics_updated_from_many_threads_at_once_are_exact() -> None:
    stats = ModelStats()
    threads, updates = 8, 5000
    item = SimpleNamespace(arrived=10.0, started=11.0)  # a second queued, each time
    barrier = threading.Barrier(threads)
    interval = os.sys.getswitchinterval()  # type: ignore[attr-defined]

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(updates):
            stats.account_request(item)  # type: ignore[arg-type]
            stats.executed(rows=i + 1, ns=7)
            stats.answered(ok=i % 2 == 0, ns=3)

    os.sys.setswitchinterval(1e-6)  # type: ignore[attr-defined]  # threads switch as often as they can
    try:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        os.sys.setswitchinterval(interval)  # type: ignore[attr-defined]
    s = stats.snapshot()
    n = threads * updates
    assert s.queue_ns == n * 1_000_000_000
    assert s.execution_count == n and s.compute_ns == 7 * n
    assert s.inference_count == updates * sum(range(1, threads + 1))
    assert s.batches == {i + 1: [updates, 7 * updates] for i in range(threads)}
    assert (s.success_count, s.fail_count) == (n // 2, n // 2)
    assert s.success_ns == s.fail_ns == 3 * n // 2


# -- 4. a scheduler loop that dies --------------------------------------------------------------------


def broken_selection(queue: Sequence[WorkItem], *limits: Any) -> list[int]:
    """The choice of the next batch, raising on a queue that holds payload 0: the dispatcher dies."""
    if any(x.payload == 0 for x in queue):
        raise RuntimeError("selection broke")
    return select_batch(queue, *limits)


def always_broken(queue: Sequence[WorkItem], *limits: Any) -> list[int]:
    raise RuntimeError("selection broke")


def test_a_dispatcher_that_dies_fails_its_requests_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        model = Gated()
        failures: list[Exception] = []
        b = DynamicBatcher("m", NOT_INLINE, model, instances=1)
        b.select = broken_selection
        b.on_failure = failures.append
        b.start()
        first = asyncio.create_task(b.submit(_item(1)))
        await until(lambda: model.batches == 1, "the first batch computing")
        queued = asyncio.create_task(b.submit(_item(2)))
        poison = asyncio.create_task(b.submit(_item(0)))  # the selection raises on it
        await until(lambda: len(b.queue) == 2, "two requests queued")
        model.gate.set()  # the first batch ends; the dispatcher picks the next one and dies
        assert await first == 2
        for task in (queued, poison):
            with pytest.raises(Unavailable, match="model 'm' is unavailable: its batch scheduler failed"):
                await task
        with pytest.raises(Unavailable, match="model 'm' is unavailable: its batch scheduler failed"):
            await b.submit(_item(5))  # and every request after
        assert len(failures) == 1 and "selection broke" in str(failures[0])
        assert b.admission.queued_requests == 0 and b.queue == []
        await asyncio.wait_for(b.close(), 60)  # a bound on a hang, not a speed

    with caplog.at_level(logging.ERROR, logger="qkv.batching"):
        asyncio.run(run())
    died = [r for r in caplog.records if "batch scheduler failed" in r.getMessage()]
    assert len(died) == 1 and died[0].exc_info is not None and "selection broke" in str(died[0].exc_info[1])


class BrokenAdmission(GenerationScheduler):
    """A g2p scheduler whose decoding loop raises outside a step."""

    def _admit_into(self, batch: Any) -> list[Any]:
        raise RuntimeError("admission broke")


def test_a_decoding_thread_that_dies_fails_its_requests_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        failures: list[Exception] = []
        s = BrokenAdmission("g", BatchingConfig(), [object(), object()])  # type: ignore[list-item]
        s.on_failure = failures.append
        s.start()
        words = WorkItem(1, 5, WordsRequest([[1, 2, 3]], 10), asyncio.get_running_loop().create_future())
        with pytest.raises(Unavailable, match="model 'g' is unavailable: its decoding thread failed"):
            await s.submit(words)
        later = WorkItem(1, 5, WordsRequest([[1, 2, 3]], 10), asyncio.get_running_loop().create_future())
        with pytest.raises(Unavailable, match="model 'g' is unavailable: its decoding thread failed"):
            await s.submit(later)
        await until(lambda: failures, "the failure reported")
        assert len(failures) == 1 and "admission broke" in str(failures[0])
        assert s.admission.queued_requests == 0
        await asyncio.wait_for(s.close(), 60)  # every thread stops; a bound on a hang, not a speed

    with caplog.at_level(logging.ERROR, logger="qkv.scheduler"):
        asyncio.run(run())
    died = [r for r in caplog.records if "decoding thread failed" in r.getMessage()]
    assert died and died[0].exc_info is not None and "admission broke" in str(died[0].exc_info[1])


def test_a_version_whose_scheduler_died_is_no_longer_ready_and_reloads(tmp_path: Path) -> None:
    async def run() -> None:
        registry = _registry(tmp_path)
        await registry.start()
        model = registry.get("scale")
        assert isinstance(model, TensorModel)

        model.batcher.select = always_broken
        model.batcher.config = NOT_INLINE
        with pytest.raises(Unavailable, match="model 'scale' is unavailable: its batch scheduler failed"):
            await model.infer({"x": np.ones((1, 3), np.float32)}, [], {}, None)
        await until(lambda: registry.index()[0].state == "UNAVAILABLE", "the version marked unavailable")
        (row,) = registry.index()
        assert "batch scheduler failed" in row.reason and "selection broke" in row.reason
        with pytest.raises(Unavailable, match="Request for unknown model: 'scale' has no available versions"):
            registry.get("scale")
        await until(lambda: model.runtime.sessions == [], "the dead version freed")
        await registry.load("scale")  # a reload brings it back
        result = await registry.get("scale").infer({"x": np.ones((1, 3), np.float32)}, [], {}, None)
        assert result.outputs["y"].tolist() == [[2.0, 2.0, 2.0]]
        await registry.close()

    asyncio.run(run())
