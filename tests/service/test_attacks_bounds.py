"""Attacks on what a legal request makes the server build: an ensemble's intermediates, a classification of
a large output, and identical requests that wait on one another in the response cache.

As in tests/service/test_attacks.py, each runs under the probe (a one-word g2p request and a health check
every 50 ms) and asserts its outcome, no failed probe, and RSS back within 10 % of before; the figures go to
the run's summary, section "attacks".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from tritonclient.utils import InferenceServerException

from service import protocol
from service.models.classification import MAX_CLASS_COUNT
from service.tools.bench import scrape, variant
from service.tools.loadgen import encoder_request
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.service.ensemble_models import outer_product, unbounded_repeat
from tests.service.queue_helpers import ENCODER_CACHED, ENCODER_VOCAB, blocker_request, computing_alone, model_stats
from tests.service.test_attacks import INFER, OPTIONS, _attack, _still_serves

LOOP_S = 3.0  # each looping attack's length: the 15 s of the figures in docs/security.md behave the same
CLIENTS = 2
LIMIT = 64  # tiled_limited_step's limits.max_output_elements


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    scratch = tmp_path_factory.mktemp("attacks-bounds")
    root = variant(MODELS, scratch / "models", {"g2p_encoder": ENCODER_CACHED})
    outer_product(root)
    unbounded_repeat(root, "tiled", None)
    unbounded_repeat(root, "tiled_limited", LIMIT)
    args = ["--model-repository", str(root), "--cache-size", str(64 << 20), "--model-control-mode", "explicit"]
    for model in ("g2p", "g2p_encoder", "outer_sum", "tiled_limited"):
        args += ["--load-model", model]
    s = start_server(args, scratch / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


# --- an ensemble's intermediate, bounded before it exists ----------------------------------------------------


def _outer_request(n: int, m: int) -> protocol.ModelInferRequest:
    request = protocol.ModelInferRequest(model_name="outer_sum")
    for name, size in (("A", n), ("B", m)):
        request.inputs.add(name=name, datatype="FP32", shape=[1, size])
        request.raw_input_contents.append(np.full(size, 0.5, np.float32).tobytes())
    return request


def test_an_ensemble_intermediate_of_2_gib_is_refused_before_its_step_runs(served: RunningServer) -> None:
    """288 KiB of inputs whose outer product would be 2 GiB (before these bounds: RSS +2.1 GiB, kept, and a 20.9 s
    stall with two clients looping): refused before the step's model runs, every time, by two clients."""
    body = _outer_request(65_536, 8_192).SerializeToString()
    answers: list[tuple[str, str]] = []

    def loop() -> None:
        with grpc.insecure_channel(served.url) as channel:
            infer = channel.unary_unary(INFER)
            end = time.monotonic() + LOOP_S
            while time.monotonic() < end:
                try:
                    infer(body, timeout=60)
                    answers.append(("OK", ""))
                except grpc.RpcError as e:
                    answers.append((e.code().name, e.details() or ""))

    def send() -> tuple[str, str]:
        clients = [threading.Thread(target=loop) for _ in range(CLIENTS)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert len({code for code, _ in answers}) == 1, {code for code, _ in answers}
        return answers[-1]

    with grpc.insecure_channel(served.url) as channel:
        stub = protocol.Stub(channel)
        ran = model_stats(stub, "outer").inference_count
        outcome = _attack(served, f"ensemble intermediate of 2 GiB from 288 KiB, {CLIENTS} clients {LOOP_S:g} s", send)
        assert outcome.code == "INVALID_ARGUMENT" and len(answers) >= CLIENTS
        assert "ensemble 'outer_sum' step 0 (model 'outer'): output 'P' would hold shape up to [1, 65536, 8192], " in (
            outcome.details
        )
        assert "536,870,912 elements for these inputs, over the limit of 16,777,216 a tensor" in outcome.details
        assert "refused before the step runs" in outcome.details
        assert model_stats(stub, "outer").inference_count == ran  # the step's model never ran
        # a request within the bound runs both steps: the sum of the outer product
        answer = stub.ModelInfer(_outer_request(64, 32), timeout=60)
        assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [64 * 32 * 0.25]
    _still_serves(served)


def test_a_step_whose_output_cannot_be_bounded_is_refused_at_load(served: RunningServer) -> None:
    """A step output with a dynamic dimension that no input bounds (Tile by a repeat count the client sends)
    is refused at load; declared in its model's limits.max_output_elements, it loads and its model is held
    to it."""
    with g.InferenceServerClient(served.url) as client:
        with pytest.raises(InferenceServerException) as e:
            client.load_model("tiled")
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "step 0 (model 'tiled_step'): output 'Y': dimension 1 (an unnamed axis) is dynamic" in str(e.value)
        assert "set limits.max_output_elements in the model's config.json" in str(e.value)

        def tiled(repeats: int) -> Any:
            x, r = g.InferInput("X", [1, 4], "FP32"), g.InferInput("R", [2], "INT64")
            x.set_data_from_numpy(np.arange(4, dtype=np.float32)[None])
            r.set_data_from_numpy(np.array([1, repeats], np.int64))
            return client.infer("tiled_limited", [x, r]).as_numpy("Y")

        assert tiled(3).shape == (1, 12)
        with pytest.raises(InferenceServerException) as e:
            tiled(100)  # 400 elements: more than the 64 its model declares
        assert e.value.status() == "StatusCode.INTERNAL"
        assert f"output 'Y' holds 400 elements, more than its model declares ({LIMIT} for these inputs)" in str(e.value)


# --- classification: bounded, off the event loop ---------------------------------------------------------------


def _classified(rows: int, count: int) -> protocol.ModelInferRequest:
    request = blocker_request(rows, np.random.default_rng(rows))
    output = request.outputs.add(name="last_hidden_state")
    output.parameters["classification"].int64_param = count
    return request


def test_classification_of_a_64_x_512_output_with_any_count_is_bounded(served: RunningServer) -> None:
    """g2p_encoder's [64, 512, 192] answer classified with a count of 10^18 (before: 30 s or more of the
    event loop, RSS 4.8 GiB): MAX_CLASS_COUNT classes a row, built on a worker thread. The answer is computed
    and kept first, so that the attack times the classification alone."""
    with grpc.insecure_channel(served.url, options=OPTIONS) as channel:  # room for the 24 MiB answer
        stub = protocol.Stub(channel)
        plain = blocker_request(64, np.random.default_rng(64))
        plain.outputs.add(name="last_hidden_state")  # the same outputs asked for: the same key
        stub.ModelInfer(plain, timeout=600)  # computed, and kept in the response cache
        body = _classified(64, 10**18).SerializeToString()

        def send() -> tuple[str, str]:
            try:
                answer = protocol.ModelInferResponse.FromString(channel.unary_unary(INFER)(body, timeout=600))
            except grpc.RpcError as e:
                return e.code().name, e.details() or ""
            assert list(answer.outputs[0].shape) == [64, MAX_CLASS_COUNT] and answer.outputs[0].datatype == "BYTES"
            return "OK", ""

        outcome = _attack(served, "classification of g2p_encoder [64, 512] x 192, count 10^18", send)
        assert outcome.code == "OK"
    _still_serves(served)


# --- the response cache: the first request's leaving strands no one ------------------------------------------------

HITS = 'qkv_cache_lookups_total{model="g2p_encoder",result="hit"}'
MISSES = 'qkv_cache_lookups_total{model="g2p_encoder",result="miss"}'


def _until(condition: Any, what: str) -> None:
    end = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < end, f"not within 60 s: {what}"
        time.sleep(0.01)


def test_the_first_request_cancelled_strands_none_of_the_three_that_joined_it(served: RunningServer) -> None:
    """Four identical requests queued behind a blocker: the first computes, three join it in the response
    cache. The first's client cancels: all three are answered (before: 0 of 8 trials), with the answer
    the model gives alone, computed once."""
    rng = np.random.default_rng(21)
    with grpc.insecure_channel(served.url, options=OPTIONS) as channel:  # room for a blocker's answer
        stub = protocol.Stub(channel)
        for rows in (8, 16, 32, 64):  # a longer blocker while this machine sends the four more slowly
            request = encoder_request(16, ENCODER_VOCAB, rng)
            runs = model_stats(stub, "g2p_encoder").inference_count
            blocker = stub.ModelInfer.future(blocker_request(rows, rng), timeout=600)
            _until(lambda b=blocker: computing_alone(served) or b.done(), "the blocker computing")
            metrics = scrape(served.metrics_url)
            hits, misses = metrics.get(HITS, 0), metrics.get(MISSES, 0)
            first = stub.ModelInfer.future(request, timeout=600)
            _until(lambda m=misses: scrape(served.metrics_url).get(MISSES, 0) > m, "the first request looked up")
            joined = [stub.ModelInfer.future(request, timeout=600) for _ in range(3)]
            _until(lambda h=hits: scrape(served.metrics_url).get(HITS, 0) >= h + 3, "three requests joined")
            held = not blocker.done()
            first.cancel()
            answers = [j.result() for j in joined]
            blocker.result()
            if held:
                break
        assert held, "a blocker of 64 x 512 tokens finished before four identical requests arrived"
        assert first.cancelled()
        assert model_stats(stub, "g2p_encoder").inference_count - runs == rows + 1  # the blocker's rows, and one
        alone = stub.ModelInfer(request, timeout=60)  # kept: the three's answer
        assert [a.raw_output_contents for a in answers] == [alone.raw_output_contents] * 3


def test_the_first_request_past_its_deadline_strands_none_of_the_three_that_joined_it(served: RunningServer) -> None:
    """The same, the first's client giving up at its deadline while the four wait behind the blocker: its
    computation, dropped at that deadline, is started again for the three, with theirs, and all three are
    answered. A round whose deadline came before the three joined, or after the blocker, is sent again with
    a longer deadline."""
    rng = np.random.default_rng(22)
    with grpc.insecure_channel(served.url, options=OPTIONS) as channel:  # room for the blocker's answer
        stub = protocol.Stub(channel)
        for patience in (
            1.0,
            2.0,
            4.0,
            8.0,
            16.0,
        ):  # the first's deadline: the three join within it, the blocker outlasts it
            request = encoder_request(16, ENCODER_VOCAB, rng)
            blocker = stub.ModelInfer.future(blocker_request(64, rng), timeout=600)
            _until(lambda b=blocker: computing_alone(served) or b.done(), "the blocker computing")
            hits = scrape(served.metrics_url).get(HITS, 0)
            first = stub.ModelInfer.future(request, timeout=patience)
            joined = [stub.ModelInfer.future(request, timeout=600) for _ in range(3)]
            answers = [j.result() for j in joined]
            blocker.result()
            gave_up = first.exception() is not None and first.exception().code() == grpc.StatusCode.DEADLINE_EXCEEDED
            joined_it = scrape(served.metrics_url).get(HITS, 0) - hits == 3  # (else one of them computed anew)
            if gave_up and joined_it:
                break
        assert gave_up and joined_it, "no round had the three join the first before its deadline, and it pass"
        alone = stub.ModelInfer(request, timeout=60)
        assert [a.raw_output_contents for a in answers] == [alone.raw_output_contents] * 3


# --- the response cache between tokens (--isolate-tokens) --------------------------------------------------------

TOKENS = ("alpha", "bravo", "probe")


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """g2p with each word's answer kept, behind three tokens kept apart."""
    scratch = tmp_path_factory.mktemp("attacks-cache-tokens")
    root = variant(MODELS, scratch / "models", {"g2p": {"response_cache": {"enable": True}}})
    (scratch / "tokens").write_text("\n".join(TOKENS) + "\n")
    args = ["--model-repository", str(root), "--auth-token-file", str(scratch / "tokens"), "--isolate-tokens"]
    args += ["--model-control-mode", "explicit", "--load-model", "g2p"]
    s = start_server(args, scratch / "server.log")
    yield s
    stop_server(s)


def _words(stub: Any, token: str, text: str) -> None:
    request = protocol.ModelInferRequest(model_name="g2p")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text.encode())
    stub.ModelInfer(request, timeout=60, metadata=_auth(token))


