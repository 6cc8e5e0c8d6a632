"""dynamic_batching's queue fields on a real server: queue policies (max_queue_size, default_timeout_microseconds
with REJECT and DELAY, allow_timeout_override with the request's `timeout`, priority_queue_policy per level),
preferred_batch_size and the request's `priority`.

Each test holds a model's one instance busy with a blocker: a request whose LOOPS input makes the graph loop
long enough (sized once from a measured run) for the requests behind it to be queued. The test checks that the
blocker was still computing when the last of them had queued, and otherwise runs again with a blocker four
times as long; it asserts decisions (refused, answered, in which order, batch sizes), never timings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as g
import tritonclient.grpc.aio as ga
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service.tools.bench.servers import scrape
from tests.conftest import RunningServer, start_server, stop_server
from tests.service.queue_helpers import until


def _slow_graph(directory: Path) -> None:
    """INPUT0 INT32 [batch, 16], LOOPS INT64 [batch, 1] -> OUTPUT0 = INPUT0, after max(LOOPS) rounds of a
    64 x 64 matrix product (a Loop whose result is folded into OUTPUT0 as a zero)."""
    x = helper.make_tensor_value_info("INPUT0", TensorProto.INT32, ["batch", 16])
    loops = helper.make_tensor_value_info("LOOPS", TensorProto.INT64, ["batch", 1])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, ["batch", 16])
    rng = np.random.default_rng(0)
    w = helper.make_tensor("W", TensorProto.FLOAT, [64, 64], (rng.standard_normal(64 * 64) / 8).tolist())
    v0 = helper.make_tensor("V0", TensorProto.FLOAT, [1, 64], [0.01] * 64)
    zero = helper.make_tensor("ZERO", TensorProto.FLOAT, [], [0.0])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["v", "W"], ["p"]), helper.make_node("Tanh", ["p"], ["v_out"]),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "spin",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 64])],
    )  # fmt: skip
    nodes = [
        helper.make_node("ReduceMax", ["LOOPS"], ["m"], keepdims=0),
        helper.make_node("Loop", ["m", "", "V0"], ["v"], body=body),
        helper.make_node("ReduceSum", ["v"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "ZERO"], ["z"]),
        helper.make_node("Cast", ["z"], ["zi"], to=TensorProto.INT32),
        helper.make_node("Add", ["INPUT0", "zi"], ["OUTPUT0"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "slow", [x, loops], [y], [w, v0, zero]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))


def _pbtxt(name: str, max_batch_size: int, dynamic_batching: str) -> str:
    return f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }}, {{ name: "LOOPS" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ {dynamic_batching} }}
parameters {{ key: "intra_op_thread_count" value {{ string_value: "1" }} }}
parameters {{ key: "batching.inline_max_tokens" value {{ string_value: "0" }} }}
"""


