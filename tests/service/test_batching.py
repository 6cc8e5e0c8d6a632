"""The batchers' promises, checked on real schedulers and a real server.

What is computed (only what is still wanted), what comes back (to each request exactly what it
would get alone), and what is refused (at once, with a reason). Speed is for `qkv bench`.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service import priority, protocol
from service.config import ServerSettings
from service.errors import DeadlineExceeded, Internal, ResourceExhausted
from service.models.runtime import lone_threads
from service.repository.layout import ModelConfig
from service.scheduling.admission import WorkItem
from service.scheduling.batching import LONE, DynamicBatcher, select_batch
from service.scheduling.config import BatchingConfig
from service.scheduling.loop_idle import new_event_loop
from service.scheduling.tuning import lone_inline_tokens, lone_threshold
from service.seq2seq.graphs import session_options
from service.tools.bench import scrape, variant
from service.tools.loadgen import encoder_request, g2p_word_request
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.service.queue_helpers import (
    FLOOD_QUEUE_WAIT_MS,
    Recorder,
    blocker_request,
    model_stats,
    until,
    until_computing,
)

VOCAB = 33  # g2p_encoder's input vocabulary
NICE = ServerSettings().compute_nice  # the default --compute-nice


class Doubler:
    """A model for the tensor batcher: each request's payload times two. The first batch holds
    until `gate` opens, so that the test can fill the queue behind it."""

    def __init__(self, hold_first: bool = True, seconds: float = 0.0) -> None:
        self.seconds = seconds  # each batch's compute time: enough, and batches overlap on a fast machine
        self.gate = threading.Event()
        if not hold_first:
            self.gate.set()
        self.computed: list[int] = []  # payloads, in the order computed
        self.instances: list[int] = []
        self.threads: list[int] = []  # the thread that computed each batch

    def __call__(self, items: list[WorkItem], instance: int) -> list[Any]:
        first = not self.instances
        self.instances.append(instance)
        self.threads.append(threading.get_ident())
        self.computed += [x.payload for x in items]
        if any(x.payload < 0 for x in items):
            raise ValueError("negative payload")
        if first:
            assert self.gate.wait(60), "the test never opened the gate"
        time.sleep(self.seconds)
        return [x.payload * 2 for x in items]


def _item(payload: int, length: int = 40, rows: int = 1, deadline: float | None = None) -> WorkItem:
    return WorkItem(rows, length, payload, asyncio.get_running_loop().create_future(), deadline=deadline)


# -- select_batch: the pure choice of the next batch ---------------------------------------------

queues = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 300)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(queues, st.integers(1, 64), st.integers(1, 8192), st.floats(0.0, 1.0), st.booleans())
def test_select_batch_keeps_its_bounds(
    shape: list[tuple[int, int]], max_rows: int, budget: int, max_padding: float, aware: bool
) -> None:
    queue = [WorkItem(rows, length, None, None) for rows, length in shape]  # type: ignore[arg-type]
    chosen = select_batch(queue, max_rows, budget, aware, max_padding)
    assert chosen[0] == 0, "the oldest request always goes"
    assert chosen == sorted(set(chosen)) and chosen[-1] < len(queue)
    if not aware:
        assert chosen == list(range(len(chosen))), "FIFO takes a prefix of the queue"
    if len(chosen) > 1:
        batch = [queue[i] for i in chosen]
        rows, longest = sum(x.rows for x in batch), max(x.length for x in batch)
        assert rows <= max_rows and rows * longest <= budget
        if aware:
            assert 1 - sum(x.tokens for x in batch) / (rows * longest) <= max_padding + 1e-9


def test_length_aware_selection_groups_similar_lengths_where_fifo_pads_to_the_longest() -> None:
    queue = [WorkItem(1, n, None, None) for n in (10, 200, 12, 190, 11, 9)]  # type: ignore[arg-type]
    assert select_batch(queue, 64, 8192, length_aware=True, max_padding=0.2) == [0, 2, 4, 5]
    fifo = select_batch(queue, 64, 8192, length_aware=False)
    assert fifo == [0, 1, 2, 3, 4, 5]  # all of them, every row padded to 200
    assert select_batch(queue, 3, 8192, length_aware=False) == [0, 1, 2]


# -- DynamicBatcher ------------------------------------------------------------------------------


def test_a_request_whose_deadline_passes_in_the_queue_is_never_computed() -> None:
    async def run() -> None:
        model, seen = Doubler(), Recorder()
        b = DynamicBatcher("m", BatchingConfig(), model, instances=1, observer=seen)
        b.start()
        first = asyncio.create_task(b.submit(_item(1)))
        await until(lambda: model.instances, "the first batch computing")  # the only instance is now busy
        deadline = time.monotonic() + 0.5  # long enough to be queued first, however slow the machine
        late = asyncio.create_task(b.submit(_item(2, deadline=deadline)))
        kept = asyncio.create_task(b.submit(_item(3)))
        await until(lambda: len(b.queue) == 2, "both requests queued")
        await asyncio.sleep(max(0.0, deadline - time.monotonic()) + 0.01)  # past the deadline, still queued
        model.gate.set()
        assert await first == 2 and await kept == 6
        with pytest.raises(DeadlineExceeded, match="deadline passed while it was queued"):
            await late
        assert model.computed == [1, 3] and seen.drops == ["deadline"]
        assert b.admission.queued_requests == 0 and b.admission.queued_tokens == 0
        await b.close()

    asyncio.run(run())


def test_a_cancelled_request_leaves_the_queue_at_once_and_is_never_computed() -> None:
    async def run() -> None:
        model, seen = Doubler(), Recorder()
        b = DynamicBatcher("m", BatchingConfig(), model, instances=1, observer=seen)
        b.start()
        first = asyncio.create_task(b.submit(_item(1)))
        await until(lambda: model.instances, "the first batch computing")
        gone = asyncio.create_task(b.submit(_item(2, length=100)))
        kept = asyncio.create_task(b.submit(_item(3)))
        await until(lambda: len(b.queue) == 2, "two requests queued")
        gone.cancel()
        await until(lambda: len(b.queue) == 1, "the cancelled request out of the queue")  # the instance still held
        assert b.admission.queued_tokens == 40 and seen.drops == ["cancelled"]
        model.gate.set()
        assert await first == 2 and await kept == 6
        assert gone.cancelled() and model.computed == [1, 3]
        await b.close()

    asyncio.run(run())


def test_queue_limits_refuse_at_once_with_a_pushback_hint() -> None:
    async def run() -> None:
        model = Doubler()
        config = BatchingConfig(max_queue_requests=3, max_queue_tokens=100)
        b = DynamicBatcher("m", config, model, instances=1)
        b.start()
        first = asyncio.create_task(b.submit(_item(1)))
        await until(lambda: model.instances, "the first batch computing")
        queued = [asyncio.create_task(b.submit(_item(k, length=30))) for k in (2, 3, 4)]
        await until(lambda: len(b.queue) == 3, "three requests queued")
        with pytest.raises(ResourceExhausted, match=r"3 requests / 90 tokens queued \(limits 3 / 100\)"):
            await b.submit(_item(5, length=1))
        b.config = BatchingConfig(max_queue_requests=10, max_queue_tokens=100)
        with pytest.raises(ResourceExhausted, match="90 tokens queued"):
            await b.submit(_item(6, length=11))  # 101 tokens
        model.gate.set()
        assert [await first, *[await q for q in queued]] == [2, 4, 6, 8]
        assert 5 not in model.computed and 6 not in model.computed
        await b.close()

    asyncio.run(run())


def test_no_request_is_lost_or_answered_twice_under_concurrent_load() -> None:
    async def run() -> None:
        model, seen = Doubler(hold_first=False, seconds=0.002), Recorder()
        # Queue bounds out of reach: what is tested is that no answer is lost or doubled, and on a slow moment of
        # a busy machine the default bounds refused more than half of the 2,000 (892 answered).
        config = BatchingConfig(
            max_batch_size=16, max_queue_wait_ms=FLOOD_QUEUE_WAIT_MS, max_queue_requests=4096, max_queue_tokens=1 << 20
        )
        b = DynamicBatcher("m", config, model, instances=2, observer=seen)
        b.start()
        rng = random.Random(3)

        async def one(k: int) -> int:
            await asyncio.sleep(rng.random() * 0.5)
            return await b.submit(_item(k, length=rng.randint(1, 200)))  # type: ignore[no-any-return]

        answers = await asyncio.gather(*[one(k) for k in range(2000)], return_exceptions=True)
        done = [k for k, a in enumerate(answers) if not isinstance(a, BaseException)]
        refused = [a for a in answers if isinstance(a, BaseException)]
        assert all(isinstance(a, ResourceExhausted) for a in refused), "a refusal is the only other answer"
        assert all(answers[k] == 2 * k for k in done), "each answer is its own request's"
        assert Counter(model.computed) == Counter(done), "each answered request computed exactly once, no other"
        assert len(done) > 1000 and sum(rows for rows, _, _ in seen.batches) == len(done)
        assert len(seen.batches) < len(done), "some requests shared a batch"
        assert set(model.instances) == {0, 1}
        await b.close()

    asyncio.run(run())


def test_at_low_load_the_warm_instance_does_the_work() -> None:
    async def run() -> None:
        model = Doubler(hold_first=False)
        b = DynamicBatcher("m", BatchingConfig(), model, instances=2)
        b.start()
        for k in range(20):  # one at a time: the instance that just finished takes the next
            assert await b.submit(_item(k)) == 2 * k
        assert model.instances == [0] * 20
        await b.close()

    asyncio.run(run())


def test_a_request_at_an_idle_batcher_starts_on_arrival_and_one_behind_a_busy_instance_is_queued() -> None:
    """At an idle batcher the dispatcher would take a request alone with no wait: it is started where it
    arrives, never queued, so a lone request costs no turn of the event loop for the dispatcher to wake."""

    async def run() -> None:
        model = Doubler()  # the first batch holds until the gate opens
        b = DynamicBatcher("m", BatchingConfig(max_queue_delay_ms=50.0), model, instances=1)
        asked: list[list[int]] = []

        def select(queue: Any, *bounds: Any) -> list[int]:
            asked.append([x.payload for x in queue])
            return select_batch(queue, *bounds)

        b.select = select  # the choice is still the batcher's (a Triton priority or preferred-size chooser)
        b.start()
        await asyncio.sleep(0)  # the dispatcher is waiting for work
        first = asyncio.ensure_future(b.submit(_item(1)))
        await asyncio.sleep(0)  # one step of the request: chosen alone, started, nothing queued
        assert b.started_at_once == 1 and not b.queue and not b._idle and asked == [[1]]
        second = asyncio.ensure_future(b.submit(_item(2)))
        await asyncio.sleep(0)
        assert b.started_at_once == 1 and [x.payload for x in b.queue] == [2], "behind a busy instance: queued"
        model.gate.set()
        assert [await first, await second] == [2, 4]
        with pytest.raises(DeadlineExceeded):  # gone on arrival: refused, never computed
            await b.submit(_item(3, deadline=time.monotonic() - 1))
        assert await b.submit(_item(4)) == 8
        assert b.started_at_once == 2 and model.computed == [1, 2, 4]
        assert b.admission.queued_requests == 0 and b.admission.queued_tokens == 0, "nothing left counted as queued"
        await b.close()

    asyncio.run(run())


def test_a_small_request_on_an_idle_server_runs_inline_and_a_failure_stays_its_own() -> None:
    async def run() -> None:
        model, seen = Doubler(hold_first=False), Recorder()
        b = DynamicBatcher("m", BatchingConfig(inline_max_tokens=32), model, instances=2, observer=seen)
        b.start()
        loop_thread = threading.get_ident()
        assert await b.submit(_item(1, length=32)) == 2  # small, idle: computed right here
        assert await b.submit(_item(2, length=33)) == 4  # one token over: handed to an instance thread
        assert model.threads[0] == loop_thread and model.threads[1] != loop_thread
        with pytest.raises(Internal, match="model 'm' failed on this batch: negative payload"):
            await b.submit(_item(-1, length=8))
        assert await b.submit(_item(3, length=8)) == 6, "the batcher goes on after a failed request"
        assert b.admission.queued_requests == 0 and b.admission.queued_tokens == 0, "nothing left counted as queued"
        assert [rows for rows, _, _ in seen.batches] == [1, 1, 1], "inline runs are observed as batches of one"
        await b.close()

    asyncio.run(run())


def test_a_request_that_waited_behind_an_inline_one_is_not_computed_inline() -> None:
    """The server's loop notes when it waited for work (service/scheduling/loop_idle.py): a request it
    reached straight after an inline computation had been queued behind it, and goes to an instance; were it
    computed inline too, a concurrent load would be served one request at a time on one core."""

    async def run() -> None:
        model = Doubler(hold_first=False, seconds=0.002)
        b = DynamicBatcher("m", BatchingConfig(inline_max_tokens=32), model, instances=2)
        b.start()
        loop_thread = threading.get_ident()
        assert await asyncio.gather(b.submit(_item(1, length=8)), b.submit(_item(2, length=8))) == [2, 4]
        assert [t == loop_thread for t in model.threads] == [True, False]
        await asyncio.sleep(0.01)  # the loop waits for work: the next request comes alone
        assert await b.submit(_item(3, length=8)) == 6
        assert model.threads[2] == loop_thread
        await b.close()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run())


def test_a_batch_alone_on_an_idle_server_runs_as_lone_and_one_beside_another_on_its_instance() -> None:
    async def run() -> None:
        model = Doubler()  # the first batch holds until the gate opens
        b = DynamicBatcher("m", BatchingConfig(enabled=False), model, instances=2, lone=True)
        b.start()
        first = asyncio.ensure_future(b.submit(_item(1)))
        await until(lambda: model.instances == [LONE], "the first request computing, alone")
        second = asyncio.ensure_future(b.submit(_item(2)))  # the first still computes: not alone
        assert await second == 4
        model.gate.set()
        assert await first == 2
        assert await b.submit(_item(3)) == 6  # alone again
        assert model.instances == [LONE, 1, LONE]
        await b.close()

        # Without a lone session, no batch is told LONE.
        plain = Doubler(hold_first=False)
        b = DynamicBatcher("m", BatchingConfig(enabled=False), plain, instances=2)
        b.start()
        assert await b.submit(_item(4)) == 8
        assert plain.instances == [0]
        await b.close()

    asyncio.run(run())


def test_the_lone_session_serves_the_lengths_from_which_it_gains_and_none_when_it_never_does() -> None:
    # (tokens, an instance's seconds, the lone session's): every core gains from 64 tokens on
    measured = [(8, 1.0, 1.2), (16, 1.0, 0.95), (32, 1.0, 1.05), (64, 1.0, 0.7), (128, 2.0, 1.2), (256, 4.0, 2.1)]
    assert lone_threshold(measured) == 64
    assert lone_threshold([(8, 1.0, 0.5)]) == 8
    assert lone_threshold([(8, 1.0, 0.95), (64, 1.0, 0.99)]) is None  # never by more than the noise
    assert lone_threshold([]) is None


def test_a_small_batch_alone_stays_on_its_instance_below_the_lone_threshold() -> None:
    async def run() -> None:
        model = Doubler(hold_first=False)
        b = DynamicBatcher("m", BatchingConfig(enabled=False), model, instances=2, lone=True)
        b.lone_min_tokens = 64
        b.start()
        assert await b.submit(_item(1, length=40)) == 2
        assert await b.submit(_item(2, length=64)) == 4
        assert model.instances == [0, LONE]
        await b.close()

    asyncio.run(run())


def test_a_request_alone_runs_on_the_loops_thread_up_to_what_the_lone_session_computes_in_the_inline_bound() -> None:
    # (tokens, an instance's seconds, the lone session's), a hand-off of 0.1 ms: the inline bound is 2 ms
    measured = [(16, 0.0008, 0.0009), (32, 0.0016, 0.0011), (64, 0.003, 0.0019), (128, 0.006, 0.0035)]
    assert lone_inline_tokens(measured, 0.0001, 32) == 64
    assert lone_inline_tokens(measured, 0.0001, 128) == 0  # from the threshold on: 128 is over the bound
    assert lone_inline_tokens(measured, 0.00001, 32) == 0

    async def run() -> None:
        model = Doubler(hold_first=False)
        b = DynamicBatcher("m", BatchingConfig(inline_max_tokens=8), model, instances=2, lone=True)
        b.lone_min_tokens, b.lone_inline_max_tokens = 32, 64
        b.start()
        loop_thread = threading.get_ident()
        for k, length in enumerate([8, 16, 32, 64, 65]):
            assert await b.submit(_item(k, length=length)) == 2 * k
        on_loop = [t == loop_thread for t in model.threads]
        # 8: an instance's inline size; 16: an instance's thread; 32, 64: lone, on the loop; 65: lone, handed off
        assert on_loop == [True, False, True, True, False]
        assert model.instances[2:] == [LONE, LONE, LONE]
        await b.close()

    asyncio.run(run())


def test_lone_threads_are_every_core_unless_an_instance_has_as_many(tmp_path: Path) -> None:
    config = ModelConfig("m", "tensor", "1", tmp_path)
    cores = len(os.sched_getaffinity(0))
    assert lone_threads(config) == (cores if cores > 1 else 0)
    assert lone_threads(replace(config, lone_request_threads=4)) == 4
    assert lone_threads(replace(config, lone_request_threads=0)) == 0
    assert lone_threads(replace(config, lone_request_threads=4, intra_op_threads=4)) == 0


# -- over the wire: a real server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def quiet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of its own, with one g2p_encoder instance: these tests count what it computed."""
    scratch = tmp_path_factory.mktemp("batching")
    # Queueing is bounded by the queue limits alone, so the flood below is admitted whole. No lone session:
    # whether warm-up keeps one depends on the machine's speed, and its threads are onnxruntime's, not pinned.
    one = {
        "instances": 1,
        "lone_request_threads": 0,
        "batching": {"max_queue_wait_ms": 60_000, "max_queue_tokens": 65536},
    }
    models = variant(MODELS, scratch / "models", {"g2p_encoder": one})
    s = start_server(["--model-repository", str(models)], scratch / "server.log")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def held_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Like `quiet_server`, for the tests that hold its one instance with a blocker. Its compute threads keep
    their priority (`--compute-nice 0`): a niced thread gets a few per cent of a core while other processes
    keep the cores busy, and the blocker would then take minutes instead of seconds."""
    scratch = tmp_path_factory.mktemp("held")
    one = {"instances": 1, "batching": {"max_queue_wait_ms": 60_000, "max_queue_tokens": 65536}}
    models = variant(MODELS, scratch / "models", {"g2p_encoder": one})
    s = start_server(["--model-repository", str(models), "--compute-nice", "0"], scratch / "server.log")
    yield s
    stop_server(s)


def _inference_count(stub: Any, model: str) -> int:
    return int(model_stats(stub, model).inference_count)


def _queued(server: RunningServer) -> float:
    """Requests waiting in g2p_encoder's queue, from the server's metrics."""
    return scrape(server.metrics_url).get('qkv_queue_depth{model="g2p_encoder",version="1"}', 0)


def _outputs(response: Any) -> np.ndarray:
    out = response.outputs[0]
    assert out.datatype == "FP32"
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(list(out.shape))


def test_mixed_lengths_batched_return_what_each_request_gets_alone(quiet_server: RunningServer) -> None:
    rng = np.random.default_rng(11)
    lengths = [int(n) for n in rng.integers(4, 200, size=64)]
    requests = [encoder_request(n, VOCAB, rng) for n in lengths]
    session = ort.InferenceSession(str(MODELS / "g2p_encoder" / "1" / "model.onnx"), session_options(1))

    async def send_all() -> list[Any]:
        async with grpc.aio.insecure_channel(quiet_server.url) as channel:
            stub = protocol.Stub(channel)
            return await asyncio.gather(*[stub.ModelInfer(r, timeout=60) for r in requests])

    with grpc.insecure_channel(quiet_server.url) as channel:
        stats_before = model_stats(protocol.Stub(channel), "g2p_encoder")
        responses = asyncio.run(send_all())
        stats = model_stats(protocol.Stub(channel), "g2p_encoder")
    for n, request, response in zip(lengths, requests, responses, strict=True):
        ids = np.frombuffer(request.raw_input_contents[0], dtype=np.int64).reshape(1, n)
        (expected,) = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        got = _outputs(response)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    executions = stats.execution_count - stats_before.execution_count
    assert stats.inference_count - stats_before.inference_count == 64
    assert executions < 64, "the requests were batched (and padded) together"


def test_an_expired_or_cancelled_request_is_not_computed(held_server: RunningServer) -> None:
    rng = np.random.default_rng(5)
    blocker = blocker_request(64, rng)  # about four seconds on the one instance
    small = encoder_request(16, VOCAB, rng)

    async def until_queued(n: float) -> None:
        end = time.monotonic() + 30
        while _queued(held_server) != n:
            assert time.monotonic() < end, f"the queue never held {n} requests"
            await asyncio.sleep(0.02)

    async def run() -> tuple[list[Any], grpc.StatusCode, bool]:
        big = [("grpc.max_receive_message_length", 64 << 20)]  # the blocker's answer is 24 MB
        async with grpc.aio.insecure_channel(held_server.url, options=big) as channel:
            stub = protocol.Stub(channel)
            first = asyncio.ensure_future(stub.ModelInfer(blocker, timeout=120))
            await until_computing(held_server, first)  # nothing else moves until it is done
            rest = [asyncio.ensure_future(stub.ModelInfer(small, timeout=120)) for _ in range(3)]
            await until_queued(3)
            # Long enough to reach the handler on a loaded machine (at 0.2 s, one expired before the
            # server ever saw it), far shorter than the blocker.
            expired = asyncio.ensure_future(stub.ModelInfer(small, timeout=1.0))
            end = time.monotonic() + 30
            while _queued(held_server) != 4 and not expired.done():  # queued, or refused at admission
                assert time.monotonic() < end, "the expiring request never reached the server"
                await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await expired
            await until_queued(3)
            cancelled = stub.ModelInfer(small, timeout=120)
            await until_queued(4)
            cancelled.cancel()
            await until_queued(3)  # it left the queue while the blocker was still computing
            assert not first.done(), "the blocker finished early: the queue was not held"
            return await asyncio.gather(first, *rest), refused.value.code(), cancelled.cancelled()

    with grpc.insecure_channel(held_server.url) as channel:
        stub = protocol.Stub(channel)
        before, counters_before = _inference_count(stub, "g2p_encoder"), scrape(held_server.metrics_url)
        answered, code, was_cancelled = asyncio.run(run())
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and was_cancelled
        assert all(len(a.raw_output_contents) == 1 for a in answered)
        # Only the flood's rows were computed: neither the expired nor the cancelled request.
        assert _inference_count(stub, "g2p_encoder") - before == 64 + 3
    after = scrape(held_server.metrics_url)

    def grew(series: str) -> float:
        return after.get(series, 0) - counters_before.get(series, 0)

    # The expired one was refused at the door (its deadline shorter than the predicted wait) or
    # dropped from the queue; the cancelled one was dropped from the queue. Neither was computed.
    dropped = 'qkv_dropped_requests_total{model="g2p_encoder",reason="%s",version="1"}'
    refused_at_admission = grew('qkv_requests_total{code="DEADLINE_EXCEEDED",model="g2p_encoder",version="1"}')
    assert grew(dropped % "cancelled") >= 1
    assert grew(dropped % "deadline") + grew(dropped % "cancelled") + refused_at_admission == 2


def test_a_cancelled_stream_takes_its_queued_requests_with_it(held_server: RunningServer) -> None:
    rng = np.random.default_rng(6)
    blocker = blocker_request(64, rng)
    small = [encoder_request(16, VOCAB, rng) for _ in range(3)]

    async def run() -> bool:
        big = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(held_server.url, options=big) as channel:
            stub = protocol.Stub(channel)
            first = asyncio.ensure_future(stub.ModelInfer(blocker, timeout=120))
            await until_computing(held_server, first)  # nothing else moves until it is done
            stream = stub.ModelStreamInfer(timeout=120)
            for request in small:
                await stream.write(request)
            end = time.monotonic() + 30
            while _queued(held_server) != 3:
                assert time.monotonic() < end, "the stream's requests never queued"
                await asyncio.sleep(0.02)
            stream.cancel()
            while _queued(held_server) != 0:  # they leave the queue while the blocker still computes
                assert time.monotonic() < end, "the cancelled stream's requests stayed queued"
                await asyncio.sleep(0.02)
            still_computing = not first.done()
            await first
            return still_computing

    with grpc.insecure_channel(held_server.url) as channel:
        stub = protocol.Stub(channel)
        before, counters_before = _inference_count(stub, "g2p_encoder"), scrape(held_server.metrics_url)
        assert asyncio.run(run()), "the blocker finished early: the queue was not held"
        assert _inference_count(stub, "g2p_encoder") - before == 64  # the blocker's rows, none of the stream's
    dropped = 'qkv_dropped_requests_total{model="g2p_encoder",reason="cancelled",version="1"}'
    assert scrape(held_server.metrics_url).get(dropped, 0) - counters_before.get(dropped, 0) == 3


def _thread_nices(pid: int) -> dict[int, int]:
    """Each thread's nice value, from /proc (field 19 of a task's stat)."""
    nices = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        nices[int(task.name)] = int(fields[16])
    return nices


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread nice is read from Linux's /proc")
def test_compute_runs_below_the_event_loop(quiet_server: RunningServer) -> None:
    with grpc.insecure_channel(quiet_server.url) as channel:
        stub = protocol.Stub(channel)
        stub.ModelInfer(encoder_request(16, VOCAB, np.random.default_rng(0)), timeout=30)
        stub.ModelInfer(g2p_word_request("lowered"), timeout=30)  # both kinds of compute thread now exist
    pid = quiet_server.process.pid
    nices = _thread_nices(pid)
    assert nices[pid] == 0, "the event loop (main thread) keeps its priority"
    lowered = [tid for tid, nice in nices.items() if nice == NICE]
    # at least the g2p_encoder instance's thread and each g2p instance's decoding thread
    assert len(lowered) >= 2, nices
    # Each compute thread keeps to one core, and a model's instances to different ones; the event loop
    # may run anywhere.
    cores = sorted(os.sched_getaffinity(0))  # what the server inherited from this process
    if len(cores) > 1:
        assert sorted(os.sched_getaffinity(pid)) == cores, "the event loop was pinned"
        placed = {tid: sorted(os.sched_getaffinity(tid)) for tid in lowered}
        assert all(len(c) == 1 for c in placed.values()), placed
        assert len({c[0] for c in placed.values()}) >= 2, placed  # g2p's two instances, at least


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: [])(0)) < 2, reason="needs two cores")
def test_two_one_instance_models_compute_on_different_cores(tmp_path: Path) -> None:
    newest = {"latest": {"num_versions": 1}}  # one g2p version, so one instance of each model
    # (no lone session: its threads are onnxruntime's, not an instance's)
    repo = variant(MODELS, tmp_path / "models", {"g2p_encoder": {"instances": 1, "lone_request_threads": 0},
                                                 "g2p": {"instances": 1, "version_policy": newest}})  # fmt: skip
    s = start_server(["--model-repository", str(repo)], tmp_path / "server.log")
    try:
        with grpc.insecure_channel(s.url) as channel:
            stub = protocol.Stub(channel)
            stub.ModelInfer(encoder_request(64, VOCAB, np.random.default_rng(0)), timeout=30)  # not inline: a thread
            stub.ModelInfer(g2p_word_request("cores"), timeout=30)
        lowered = [tid for tid, nice in _thread_nices(s.process.pid).items() if nice == NICE]
        assert len(lowered) == 2, lowered
        assert len({tuple(os.sched_getaffinity(tid)) for tid in lowered}) == 2
    finally:
        stop_server(s)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_compute_threads_are_pinned_only_where_the_process_may_use_all_its_cores(tmp_path: Path) -> None:
    """Under a CPU quota smaller than its CPU set (a container limited to 2 CPUs on a big node), pinning
    would put every such container's compute on the same first cores: no pinning there."""
    cores = sorted(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    for cpu_max, pinned in (("max 100000", cores), (f"{len(cores) * 100000} 100000", cores),
                            (f"{len(cores) * 100000 - 50000} 100000", [])):  # fmt: skip
        (v2 / "cpu.max").write_text(cpu_max + "\n")
        assert priority.dedicated_cores(v2) == pinned, cpu_max
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert priority.cpu_quota(v1) is None and priority.dedicated_cores(v1) == cores
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert priority.cpu_quota(v1) == 0.5 and priority.dedicated_cores(v1) == []


def test_a_full_queue_refuses_before_reading_the_request(tmp_path: Path) -> None:
    """Under overload refusing is most of the work: a request is refused before its tensors are
    decoded or checked, with the reason and a retry hint, and the server serves on afterwards."""
    one_queued = {"instances": 1, "batching": {"max_queue_requests": 1, "max_queue_wait_ms": 60_000}}
    models = variant(MODELS, tmp_path / "models", {"g2p_encoder": one_queued})
    s = start_server(["--model-repository", str(models), "--compute-nice", "0"], tmp_path / "server.log")
    rng = np.random.default_rng(7)
    blocker = blocker_request(32, rng)
    malformed = encoder_request(16, VOCAB, rng)
    malformed.raw_input_contents[0] = malformed.raw_input_contents[0][:-3]  # not a whole number of INT64s

    async def run() -> tuple[grpc.aio.AioRpcError, Any]:
        big = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(s.url, options=big) as channel:
            stub = protocol.Stub(channel)
            first = asyncio.ensure_future(stub.ModelInfer(blocker, timeout=120))
            await until_computing(s, first)  # the queue is empty again
            queued = asyncio.ensure_future(stub.ModelInfer(encoder_request(16, VOCAB, rng), timeout=120))
            end = time.monotonic() + 30
            while scrape(s.metrics_url).get('qkv_queue_depth{model="g2p_encoder",version="1"}', 0) != 1:
                assert time.monotonic() < end, "the queue never held the second request"
                await asyncio.sleep(0.02)
            call = stub.ModelInfer(malformed, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            trailers = await call.trailing_metadata()
            assert not first.done(), "the blocker finished early: the queue was not full"
            await asyncio.gather(first, queued)
            return refused.value, trailers

    try:
        refused, trailers = asyncio.run(run())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 requests / 16 tokens queued (limits 1 /" in (refused.details() or "")
        assert int(dict(trailers)["grpc-retry-pushback-ms"]) >= 1
        with grpc.insecure_channel(s.url) as channel, pytest.raises(grpc.RpcError) as invalid:
            protocol.Stub(channel).ModelInfer(malformed, timeout=30)  # the queue is empty: now it is read
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input_ids" in (invalid.value.details() or "")
    finally:
        stop_server(s)


def test_a_fresh_server_holds_a_flood_to_its_queueing_objective(tmp_path: Path) -> None:
    """The warm-up batch at start gives admission a throughput estimate, so the first flood is held
    to max_queue_wait_ms of queued work; without it, all of it would be admitted up to the queue limits."""
    objective = {"instances": 1, "batching": {"max_queue_wait_ms": 25}}
    models = variant(MODELS, tmp_path / "models", {"g2p_encoder": objective})
    s = start_server(["--model-repository", str(models), "--compute-nice", "0"], tmp_path / "server.log")
    rng = np.random.default_rng(8)
    flood = [encoder_request(256, VOCAB, rng) for _ in range(40)]  # 10,240 tokens, well inside the queue limits

    async def run() -> list[tuple[str, str]]:
        big = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(s.url, options=big) as channel:
            stub = protocol.Stub(channel)
            first = asyncio.ensure_future(stub.ModelInfer(blocker_request(32, rng), timeout=120))
            await until_computing(s, first)  # nothing queued yet and no batch measured under load

            async def one(request: Any) -> tuple[str, str]:
                try:
                    await stub.ModelInfer(request, timeout=120)
                    return "OK", ""
                except grpc.aio.AioRpcError as e:
                    assert not first.done(), "the blocker finished while the flood was admitted"
                    return e.code().name, e.details() or ""

            answers = await asyncio.gather(*(one(r) for r in flood))
            await first
            return answers

    try:
        answers = asyncio.run(run())
        codes = Counter(code for code, _ in answers)
        assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes  # some queued, the rest refused
        # While the blocker computes, nothing leaves the queue and no throughput is measured: the queued requests
        # are the ones answered OK, and each refusal predicts their wait from the warm-up's estimate alone. Held to
        # the objective: with one fewer queued, the predicted wait was within 25 ms, so the last one was admitted.
        waits = set()
        for _, details in (a for a in answers if a[0] != "OK"):
            found = re.search(r"predicted queueing (\d+) ms exceeds 25 ms", details)
            assert found, details
            waits.add(int(found[1]))
        assert len(waits) == 1, waits  # the same queue at every refusal
        (wait,) = waits
        queued = codes["OK"]
        # The message rounds to whole milliseconds: over 25 reads as 25 or more.
        assert wait >= 25 and wait * (queued - 1) / queued <= 25.5, (wait, codes)
    finally:
        stop_server(s)