def _seen(stub: Any, token: str) -> tuple[int, int, int]:
    """What `token`'s ModelStatistics say of g2p's newest version: words decoded, cache hits, cache misses."""
    request = protocol.ModelStatisticsRequest(name="g2p", version="2")
    (s,) = stub.ModelStatistics(request, timeout=5, metadata=_auth(token)).model_stats
    return s.inference_count, s.inference_stats.cache_hit.count, s.inference_stats.cache_miss.count


def test_a_token_learns_nothing_of_anothers_words_from_the_cache(isolated: RunningServer) -> None:
    """Token alpha asks for words (words no lexicon holds: only decoded words are kept); bravo then asks for
    the same (before: bravo read alpha's words from `cache_hit` and from their 1.5 ms answers). Bravo's words
    are decoded as if never asked (no answer of alpha's reaches it), and each token's statistics count its
    own lookups alone."""
    with grpc.insecure_channel(isolated.url) as channel:
        stub = protocol.Stub(channel)
        _words(stub, "probe", "vorple")  # the probe's word, kept before the count of words decoded is read

        def send() -> tuple[str, str]:
            _words(stub, "alpha", "zorblat quimvex")
            _words(stub, "alpha", "zorblat quimvex")  # alpha's own answers, kept: two hits
            decoded, _, _ = _seen(stub, "alpha")
            _words(stub, "bravo", "zorblat quimvex")  # as if never asked: decoded again
            assert _seen(stub, "alpha")[0] - decoded == 2, "bravo's words came from alpha's answers"
            return "OK", ""

        outcome = _attack(isolated, "token B asks for token A's words (isolated tokens)", send, _auth("probe"))
        assert outcome.code == "OK"
        assert _seen(stub, "alpha")[1:] == (2, 2)  # alpha's own: 2 misses, then 2 hits
        assert _seen(stub, "bravo")[1:] == (0, 2)  # bravo's own: 2 misses; none of alpha's hits shown
    with h.InferenceServerClient(isolated.http_url) as client:  # the same over HTTP
        seen = client.get_inference_statistics("g2p", "2", headers={"authorization": "Bearer bravo"})
        stats = seen["model_stats"][0]["inference_stats"]
        assert stats["cache_hit"].get("count", 0) == 0 and stats["cache_miss"]["count"] == 2, stats
    _still_serves(isolated, _auth("probe"))