MODELS = {
    # level 2 (the default) queues at most 2 requests, level 1 at most 1
    "bounded": (1, "priority_levels: 2 default_priority_level: 2 default_queue_policy { max_queue_size: 2 } "
                   "priority_queue_policy { key: 1 value { max_queue_size: 1 } }"),
    # level 1: REJECT after 1 ms queued; level 2: DELAY after 1 ms; level 3 (the default): REJECT after 600 s,
    # which a request's `timeout` may shorten
    "timeouts": (1, "priority_levels: 3 default_priority_level: 3 "
                    "default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 600000000 "
                    "allow_timeout_override: true } "
                    "priority_queue_policy { key: 1 value { timeout_action: REJECT "
                    "default_timeout_microseconds: 1000 } } "
                    "priority_queue_policy { key: 2 value { timeout_action: DELAY "
                    "default_timeout_microseconds: 1000 } }"),
    "preferred": (8, "preferred_batch_size: [ 4, 2 ] max_queue_delay_microseconds: 100"),
    "ordered": (1, "priority_levels: 2 default_priority_level: 2"),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("queues")
    for name, (max_batch_size, batching) in MODELS.items():
        _slow_graph(root / name)
        (root / name / "config.pbtxt").write_text(_pbtxt(name, max_batch_size, batching))
    s = start_server(["--model-repository", str(root)], root.parent / "server.log")
    yield s
    stop_server(s)


def _inputs(loops: int = 1) -> list[Any]:
    x, n = ga.InferInput("INPUT0", [1, 16], "INT32"), ga.InferInput("LOOPS", [1, 1], "INT64")
    x.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    n.set_data_from_numpy(np.array([[loops]], dtype=np.int64))
    return [x, n]


@pytest.fixture(scope="module")
def blocker_loops(server: RunningServer) -> int:
    """Loops for a blocker of about a second and a half on this machine (measured on a first blocker)."""
    client = g.InferenceServerClient(server.url)
    start = time.monotonic()
    client.infer("ordered", _inputs(20_000))
    seconds = time.monotonic() - start
    return max(20_000, int(20_000 * 1.5 / max(seconds, 1e-3)))


def _gauge(server: RunningServer, name: str, model: str) -> float:
    return scrape(server.metrics_url).get(f'{name}{{model="{model}",version="1"}}', 0.0)


def _seen(server: RunningServer, model: str) -> float:
    """Requests `model` has queued or answered: it grows when one arrives, and stays when a queued one is
    answered (refused past its timeout, say)."""
    metrics = scrape(server.metrics_url)
    answered = sum(v for k, v in metrics.items() if k.startswith("qkv_requests_total{") and f'model="{model}"' in k)
    return metrics.get(f'qkv_queue_depth{{model="{model}",version="1"}}', 0.0) + answered


Send = Callable[..., Awaitable[int]]  # send(**infer's keywords) -> the request's index, once it is queued


async def _held(server: RunningServer, model: str, loops: int, queue: Callable[[Send], Awaitable[None]]) -> list[str]:
    """Run `queue(send)` while a blocker holds `model`'s instance; what each request sent was answered ('OK' or
    its status and message), in the order the answers came. Runs again with a blocker four times as long when
    the blocker was not computing to the end of `queue`."""
    for _ in range(3):
        held, answered = await _attempt(server, model, loops, queue)
        if held:
            return answered
        loops *= 4
    raise AssertionError(f"no blocker held {model}'s instance while the requests queued")


async def _attempt(
    server: RunningServer, model: str, loops: int, queue: Callable[[Send], Awaitable[None]]
) -> tuple[bool, list[str]]:
    """One try of `_held`: whether the blocker held to the end of `queue`, and the answers."""
    answered: list[str] = []
    tasks: list[asyncio.Task[Any]] = []
    async with ga.InferenceServerClient(server.url) as client:

        async def send(**kw: Any) -> int:
            seen = _seen(server, model)
            index = len(tasks)
            task = asyncio.create_task(client.infer(model, _inputs(), **kw))
            task.add_done_callback(lambda t: answered.append(f"{index} {_result(t)}"))
            tasks.append(task)
            await until(lambda: task.done() or _seen(server, model) > seen, "it queued")
            return index

        blocker = asyncio.create_task(client.infer(model, _inputs(loops)))
        await until(
            lambda: (
                blocker.done()
                or (
                    _gauge(server, "qkv_inflight_requests", model) == 1
                    and _gauge(server, "qkv_queue_depth", model) == 0
                )
            ),
            "the blocker computing",
        )
        await queue(send)
        held = not blocker.done()
        await blocker
        if tasks:
            await asyncio.wait(tasks)
    return held, answered


def _result(task: asyncio.Task[Any]) -> str:
    """What a finished request was answered: 'OK' or its status and message."""
    e = task.exception()
    if e is None:
        assert (task.result().as_numpy("OUTPUT0") == np.arange(16)).all()
        return "OK"
    assert isinstance(e, InferenceServerException), e
    return f"{e.status()}: {e.message()}"


def _by_index(answered: list[str]) -> list[str]:
    return [a.split(" ", 1)[1] for a in sorted(answered, key=lambda a: int(a.split(" ", 1)[0]))]


def test_max_queue_size_per_level_refuses_a_request_beyond_it(server: RunningServer, blocker_loops: int) -> None:
    async def queue(send: Send) -> None:
        for _ in range(3):  # level 2 (the default policy): 2 queue, a third is refused
            await send()
        for _ in range(2):  # level 1 (its own policy): 1 queues, a second is refused
            await send(priority=1)

    results = _by_index(asyncio.run(_held(server, "bounded", blocker_loops, queue)))
    assert [r == "OK" for r in results] == [True, True, False, True, False], results
    for refused in (results[2], results[4]):
        assert refused.startswith("StatusCode.RESOURCE_EXHAUSTED: Exceeds maximum queue size"), refused
    assert "priority level 2 holds 2" in results[2] and "priority level 1 holds 1" in results[4]


def test_queue_timeouts_reject_delay_and_a_requests_own_timeout(server: RunningServer, blocker_loops: int) -> None:
    async def queue(send: Send) -> None:
        await send(priority=1)  # 0: REJECT after 1 ms queued
        await send(priority=2)  # 1: DELAY after 1 ms: behind every level
        await send()  # 2: level 3, its 600 s default
        await send(timeout=1000)  # 3: level 3, its own timeout of 1 ms (allow_timeout_override)

    answered = asyncio.run(_held(server, "timeouts", blocker_loops, queue))
    results = _by_index(answered)
    assert results[0].startswith("StatusCode.DEADLINE_EXCEEDED"), results
    assert results[3].startswith("StatusCode.DEADLINE_EXCEEDED"), results
    assert results[1] == results[2] == "OK", results
    served = [a.split(" ")[0] for a in answered if a.endswith(" OK")]
    assert served == ["2", "1"], answered  # the delayed level 2 request went after level 3's


def test_a_request_timeout_is_ignored_without_allow_timeout_override(server: RunningServer, blocker_loops: int) -> None:
    async def queue(send: Send) -> None:
        await send(timeout=1000)

    assert asyncio.run(_held(server, "bounded", blocker_loops, queue)) == ["0 OK"]


def test_batches_are_cut_to_preferred_batch_sizes(server: RunningServer, blocker_loops: int) -> None:
    client = g.InferenceServerClient(server.url)

    def batches() -> dict[int, int]:
        stats = client.get_inference_statistics("preferred").model_stats[0].batch_stats
        return {b.batch_size: b.compute_infer.count for b in stats}

    before: dict[int, int] = {}

    async def queue(send: Send) -> None:
        before.clear()
        before.update(batches())  # the blocker's batch is counted once it ends
        for _ in range(7):
            await send()

    assert len(asyncio.run(_held(server, "preferred", blocker_loops, queue))) == 7
    after = batches()
    ran = {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}
    # the blocker alone; then 7 queued: 4 go (the largest preferred size they fill), then 2, then the last one
    assert ran == {1: 2, 4: 1, 2: 1}, ran


def test_a_high_priority_request_sent_last_is_served_first_and_the_low_ones_all_finish(
    server: RunningServer, blocker_loops: int
) -> None:
    async def queue(send: Send) -> None:
        for _ in range(4):
            await send(priority=2)
        await send(priority=1)

    answered = asyncio.run(_held(server, "ordered", blocker_loops, queue))
    assert answered == ["4 OK", "0 OK", "1 OK", "2 OK", "3 OK"], answered
