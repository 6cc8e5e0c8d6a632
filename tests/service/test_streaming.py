"""Triton's ModelStreamInfer on a real server: every request on a stream is answered, with what it gets
alone (matched by id), a bad one with its error while the stream goes on, and the stream's requests
batch together."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g

from service import protocol
from service.tools.bench import scrape, variant
from service.tools.loadgen import encoder_request, g2p_word_request
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.service.queue_helpers import blocker_request, computing_alone, model_stats
from tests.service.test_protocol import encoder_inputs, text_input


def test_tritonclient_stream_answers_each_request_as_it_gets_alone(server: RunningServer) -> None:
    rng = np.random.default_rng(0)
    sent: dict[str, tuple[str, list[g.InferInput]]] = {}
    for i, word in enumerate(["attention", "is", "all", "you", "need"]):
        sent[f"w{i}"] = ("g2p", [text_input([word])])
    for i, length in enumerate([3, 17, 40, 9]):
        sent[f"e{i}"] = ("g2p_encoder", encoder_inputs(rng.integers(4, 33, (1, length)).astype(np.int64)))
    bad = g.InferInput("TEXT", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"a\x07b"], dtype=object))  # a control character: refused
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = g.InferenceServerClient(server.url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        ids = list(sent)
        for rid in ids[:4]:
            client.async_stream_infer(sent[rid][0], sent[rid][1], request_id=rid)
        client.async_stream_infer("g2p", [bad], request_id="bad")
        for rid in ids[4:]:  # after the failure: the stream goes on
            client.async_stream_infer(sent[rid][0], sent[rid][1], request_id=rid)
        got = [answers.get(timeout=30) for _ in range(len(sent) + 1)]
    finally:
        client.stop_stream()
    errors = [e for r, e in got if e is not None]
    assert len(errors) == 1 and "INVALID_ARGUMENT" in str(errors[0]) and "'TEXT'" in str(errors[0])
    results = {r.get_response().id: r for r, e in got if e is None}
    assert sorted(results) == sorted(sent)
    for rid, (model, inputs) in sent.items():
        alone = client.infer(model, inputs)
        name = "PHONEMES" if model == "g2p" else "last_hidden_state"
        streamed, expected = results[rid].as_numpy(name), alone.as_numpy(name)
        if model == "g2p":
            assert (streamed == expected).all(), rid
        else:
            np.testing.assert_allclose(streamed, expected, atol=1e-5, err_msg=rid)


@pytest.fixture(scope="module")
def one_instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """g2p_encoder on one instance, never computing on the event loop, and queueing bounded by the queue's
    size alone: while its instance computes one request of a stream, the stream's next ones queue, so the
    decisions below do not hang on how fast this machine reads a stream or computes a batch."""
    scratch = tmp_path_factory.mktemp("streaming")
    one = {
        "instances": 1,
        "batching": {
            "inline_max_tokens": 0,
            "max_queue_wait_ms": 600_000,
            "max_queue_tokens": 65536,
            "token_budget": 8192,
            "max_batch_size": 64,
        },
    }
    s = start_server(["--model-repository", str(variant(MODELS, scratch / "models", {"g2p_encoder": one}))],
                     scratch / "server.log")  # fmt: skip
    yield s
    stop_server(s)


QUEUED = 'qkv_queue_depth{model="g2p_encoder",version="1"}'


def _statistics(stub: Any, model: str) -> tuple[int, int]:
    stats = model_stats(stub, model)
    return stats.inference_count, stats.execution_count


def _read_stream(stub: Any, requests: list[Any], answers: list[Any]) -> None:
    answers.extend(stub.ModelStreamInfer(iter(requests), timeout=600))


def test_one_streams_requests_run_together(one_instance: RunningServer) -> None:
    """Requests sent back to back on one stream are in flight at once, so they share batches: fewer runs
    than requests. A blocker holds the one instance until the stream's requests are seen queued together
    (answered one at a time, at most one would ever be queued), and the next batch takes them together."""
    server = one_instance
    rng = np.random.default_rng(1)
    requests = [encoder_request(64, 33, rng) for _ in range(48)]  # several fit one batch's token budget
    for i, r in enumerate(requests):
        r.id = str(i)
    with grpc.insecure_channel(server.url) as channel:
        stub = protocol.Stub(channel)
        before = _statistics(stub, "g2p_encoder")
        for rows in (8, 16, 32, 64):  # a longer blocker while this machine reads the stream more slowly
            blocker = stub.ModelInfer.future(blocker_request(rows, rng), timeout=600)
            end = time.monotonic() + 60
            while not computing_alone(server):
                assert not blocker.done() and time.monotonic() < end, "the blocker was not seen computing alone"
            answers: list[Any] = []
            reader = threading.Thread(target=_read_stream, args=(stub, requests, answers))
            reader.start()
            while not blocker.done() and scrape(server.metrics_url).get(QUEUED, 0) < 2:
                time.sleep(0.01)
            held = not blocker.done()
            reader.join()
            blocker.result()
            if held:
                break
        after = _statistics(stub, "g2p_encoder")
    assert held, "a blocker of 64 x 512 tokens finished before two of the stream's requests were queued"
    assert sorted(int(a.infer_response.id) for a in answers) == list(range(48))
    assert not any(a.error_message for a in answers)
    inferences, executions = after[0] - before[0], after[1] - before[1]  # blockers included
    assert executions < inferences, (inferences, executions)


def test_an_unknown_model_on_a_stream_is_an_error_message(server: RunningServer) -> None:
    request = g2p_word_request("hello", model="nope")
    request.id = "x"
    with grpc.insecure_channel(server.url) as channel:
        (answer,) = protocol.Stub(channel).ModelStreamInfer(iter([request]), timeout=10)
    assert answer.error_message.startswith("NOT_FOUND: Request for unknown model: 'nope' is not found")
    assert (answer.infer_response.id, answer.infer_response.model_name) == ("x", "nope")  # which request failed


def test_a_message_that_is_not_a_request_ends_the_stream_after_what_came_before(server: RunningServer) -> None:
    good = g2p_word_request("hello")
    good.id = "before"
    with grpc.insecure_channel(server.url) as channel:
        raw = channel.stream_stream(f"/{protocol.SERVICE_NAME}/ModelStreamInfer")
        replies = raw(iter([good.SerializeToString(), b"\xff\xff not a request"]), timeout=10)
        first = protocol.ModelStreamInferResponse.FromString(next(replies))
        assert first.infer_response.id == "before" and not first.error_message
        with pytest.raises(grpc.RpcError) as ended:
            next(replies)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid ModelInferRequest" in ended.value.details()
        assert protocol.Stub(channel).ModelInfer(good, timeout=10).outputs  # the server serves on


def test_a_client_that_stops_reading_stops_being_read(one_instance: RunningServer) -> None:
    """Requests past the stream's window wait in the transport, not in the server's memory, until the
    client reads its answers; then every one is answered."""
    from service.frontends.grpc_api import STREAM_WINDOW

    server = one_instance
    rng = np.random.default_rng(2)
    n = STREAM_WINDOW + 200  # within the queue limits (65536 tokens, no wait objective): none is refused
    requests = [encoder_request(64, 33, rng) for _ in range(n)]  # 49 KB answers: the transport fills fast
    for i, r in enumerate(requests):
        r.id = str(i)

    def answered() -> int:
        with grpc.insecure_channel(server.url) as channel:
            return _statistics(protocol.Stub(channel), "g2p_encoder")[0]

    big = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(server.url, options=big) as channel:
        before = answered()
        replies = protocol.Stub(channel).ModelStreamInfer(iter(requests), timeout=120)
        first = next(replies)  # the stream is open and flowing; now stop reading
        plateau, end = -1, time.monotonic() + 60
        while (done := answered() - before) != plateau:  # until the server stops taking requests
            assert time.monotonic() < end, "the server never stopped reading the stream"
            plateau = done
            time.sleep(1.0)
        assert plateau < n, f"all {n} requests were taken from a client that read one answer"
        rest = list(replies)
    assert sorted(int(a.infer_response.id) for a in [first, *rest]) == list(range(n))
    assert not [a.error_message for a in [first, *rest] if a.error_message][:3]
